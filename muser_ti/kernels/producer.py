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
* CPU (serial): the outer loop over work items is what Taichi parallelises; inside, straight-line f32
  arithmetic over static ranges that LLVM can vectorise.
* GPU (CUDA, Vulkan, Metal): a workgroup of WORKGROUP_THREADS threads stages Q, then each 32-row K
  tile and V tile, in shared memory; threads split the scores and the (head, d) accumulators.
"""


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
    f32_2d,
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
    N_ACC = (G * D + T - 1) // T
    N_SCORE = (G * C + T - 1) // T
    Q_IN_SHARED = G * D <= Q_SHARED_LIMIT_FLOATS
    assert G <= T, "the GPU path keeps one head's softmax state per thread"

    @ti.func
    def row_value(plane: ti.template(), cur: ti.template(), layer, slot, kvh, logical, physical, position, d):
        """f32 value of element d of a row; the current token comes from the activations under bypass."""
        value = 0.0
        if ti.static(bypass):
            if logical == position:
                value = cur[layer, kvh, d]
            else:
                value = ti.cast(_plane_at(plane, slot, kvh, physical, d), ti.f32)
        else:
            value = ti.cast(_plane_at(plane, slot, kvh, physical, d), ti.f32)
        return value

    @ti.func
    def _plane_at(plane: ti.template(), slot, kvh, physical, d):
        if ti.static(layout == TOKEN_MAJOR):
            return plane[slot, physical, kvh, d]
        else:
            return plane[slot, kvh, physical, d]

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

    @ti.kernel
    def producer(
        q: f32_3d, k_cur: f32_3d, v_cur: f32_3d, k_plane: f16_plane, v_plane: f16_plane,
        partials: f32_4d, scores: f32_3d, row_buf: f32_2d, visits: i32_2d,
        layers: i32_1d, slots: i32_1d, n_group: ti.i32,
        position: ti.i32, window: ti.i32, capacity: ti.i32, origin_logical: ti.i32, origin_physical: ti.i32,
        nwg: ti.i32, nsg: ti.i32, scale: ti.f32,
    ):
        if ti.static(not gpu):
            # ---------------- CPU: one work item per (layer, kv head, workgroup), serial inside -------
            for item in range(n_group * KV * nwg):
                g = item // (KV * nwg)
                kvh = (item // nwg) % KV
                wg = item % nwg
                layer, slot = layers[g], slots[g]
                visible = position + 1
                if window > 0:
                    visible = ti.min(position + 1, window)
                logical_start = position + 1 - visible
                n_blocks = (visible + C - 1) // C
                if ti.static(bypass):
                    if wg == 0:
                        row = physical_of(position, capacity, origin_logical, origin_physical)
                        for d in range(D):
                            fused_store(k_cur, v_cur, k_plane, v_plane, layer, slot, kvh, row, d)
                m = ti.Vector([RUNNING_MAX_INIT] * G)
                s = ti.Vector([0.0] * G)
                for h in range(G):
                    for d in range(D):
                        partials[g, kvh * G + h, wg, 2 + d] = 0.0
                block = wg * nsg
                chunk_pos = 0
                while block < n_blocks:
                    if ti.static(record):
                        ti.atomic_add(visits[g, block], 1 + VISIT_OWNER * wg)
                    first = block * C
                    count = ti.min(C, visible - first)
                    # scores of the block for all sibling heads; each K row converted once
                    for r in range(count):
                        logical = logical_start + first + r
                        phys = physical_of(logical, capacity, origin_logical, origin_physical)
                        for d in range(D):
                            row_buf[item, d] = row_value(k_plane, k_cur, layer, slot, kvh, logical, phys, position, d)
                        for h in range(G):
                            dot = 0.0
                            for d in range(D):
                                dot += q[layer, kvh * G + h, d] * row_buf[item, d]
                            scores[item, h, r] = dot * scale
                    # online softmax per block: block max, rescale, weights
                    for h in range(G):
                        block_max = scores[item, h, 0]
                        for r in range(1, count):
                            block_max = ti.max(block_max, scores[item, h, r])
                        new_max = ti.max(m[h], block_max)
                        factor = ti.exp(m[h] - new_max)
                        m[h] = new_max
                        s[h] *= factor
                        for d in range(D):
                            partials[g, kvh * G + h, wg, 2 + d] = partials[g, kvh * G + h, wg, 2 + d] * factor
                        for r in range(count):
                            w = ti.exp(scores[item, h, r] - new_max)
                            scores[item, h, r] = w
                            s[h] += w
                    # V pass: each V row converted once, accumulated into every head
                    for r in range(count):
                        logical = logical_start + first + r
                        phys = physical_of(logical, capacity, origin_logical, origin_physical)
                        for d in range(D):
                            row_buf[item, d] = row_value(v_plane, v_cur, layer, slot, kvh, logical, phys, position, d)
                        for h in range(G):
                            w = scores[item, h, r]
                            for d in range(D):
                                # plain assignment, not +=: += on an ndarray is an atomic add
                                partials[g, kvh * G + h, wg, 2 + d] = partials[g, kvh * G + h, wg, 2 + d] + w * row_buf[item, d]
                    block, chunk_pos = next_owned(block, chunk_pos, nwg, nsg)
                for h in ti.static(range(G)):
                    partials[g, kvh * G + h, wg, 0] = m[h]
                    partials[g, kvh * G + h, wg, 1] = s[h]
        else:
            # ---------------- GPU: one workgroup per (layer, kv head, workgroup), shared tiles -------
            ti.loop_config(block_dim=T)
            for t in range(n_group * KV * nwg * T):
                tid = t % T
                item = t // T
                g = item // (KV * nwg)
                kvh = (item // nwg) % KV
                wg = item % nwg
                layer, slot = layers[g], slots[g]
                visible = position + 1
                if window > 0:
                    visible = ti.min(position + 1, window)
                logical_start = position + 1 - visible
                n_blocks = (visible + C - 1) // C

                q_sh = ti.simt.block.SharedArray((G * D if ti.static(Q_IN_SHARED) else 1,), ti.f32)
                tile = ti.simt.block.SharedArray((C * TILE_STRIDE,), ti.f32)
                w_sh = ti.simt.block.SharedArray((G * C,), ti.f32)
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
                acc = ti.Vector([0.0] * N_ACC)
                ti.simt.block.sync()

                block = wg * nsg
                chunk_pos = 0
                while block < n_blocks:  # uniform across the workgroup: barriers inside are safe
                    if ti.static(record):
                        if tid == 0:
                            ti.atomic_add(visits[g, block], 1 + VISIT_OWNER * wg)
                    first = block * C
                    count = ti.min(C, visible - first)
                    # K tile -> shared (consecutive threads read consecutive halves of a row)
                    e = tid
                    while e < C * D:
                        r, d = e // D, e % D
                        if r < count:
                            logical = logical_start + first + r
                            phys = physical_of(logical, capacity, origin_logical, origin_physical)
                            tile[r * TILE_STRIDE + d] = row_value(k_plane, k_cur, layer, slot, kvh, logical, phys, position, d)
                        e += T
                    ti.simt.block.sync()
                    for j in ti.static(range(N_SCORE)):
                        e = tid + j * T
                        if e < G * C:
                            h, r = e // C, e % C
                            if r < count:
                                dot = 0.0
                                for d in range(D):
                                    qd = 0.0
                                    if ti.static(Q_IN_SHARED):
                                        qd = q_sh[h * D + d]
                                    else:
                                        qd = q[layer, kvh * G + h, d]
                                    dot += qd * tile[r * TILE_STRIDE + d]
                                w_sh[e] = dot * scale
                    ti.simt.block.sync()
                    if tid < G:  # one thread per head: block max, rescale, weights
                        h = tid
                        old_max = state[h]
                        block_max = w_sh[h * C]
                        for r in range(1, count):
                            block_max = ti.max(block_max, w_sh[h * C + r])
                        new_max = ti.max(old_max, block_max)
                        factor = ti.exp(old_max - new_max)
                        total = state[G + h] * factor
                        for r in range(count):
                            w = ti.exp(w_sh[h * C + r] - new_max)
                            w_sh[h * C + r] = w
                            total = total + w
                        state[h] = new_max
                        state[G + h] = total
                        state[2 * G + h] = factor
                    # V tile -> shared (the K tile is no longer read)
                    e = tid
                    while e < C * D:
                        r, d = e // D, e % D
                        if r < count:
                            logical = logical_start + first + r
                            phys = physical_of(logical, capacity, origin_logical, origin_physical)
                            tile[r * TILE_STRIDE + d] = row_value(v_plane, v_cur, layer, slot, kvh, logical, phys, position, d)
                        e += T
                    ti.simt.block.sync()
                    for j in ti.static(range(N_ACC)):
                        e = tid + j * T
                        if e < G * D:
                            h, d = e // D, e % D
                            a = acc[j] * state[2 * G + h]
                            for r in range(count):
                                a += w_sh[h * C + r] * tile[r * TILE_STRIDE + d]
                            acc[j] = a
                    ti.simt.block.sync()  # the next block overwrites tile and w_sh
                    block, chunk_pos = next_owned(block, chunk_pos, nwg, nsg)

                for j in ti.static(range(N_ACC)):
                    e = tid + j * T
                    if e < G * D:
                        partials[g, kvh * G + e // D, wg, 2 + e % D] = acc[j]
                if tid < G:
                    partials[g, kvh * G + tid, wg, 0] = state[tid]
                    partials[g, kvh * G + tid, wg, 1] = state[G + tid]

    return producer


__all__ = ["build_producer", "TOKEN_MAJOR", "HEAD_MAJOR"]
