"""The split-K attention producer shared by the splitk (SWA) and interleaved (NoPE) routes.

Both routes compute the same thing (§16.2): for each query head and each workgroup, an online-
softmax summary ``[M, S, O]`` of the 32-token blocks that workgroup owns.  They differ only in how a
row is addressed (token-major ring vs head-major plane) and in where the current token comes from
(read back from the f16 plane, or bypassed as f32 from the activations with the store fused in).
Those differences are static parameters; everything else is this one source.

Scheduling, not math: one work item handles one (layer, KV head, workgroup) and all ``heads_per_kv``
sibling query heads of that KV head, so each K/V row is loaded once for the whole group.

Block ownership (the chapter's rule): block ``b`` belongs to workgroup ``(b // nsg) % nwg`` and
simdgroup ``b % nsg``; a workgroup therefore owns runs of ``nsg`` consecutive blocks, every
``nwg * nsg`` blocks.  Both paths walk exactly those blocks, in increasing order, with one running
``(M, S, O)`` per head and a per-block online-softmax update (block max, rescale, accumulate).

Two code paths from one source, chosen by ``ti.static``:
* CPU (serial): the outer loop over work items is what Taichi parallelises.  Inside, Q, the block's
  weights and the output accumulator live in local arrays with the G sibling heads contiguous
  (qT[d, h], P[r, h], OT[d, h]); the static head loops become 8-wide SIMD with no reduction over d
  (Taichi runs with fast_math off, so LLVM may not reorder one).  Known deficit: Taichi's CPU JIT
  emits no FMA and indexes ndarrays with 32-bit arithmetic LLVM cannot prove contiguous, so K/V
  loads stay scalar; docs/PERF.md measures what that costs against ggml.  The large local matrices
  make a cold compile take ~30-55 s per kernel (Taichi's offline cache keeps it after that).
* GPU (CUDA, Vulkan, Metal): a workgroup of WORKGROUP_THREADS threads stages Q, then each 32-row K
  tile and V tile, in shared memory; threads split the scores and the (head, d) accumulators.
"""


import math

import taichi as ti

from .common import (
    BLOCK_ROWS,
    HEAD_MAJOR,
    RUNNING_MAX_INIT,
    TOKEN_MAJOR,
    WORKGROUP_THREADS,
    f16_plane,
    f32_3d,
    f32_4d,
    i32_1d,
    i32_2d,
)

VISIT_OWNER = 64  # record mode adds 1 + 64*workgroup per visit: count = v % 64, owner = v // 64 (one visit)
Q_SHARED_LIMIT_FLOATS = 4096  # stage Q in shared memory only up to 16 KiB (Metal allows 32 KiB in all)


def build_producer(head_dim: int, heads_per_kv: int, n_kv: int, gpu: bool, layout: str, bypass: bool, record: bool):
    """Compile-time specialised producer kernel.

    layout: TOKEN_MAJOR (ring, addressed through origins) or HEAD_MAJOR (growing plane).
    bypass: the current token is read from k_cur/v_cur (f32) and stored into the plane by workgroup 0.
    record: add 1 + VISIT_OWNER*workgroup to ``visits[layer, block]`` per visit (ownership tests).
    """
    D, G, KV = head_dim, heads_per_kv, n_kv
    C = BLOCK_ROWS
    T = WORKGROUP_THREADS
    TILE_STRIDE = D + 1  # pad shared K/V tiles by one float so threads reading different rows hit different banks
    Q_IN_SHARED = G * D <= Q_SHARED_LIMIT_FLOATS
    CPU_ROWS = 4  # CPU: K/V rows per register block (divides BLOCK_ROWS)
    assert G <= T, "the GPU path keeps one head's softmax state per thread"
    # GPU register blocking.  Scores: HB heads x RB rows per thread over a tile of TILE_ROWS rows, so a
    # shared load of q or k feeds RB or HB FMAs.  V: VH heads x VD dims per thread.
    TILE_ROWS = 64 if D <= 128 else 32  # tile [TILE_ROWS][D+1] f32: 33 KiB at D=128, within 48 KiB with Q
    HB = math.gcd(G, 4)
    HEAD_GROUPS = G // HB
    SCORE_GROUPS = max(1, T // HEAD_GROUPS)  # threads along rows; tid // SCORE_GROUPS picks the head group
    RB = -(-TILE_ROWS // SCORE_GROUPS)
    SH_STEP, SR_STEP = HEAD_GROUPS, SCORE_GROUPS
    VD = 4
    V_DGROUPS = D // VD
    VH_GROUPS = T // V_DGROUPS
    VH = -(-G // VH_GROUPS)
    VH_STEP, VD_STEP = VH_GROUPS, V_DGROUPS
    assert HEAD_GROUPS <= T and V_DGROUPS <= T and TILE_ROWS * D % T == 0

    @ti.func
    def row_value(plane: ti.template(), slot, kvh, physical, d):
        """f32 value of element d of a plane row.  The bypass is not decided here: a per-element
        branch on ``logical == position`` cost 1.7x on the CPU (51.6 vs 30.7 ms for one NoPE layer at
        32,768 keys); the current row is patched once per block instead (cur_score / cur_value)."""
        return ti.cast(_plane_at(plane, slot, kvh, physical, d), ti.f32)

    @ti.func
    def _plane_at(plane: ti.template(), slot, kvh, physical, d):
        if ti.static(layout == TOKEN_MAJOR):
            return plane[slot, physical, kvh, d]
        else:
            return plane[slot, kvh, physical, d]

    @ti.func
    def work_item(item, nwg, position, window):
        """(group layer, KV head, workgroup, logical_start, visible) of a work item (§16.4)."""
        visible = position + 1
        if window > 0:
            visible = ti.min(position + 1, window)
        return item // (KV * nwg), (item // nwg) % KV, item % nwg, position + 1 - visible, visible

    @ti.func
    def physical_of(logical, capacity, origin_logical, origin_physical):
        return ti.raw_mod(origin_physical + logical - origin_logical, capacity)

    @ti.func
    def next_owned(block, chunk_pos, nwg, nsg):
        """Advance to the workgroup's next owned block: nsg consecutive blocks, then skip nwg*nsg."""
        nb, nc = block + 1, chunk_pos + 1
        if nc == nsg:
            nb = block + 1 + (nwg - 1) * nsg
            nc = 0
        return nb, nc

    @ti.func
    def fused_store(k_cur: ti.template(), v_cur: ti.template(), k_plane: ti.template(), v_plane: ti.template(),
                    layer, slot, kvh, row, d):
        if ti.static(layout == TOKEN_MAJOR):
            k_plane[slot, row, kvh, d] = ti.cast(k_cur[layer, kvh, d], ti.f16)
            v_plane[slot, row, kvh, d] = ti.cast(v_cur[layer, kvh, d], ti.f16)
        else:
            k_plane[slot, kvh, row, d] = ti.cast(k_cur[layer, kvh, d], ti.f16)
            v_plane[slot, kvh, row, d] = ti.cast(v_cur[layer, kvh, d], ti.f16)

    TILE_LOADS = TILE_ROWS * D // T  # elements each thread moves into a tile

    @ti.func
    def load_tile(plane: ti.template(), tile: ti.template(), rows_sh: ti.template(), slot, kvh, count, tid):
        """Fill a tile: every load issued before any store, so TILE_LOADS loads are in flight per
        thread (a load-store loop kept one outstanding load and waited out DRAM latency each time).
        Rows past ``count`` re-read the last valid row: in bounds, and never used."""
        vals = ti.Vector([0.0] * TILE_LOADS)
        for k in ti.static(range(TILE_LOADS)):
            e = tid + k * T
            r = ti.min(e // D, count - 1)
            vals[k] = row_value(plane, slot, kvh, rows_sh[r], e % D)
        for k in ti.static(range(TILE_LOADS)):
            e = tid + k * T
            tile[(e // D) * TILE_STRIDE + e % D] = vals[k]

    @ti.func
    def patch_current(cur: ti.template(), tile: ti.template(), layer, kvh, r_cur, count, tid):
        """The bypass on the GPU: the current token's tile row is overwritten with the f32 activations
        (a barrier first, since another thread may have written that row).  The condition is the
        same for the whole workgroup, so the barrier inside is safe."""
        if ti.static(bypass):
            if r_cur >= 0 and r_cur < count:
                ti.simt.block.sync()
                e = tid
                while e < D:
                    tile[r_cur * TILE_STRIDE + e] = cur[layer, kvh, e]
                    e += T

    @ti.kernel
    def producer(
        q: f32_3d, k_cur: f32_3d, v_cur: f32_3d, k_plane: f16_plane, v_plane: f16_plane,
        partials: f32_4d, visits: i32_2d,
        layers: i32_1d, slots: i32_1d, n_group: ti.i32,
        position: ti.i32, window: ti.i32, capacity: ti.i32, origin_logical: ti.i32, origin_physical: ti.i32,
        nwg: ti.i32, nsg: ti.i32, scale: ti.f32,
    ):
        if ti.static(not gpu):
            # ---------------- CPU: one work item per (layer, kv head, workgroup), serial inside -------
            for item in range(n_group * KV * nwg):
                g, kvh, wg, logical_start, visible = work_item(item, nwg, position, window)
                layer, slot = layers[g], slots[g]
                n_blocks = (visible + C - 1) // C
                if ti.static(bypass):
                    if wg == 0:
                        row = physical_of(position, capacity, origin_logical, origin_physical)
                        for d in range(D):
                            fused_store(k_cur, v_cur, k_plane, v_plane, layer, slot, kvh, row, d)
                # Everything hot lives in local (stack) arrays, vectorised across the G sibling heads:
                # qT[d, h] and OT[d, h] keep the heads contiguous, so the static head loops below
                # become 8-wide SIMD (no reductions over d, so no fast-math reassociation needed).
                qT = ti.Matrix.zero(ti.f32, D, G)
                OT = ti.Matrix.zero(ti.f32, D, G)
                P = ti.Matrix.zero(ti.f32, C, G)  # scores, then softmax weights, of one block
                m = ti.Vector([RUNNING_MAX_INIT] * G)
                s = ti.Vector([0.0] * G)
                for d in range(D):
                    for h in ti.static(range(G)):
                        qT[d, h] = q[layer, kvh * G + h, d]
                block = wg * nsg
                chunk_pos = 0
                while block < n_blocks:
                    if ti.static(record):
                        ti.atomic_add(visits[g, block], 1 + VISIT_OWNER * wg)
                    first = block * C
                    count = ti.min(C, visible - first)
                    # scores: CPU_ROWS rows at a time (a partial tail repeats the last row, unused)
                    for rr in range((count + CPU_ROWS - 1) // CPU_ROWS):
                        logicals = ti.Vector([0] * CPU_ROWS)
                        physs = ti.Vector([0] * CPU_ROWS)
                        for j in ti.static(range(CPU_ROWS)):
                            logicals[j] = logical_start + first + ti.min(rr * CPU_ROWS + j, count - 1)
                            physs[j] = physical_of(logicals[j], capacity, origin_logical, origin_physical)
                        acc = ti.Matrix.zero(ti.f32, CPU_ROWS, G)
                        for d in range(D):
                            for j in ti.static(range(CPU_ROWS)):
                                kd = row_value(k_plane, slot, kvh, physs[j], d)
                                for h in ti.static(range(G)):
                                    acc[j, h] = acc[j, h] + qT[d, h] * kd
                        for j in ti.static(range(CPU_ROWS)):
                            for h in ti.static(range(G)):
                                P[rr * CPU_ROWS + j, h] = acc[j, h] * scale
                    # the bypass: the current token's row (if in this block) scores against the f32
                    # activations, not the plane slot read above (which wg 0 may be rewriting)
                    r_cur = position - (logical_start + first)
                    if ti.static(bypass):
                        if r_cur < count:
                            cur = ti.Vector([0.0] * G)
                            for d in range(D):
                                kd = k_cur[layer, kvh, d]
                                for h in ti.static(range(G)):
                                    cur[h] = cur[h] + qT[d, h] * kd
                            for h in ti.static(range(G)):
                                P[r_cur, h] = cur[h] * scale
                    # online softmax per block: block max, rescale, weights
                    factor = ti.Vector([0.0] * G)
                    for h in ti.static(range(G)):
                        block_max = P[0, h]
                        for r in range(1, count):
                            block_max = ti.max(block_max, P[r, h])
                        new_max = ti.max(m[h], block_max)
                        factor[h] = ti.exp(m[h] - new_max)
                        m[h] = new_max
                        s[h] *= factor[h]
                    for r in range(count):
                        for h in ti.static(range(G)):
                            w = ti.exp(P[r, h] - m[h])
                            P[r, h] = w
                            s[h] += w
                    for d in range(D):
                        for h in ti.static(range(G)):
                            OT[d, h] = OT[d, h] * factor[h]
                    # V pass: CPU_ROWS rows at a time; rows past count get weight 0
                    for rr in range((count + CPU_ROWS - 1) // CPU_ROWS):
                        logicals = ti.Vector([0] * CPU_ROWS)
                        physs = ti.Vector([0] * CPU_ROWS)
                        wts = ti.Matrix.zero(ti.f32, CPU_ROWS, G)
                        for j in ti.static(range(CPU_ROWS)):
                            r = rr * CPU_ROWS + j
                            logicals[j] = logical_start + first + ti.min(r, count - 1)
                            physs[j] = physical_of(logicals[j], capacity, origin_logical, origin_physical)
                            # bypass: the current row's plane slot gets weight 0 (0 x a finite f16 adds
                            # exactly nothing); its f32 value is added below
                            keep = r < count
                            if ti.static(bypass):
                                keep = keep and r != r_cur
                            if keep:
                                for h in ti.static(range(G)):
                                    wts[j, h] = P[r, h]
                        for d in range(D):
                            vds = ti.Vector([0.0] * CPU_ROWS)
                            for j in ti.static(range(CPU_ROWS)):
                                vds[j] = row_value(v_plane, slot, kvh, physs[j], d)
                            for h in ti.static(range(G)):
                                o = OT[d, h]
                                for j in ti.static(range(CPU_ROWS)):
                                    o = o + wts[j, h] * vds[j]
                                OT[d, h] = o
                    if ti.static(bypass):
                        if r_cur < count:
                            for d in range(D):
                                vd = v_cur[layer, kvh, d]
                                for h in ti.static(range(G)):
                                    OT[d, h] = OT[d, h] + P[r_cur, h] * vd
                    block, chunk_pos = next_owned(block, chunk_pos, nwg, nsg)
                for h in ti.static(range(G)):
                    partials[g, kvh * G + h, wg, 0] = m[h]
                    partials[g, kvh * G + h, wg, 1] = s[h]
                for d in range(D):
                    for h in ti.static(range(G)):
                        partials[g, kvh * G + h, wg, 2 + d] = OT[d, h]
        else:
            # ---------------- GPU: one workgroup per (layer, kv head, workgroup), shared tiles -------
            # A tile is TILE_ROWS rows of the workgroup's current run of owned blocks (a run is nsg
            # consecutive blocks).  Scores are register-blocked HB heads x RB rows per thread and the
            # V accumulators VH heads x VD dims per thread, so each shared-memory load feeds several
            # FMAs: shared bandwidth, not arithmetic, bounds this kernel (Taichi has no vector
            # shared loads, warp shuffles only on CUDA, and no tensor cores).
            ti.loop_config(block_dim=T)
            for t in range(n_group * KV * nwg * T):
                tid = t % T
                item = t // T
                g, kvh, wg, logical_start, visible = work_item(item, nwg, position, window)
                layer, slot = layers[g], slots[g]
                n_blocks = (visible + C - 1) // C

                q_sh = ti.simt.block.SharedArray((G * D if ti.static(Q_IN_SHARED) else 1,), ti.f32)
                tile = ti.simt.block.SharedArray((TILE_ROWS * TILE_STRIDE,), ti.f32)
                w_sh = ti.simt.block.SharedArray((G * TILE_ROWS,), ti.f32)  # scores, then weights [h][r]
                part = ti.simt.block.SharedArray((G * SCORE_GROUPS,), ti.f32)  # per-(head, row group) max / sum
                rows_sh = ti.simt.block.SharedArray((TILE_ROWS,), ti.i32)  # physical row of each tile row
                state = ti.simt.block.SharedArray((3 * G,), ti.f32)  # M, S, rescale factor per head

                if ti.static(bypass):
                    if wg == 0:
                        row = physical_of(position, capacity, origin_logical, origin_physical)
                        e = tid
                        while e < D:
                            fused_store(k_cur, v_cur, k_plane, v_plane, layer, slot, kvh, row, e)
                            e += T
                if ti.static(Q_IN_SHARED):
                    e = tid
                    while e < G * D:
                        q_sh[e] = q[layer, kvh * G + e // D, e % D]
                        e += T
                if tid < G:
                    state[tid] = RUNNING_MAX_INIT
                    state[G + tid] = 0.0
                acc = ti.Matrix.zero(ti.f32, VH, VD)
                # this thread's tiles: scores for heads sh0 + i*SH_STEP, rows sr0 + j*SR_STEP;
                # outputs for heads vh0 + i*VH_STEP, dims vd0 + j*VD_STEP
                sh0, sr0 = tid // SCORE_GROUPS, tid % SCORE_GROUPS
                vh0, vd0 = tid // V_DGROUPS, tid % V_DGROUPS
                ti.simt.block.sync()

                run = wg  # the workgroup's k-th run of nsg blocks starts at block (k*nwg + wg)*nsg
                while run * nsg < n_blocks:  # uniform across the workgroup: barriers inside are safe
                    run_first = run * nsg * C
                    run_rows = ti.min(nsg * C, visible - run_first)
                    if ti.static(record):
                        if tid == 0:
                            b = run * nsg
                            while b < (run_first + run_rows + C - 1) // C:
                                ti.atomic_add(visits[g, b], 1 + VISIT_OWNER * wg)
                                b += 1
                    tile_first = 0
                    while tile_first < run_rows:
                        count = ti.min(TILE_ROWS, run_rows - tile_first)
                        first = run_first + tile_first
                        # the tile's physical rows, once per row (an integer modulo per element cost as
                        # much as the loads)
                        if tid < TILE_ROWS:
                            rows_sh[tid] = physical_of(logical_start + first + ti.min(tid, count - 1), capacity,
                                                       origin_logical, origin_physical)
                        ti.simt.block.sync()
                        load_tile(k_plane, tile, rows_sh, slot, kvh, count, tid)
                        patch_current(k_cur, tile, layer, kvh, position - (logical_start + first), count, tid)
                        ti.simt.block.sync()
                        # scores: HB heads x RB rows per thread, one shared load per operand per d
                        if sh0 < HEAD_GROUPS:
                            sc = ti.Matrix.zero(ti.f32, HB, RB)
                            for d in range(D):
                                kd = ti.Vector([tile[ti.min(sr0 + j * SR_STEP, TILE_ROWS - 1) * TILE_STRIDE + d]
                                                for j in ti.static(range(RB))])
                                for i in ti.static(range(HB)):
                                    qd = 0.0
                                    if ti.static(Q_IN_SHARED):
                                        qd = q_sh[(sh0 + i * SH_STEP) * D + d]
                                    else:
                                        qd = q[layer, kvh * G + sh0 + i * SH_STEP, d]
                                    for j in ti.static(range(RB)):
                                        sc[i, j] = sc[i, j] + qd * kd[j]
                            for i in ti.static(range(HB)):
                                h = sh0 + i * SH_STEP
                                local_max = RUNNING_MAX_INIT
                                for j in ti.static(range(RB)):
                                    r = sr0 + j * SR_STEP
                                    if r < TILE_ROWS:
                                        value = sc[i, j] * scale
                                        if r >= count:
                                            value = RUNNING_MAX_INIT
                                        w_sh[h * TILE_ROWS + r] = value
                                        local_max = ti.max(local_max, value)
                                part[h * SCORE_GROUPS + sr0] = local_max
                        ti.simt.block.sync()
                        if tid < G:  # tile max per head
                            tile_max = part[tid * SCORE_GROUPS]
                            for j in range(1, SCORE_GROUPS):
                                tile_max = ti.max(tile_max, part[tid * SCORE_GROUPS + j])
                            new_max = ti.max(state[tid], tile_max)
                            state[2 * G + tid] = ti.exp(state[tid] - new_max)
                            state[tid] = new_max
                        ti.simt.block.sync()
                        # weights in parallel: every thread exponentiates its own scores
                        if sh0 < HEAD_GROUPS:
                            for i in ti.static(range(HB)):
                                h = sh0 + i * SH_STEP
                                local_sum = 0.0
                                for j in ti.static(range(RB)):
                                    r = sr0 + j * SR_STEP
                                    if r < TILE_ROWS:
                                        w = 0.0
                                        if r < count:
                                            w = ti.exp(w_sh[h * TILE_ROWS + r] - state[h])
                                        w_sh[h * TILE_ROWS + r] = w
                                        local_sum += w
                                part[h * SCORE_GROUPS + sr0] = local_sum
                        # V tile -> shared (every thread is past its reads of the K tile)
                        load_tile(v_plane, tile, rows_sh, slot, kvh, count, tid)
                        patch_current(v_cur, tile, layer, kvh, position - (logical_start + first), count, tid)
                        ti.simt.block.sync()
                        if tid < G:
                            total = 0.0
                            for j in range(SCORE_GROUPS):
                                total += part[tid * SCORE_GROUPS + j]
                            state[G + tid] = state[G + tid] * state[2 * G + tid] + total
                        # V accumulate: VH heads x VD dims per thread (heads past G: idle lanes)
                        for i in ti.static(range(VH)):
                            f = state[2 * G + ti.min(vh0 + i * VH_STEP, G - 1)]
                            for j in ti.static(range(VD)):
                                acc[i, j] = acc[i, j] * f
                        for r in range(count):
                            vr = ti.Vector([tile[r * TILE_STRIDE + vd0 + j * VD_STEP] for j in ti.static(range(VD))])
                            for i in ti.static(range(VH)):
                                w = w_sh[ti.min(vh0 + i * VH_STEP, G - 1) * TILE_ROWS + r]
                                for j in ti.static(range(VD)):
                                    acc[i, j] = acc[i, j] + w * vr[j]
                        ti.simt.block.sync()  # the next tile overwrites tile, w_sh and part
                        tile_first += TILE_ROWS
                    run += nwg

                for i in ti.static(range(VH)):
                    if vh0 + i * VH_STEP < G:
                        for j in ti.static(range(VD)):
                            partials[g, kvh * G + vh0 + i * VH_STEP, wg, 2 + vd0 + j * VD_STEP] = acc[i, j]
                if tid < G:
                    partials[g, kvh * G + tid, wg, 0] = state[tid]
                    partials[g, kvh * G + tid, wg, 1] = state[G + tid]

    return producer


__all__ = ["build_producer", "TOKEN_MAJOR", "HEAD_MAJOR"]
