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
``(M, S, O)`` per head and an online-softmax update (tile max, rescale, accumulate) per 32-row block
on the CPU and per tile of up to 256 owned rows on the GPU (the same sum, in a different grouping).

Two code paths from one source, chosen by ``ti.static``:
* CPU (serial): the outer loop over work items is what Taichi parallelises.  Inside, Q, the block's
  weights and the output accumulator live in local arrays with the G sibling heads contiguous
  (qT[d, h], P[r, h], OT[d, h]); the static head loops become 8-wide SIMD with no reduction over d
  (Taichi runs with fast_math off, so LLVM may not reorder one).  Known deficit: Taichi's CPU JIT
  emits no FMA and indexes ndarrays with 32-bit arithmetic LLVM cannot prove contiguous, so K/V
  loads stay scalar; docs/PERF.md measures what that costs against ggml.  The large local matrices
  make a cold compile take ~30-55 s per kernel (Taichi's offline cache keeps it after that).
* GPU (CUDA, Vulkan, Metal): producer_gpu.py, register-blocked tiles staged through shared memory.
"""


from types import SimpleNamespace

import taichi as ti

from .. import backend
from .common import BLOCK_ROWS, HEAD_MAJOR, RUNNING_MAX_INIT, TOKEN_MAJOR, VISIT_OWNER, f32_3d, f32_4d, i32_1d, i32_2d
from .halves import HALVES_PER_WORD, high, low, pack, packed_plane
from .producer_gpu import (SHARED_BUDGET_BYTES, describe_block_tile, gpu_producer_work, gpu_tile_plan, shared_arrays,
                           tile_overrides, udiv, umod)
from .producer_warp import (WARP_TILE_KNOBS, WarpTilePlan, describe_warp_tile, warp_producer_work, warp_shared_arrays,
                            warp_tile_plan)



def addressing(layout: str, n_kv: int):
    """The row addressing both paths share: work items, ring arithmetic, plane access, the fused store."""
    KV = n_kv

    @ti.func
    def plane_at(plane: ti.template(), slot, kvh, physical, w):
        """Word w of a row (dimensions 2w and 2w + 1: the planes are packed, halves.py)."""
        if ti.static(layout == TOKEN_MAJOR):
            return plane[slot, physical, kvh, w]
        else:
            return plane[slot, kvh, physical, w]

    @ti.func
    def row_offset(plane: ti.template(), slot, kvh, physical):
        """Flat word index of (slot, kvh, physical, 0) in the C-contiguous plane, for plane_flat."""
        n1, n2, n3 = plane.shape[1], plane.shape[2], plane.shape[3]
        offset = 0
        if ti.static(layout == TOKEN_MAJOR):
            offset = ((slot * n1 + physical) * n2 + kvh) * n3
        else:
            offset = ((slot * n1 + kvh) * n2 + physical) * n3
        return offset

    @ti.func
    def plane_flat(plane: ti.template(), offset):
        """The plane's word at a flat index (row_offset + w).  Taichi linearises plane[i, j, k, l] as
        ((i*n1 + j)*n2 + k)*n3 + l, so with zeros in front the index is used as is: the GPU producer builds
        a row's index once per tile row, not once per staged word (docs/PERF.md run 12).  Plane sizes
        stay under 2**31 halves (config.py checks), as Taichi's own 32-bit indexing needs."""
        return plane[0, 0, 0, offset]

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
    def fused_store(k_cur: ti.template(), v_cur: ti.template(), k_plane: ti.template(), v_plane: ti.template(),
                    layer, slot, kvh, row, w):
        """Word w (dimensions 2w, 2w + 1) of the current token's K and V rows, rounded to f16."""
        k = pack(k_cur[layer, kvh, 2 * w], k_cur[layer, kvh, 2 * w + 1])
        v = pack(v_cur[layer, kvh, 2 * w], v_cur[layer, kvh, 2 * w + 1])
        if ti.static(layout == TOKEN_MAJOR):
            k_plane[slot, row, kvh, w] = k
            v_plane[slot, row, kvh, w] = v
        else:
            k_plane[slot, kvh, row, w] = k
            v_plane[slot, kvh, row, w] = v

    return SimpleNamespace(plane_at=plane_at, row_offset=row_offset, plane_flat=plane_flat, work_item=work_item,
                           physical_of=physical_of, fused_store=fused_store)


def build_producer(head_dim: int, heads_per_kv: int, n_kv: int, gpu: bool, layout: str, bypass: bool, record: bool,
                   items_cap: int = 0):
    """Compile-time specialised producer kernel.

    layout: TOKEN_MAJOR (ring, addressed through origins) or HEAD_MAJOR (growing plane).
    bypass: the current token is read from k_cur/v_cur (f32) and stored into the plane by workgroup 0.
    record: add 1 + VISIT_OWNER*workgroup to ``visits[layer, block]`` per visit (ownership tests).
    items_cap: on a GPU, the most work items a launch may have, compiled in as the loop's bound
    (producer_kernel); 0: the bound is computed from the arguments.
    """
    at = addressing(layout, n_kv)
    if gpu:
        return build_gpu_producer(active_tile_plan(head_dim, heads_per_kv), n_kv, bypass, record, at, items_cap)
    return producer_kernel(n_kv, cpu_item=_cpu_item_work(head_dim, heads_per_kv, n_kv, bypass, record, at))


def build_gpu_producer(plan, n_kv: int, bypass: bool, record: bool, at, items_cap: int = 0):
    """The GPU producer for a tile plan (scripts/tune_gpu.py builds variants with plans of its own)."""
    return producer_kernel(n_kv, gpu=(plan, plan_work(plan, bypass, record, at, fused_store=bypass)),
                           items_cap=items_cap)


def tile_plan(heads_per_kv: int, head_dim: int, budget: int, arch: str | None = None, **overrides):
    """The GPU producer's plan: warp tiles (producer_warp.py) where they apply and WT is not 0, else the
    block tile with the other overrides' caps (producer_gpu.gpu_tile_plan)."""
    warp_tiles = overrides.pop("WT", 1)
    warp_knobs = {k: overrides.pop(k) for k in WARP_TILE_KNOBS if k in overrides}
    plan = warp_tile_plan(heads_per_kv, head_dim, budget, arch=arch, **warp_knobs) if warp_tiles else None
    return plan or gpu_tile_plan(heads_per_kv, head_dim, budget, **overrides)


def describe_plans(G: int, D: int) -> list[str]:
    """The GPU producer's tile on each backend, in words (scripts/decode.py --explain prints it)."""
    lines = [f"GPU producer tile for {G} heads per KV head at head_dim {D} (kernels/producer_warp.py, producer_gpu.py):"]
    for arch, budget in SHARED_BUDGET_BYTES.items():
        try:
            p = tile_plan(G, D, budget, arch, **tile_overrides())
        except ValueError as exc:
            lines.append(f"  {arch}: {exc}")
            continue
        text = describe_warp_tile(p, budget) if isinstance(p, WarpTilePlan) else describe_block_tile(p, arch, budget)
        lines.append(f"  {arch}: {text}")
    return lines


def plan_work(plan, bypass: bool, record: bool, at, fused_store: bool, layer_base: int = 0,
              slot_is_group: bool = False):
    """The per-thread work of either tile (one signature, producer_gpu.gpu_producer_work's)."""
    build = warp_producer_work if isinstance(plan, WarpTilePlan) else gpu_producer_work
    return build(plan, bypass, record, at, fused_store, layer_base, slot_is_group)


def plan_shared(plan) -> tuple:
    """The shared arrays of either tile, declared where called (producer_gpu.shared_arrays says why)."""
    return warp_shared_arrays(plan) if isinstance(plan, WarpTilePlan) else shared_arrays(plan)


def producer_kernel(n_kv: int, cpu_item=None, gpu=None, items_cap: int = 0):
    """The producer kernel, one signature for both paths: the CPU runs ``cpu_item`` (a ti.func of a work
    item) once per work item; a GPU runs ``gpu`` = (plan, work), T threads per work item, each with
    the workgroup's shared arrays (producer_gpu.shared_arrays).  items_cap (GPU): the loop's bound is
    items_cap workgroups, a constant, and those past the launch's n_group x n_kv x nwg items do nothing
    (splitk.gpu_items_cap says why); the caller keeps the items within it."""
    gpu_path = gpu is not None
    plan, work = gpu if gpu_path else (None, None)
    T = plan.T if gpu_path else 1

    @ti.kernel
    def producer(
        q: f32_3d, k_cur: f32_3d, v_cur: f32_3d, k_plane: packed_plane, v_plane: packed_plane,
        partials: f32_4d, visits: i32_2d,
        layers: i32_1d, slots: i32_1d, n_group: ti.i32,
        position: ti.i32, window: ti.i32, capacity: ti.i32, origin_logical: ti.i32, origin_physical: ti.i32,
        nwg: ti.i32, nsg: ti.i32, scale: ti.f32,
    ):
        if ti.static(gpu_path and items_cap > 0):
            ti.loop_config(block_dim=T)
            for t in range(items_cap * T):
                if udiv(t, T) < n_group * n_kv * nwg:  # uniform across a workgroup
                    work(umod(t, T), udiv(t, T), ti.static(plan_shared(plan)), q, k_cur, v_cur, k_plane, v_plane,
                         partials, visits, layers, slots, position, window, capacity, origin_logical,
                         origin_physical, nwg, nsg, scale)
        elif ti.static(gpu_path):
            ti.loop_config(block_dim=T)
            for t in range(n_group * n_kv * nwg * T):
                work(umod(t, T), udiv(t, T), ti.static(plan_shared(plan)), q, k_cur, v_cur, k_plane, v_plane,
                     partials, visits, layers, slots, position, window, capacity, origin_logical, origin_physical,
                     nwg, nsg, scale)
        else:
            for item in range(n_group * n_kv * nwg):  # one work item per (layer, kv head, workgroup)
                cpu_item(item, q, k_cur, v_cur, k_plane, v_plane, partials, visits, layers, slots, position, window,
                         capacity, origin_logical, origin_physical, nwg, nsg, scale)

    return producer


def active_tile_plan(head_dim: int, heads_per_kv: int):
    """The GPU producer's tile on the active backend (its shared-memory budget, MUSER_GPU_TILE's caps)."""
    arch = backend.active()
    return tile_plan(heads_per_kv, head_dim, SHARED_BUDGET_BYTES[arch], arch, **tile_overrides())


def plan_key(head_dim: int, heads_per_kv: int, gpu: bool):
    """What a kernel cache key needs of the tile: the active plan on a GPU (MUSER_GPU_TILE may change it
    between engines of one process), None on the CPU."""
    return active_tile_plan(head_dim, heads_per_kv) if gpu else None


def gpu_work(head_dim: int, heads_per_kv: int, n_kv: int, layout: str, bypass: bool, layer_base: int):
    """(per-thread work, tile plan) of the GPU producer for the one-dispatch step (step_gpu.py): the
    producer's ti.func without its fused store, which that step makes a task of its own, over every layer
    of a class: group layer g is ``layers[layer_base + g]`` in the step's one layer table, plane slot g."""
    plan = active_tile_plan(head_dim, heads_per_kv)
    work = plan_work(plan, bypass, False, addressing(layout, n_kv), fused_store=False, layer_base=layer_base,
                     slot_is_group=True)
    return work, plan


def _cpu_item_work(head_dim: int, heads_per_kv: int, n_kv: int, bypass: bool, record: bool, at):
    """The CPU producer's work for one work item, a ti.func (producer_kernel runs it per item)."""
    D, G = head_dim, heads_per_kv
    W = D // HALVES_PER_WORD  # words per plane row
    C = BLOCK_ROWS
    CPU_ROWS = 4  # K/V rows per register block (divides BLOCK_ROWS)

    @ti.func
    def row_pair(plane: ti.template(), slot, kvh, physical, w):
        """f32 values of dimensions 2w and 2w + 1 of a plane row (one packed word).  The bypass is not
        decided here: a per-element branch on ``logical == position`` cost 1.7x on the CPU (51.6 vs
        30.7 ms for one NoPE layer at 32,768 keys); the current row is patched once per block instead."""
        word = at.plane_at(plane, slot, kvh, physical, w)
        return low(word), high(word)

    @ti.func
    def next_owned(block, chunk_pos, nwg, nsg):
        """Advance to the workgroup's next owned block: nsg consecutive blocks, then skip nwg*nsg."""
        nb, nc = block + 1, chunk_pos + 1
        if nc == nsg:
            nb = block + 1 + (nwg - 1) * nsg
            nc = 0
        return nb, nc

    @ti.func
    def item_work(item, q: ti.template(), k_cur: ti.template(), v_cur: ti.template(), k_plane: ti.template(),
                  v_plane: ti.template(), partials: ti.template(), visits: ti.template(), layers: ti.template(),
                  slots: ti.template(), position, window, capacity, origin_logical, origin_physical, nwg, nsg, scale):
        """One work item (a layer, KV head and workgroup), serial inside: one CPU thread runs it."""
        g, kvh, wg, logical_start, visible = at.work_item(item, nwg, position, window)
        layer, slot = layers[g], slots[g]
        n_blocks = (visible + C - 1) // C
        if ti.static(bypass):
            if wg == 0:
                row = at.physical_of(position, capacity, origin_logical, origin_physical)
                for w in range(W):
                    at.fused_store(k_cur, v_cur, k_plane, v_plane, layer, slot, kvh, row, w)
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
                    physs[j] = at.physical_of(logicals[j], capacity, origin_logical, origin_physical)
                acc = ti.Matrix.zero(ti.f32, CPU_ROWS, G)
                for w in range(W):  # dimensions 2w, then 2w + 1: the sum's order is the per-dimension loop's
                    for j in ti.static(range(CPU_ROWS)):
                        k0, k1 = row_pair(k_plane, slot, kvh, physs[j], w)
                        for h in ti.static(range(G)):
                            acc[j, h] = acc[j, h] + qT[2 * w, h] * k0
                            acc[j, h] = acc[j, h] + qT[2 * w + 1, h] * k1
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
                    physs[j] = at.physical_of(logicals[j], capacity, origin_logical, origin_physical)
                    # bypass: the current row's plane slot gets weight 0 (0 x a finite f16 adds
                    # exactly nothing); its f32 value is added below
                    keep = r < count
                    if ti.static(bypass):
                        keep = keep and r != r_cur
                    if keep:
                        for h in ti.static(range(G)):
                            wts[j, h] = P[r, h]
                for w in range(W):
                    v0 = ti.Vector([0.0] * CPU_ROWS)
                    v1 = ti.Vector([0.0] * CPU_ROWS)
                    for j in ti.static(range(CPU_ROWS)):
                        pair = row_pair(v_plane, slot, kvh, physs[j], w)
                        v0[j] = pair[0]
                        v1[j] = pair[1]
                    for h in ti.static(range(G)):
                        o0, o1 = OT[2 * w, h], OT[2 * w + 1, h]
                        for j in ti.static(range(CPU_ROWS)):
                            o0 = o0 + wts[j, h] * v0[j]
                            o1 = o1 + wts[j, h] * v1[j]
                        OT[2 * w, h] = o0
                        OT[2 * w + 1, h] = o1
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

    return item_work


__all__ = ["build_producer", "build_gpu_producer", "addressing", "active_tile_plan", "describe_plans", "gpu_work",
           "plan_key", "plan_shared", "plan_work", "producer_kernel", "tile_plan",
           "TOKEN_MAJOR", "HEAD_MAJOR"]
