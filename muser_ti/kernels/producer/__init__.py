"""The split-K attention producer shared by the splitk (SWA) and interleaved (NoPE) routes.

Both routes compute the same thing (§16.2): for each query head and each workgroup, an online-
softmax summary ``[M, S, O]`` of the 32-token blocks that workgroup owns.  They differ only in how a
row is addressed (token-major ring vs head-major plane) and in where the current token comes from
(read back from the f16 plane, or bypassed as f32 from the activations with the store fused in).
Those differences are static parameters; everything else is one source.

Scheduling, not math: one work item handles one (layer, KV head, workgroup) and all ``heads_per_kv``
sibling query heads of that KV head, so each K/V row is loaded once for the whole group.

Block ownership (the chapter's rule): block ``b`` belongs to workgroup ``(b // nsg) % nwg`` and
simdgroup ``b % nsg``; a workgroup therefore owns runs of ``nsg`` consecutive blocks, every
``nwg * nsg`` blocks.  Every path walks exactly those blocks, in increasing order, with one running
``(M, S, O)`` per head and an online-softmax update per 32-row block on the CPU and per tile of owned
rows on a GPU (the same sum, in a different grouping).

The paths, chosen by ``ti.static`` on the arch: cpu.py (serial per work item); on GPUs
(CUDA, Vulkan, Metal) warp_tile.py where the group shape and shared memory allow, else block_tile.py,
on the helpers both share (gpu_common.py).
"""


from types import SimpleNamespace

import taichi as ti

from ... import backend
from ..common import (GROUP_NSG, GROUP_NWG, GROUP_ORIGIN_LOGICAL, GROUP_ORIGIN_PHYSICAL, GROUP_POSITION, HEAD_MAJOR,
                      TOKEN_MAJOR, f32_3d, f32_4d, i32_1d, i32_2d)
from ..halves import pack, packed_plane
from .block_tile import describe_block_tile, gpu_producer_work, gpu_tile_plan, shared_arrays
from .cpu import cpu_item_work
from .gpu_common import SHARED_BUDGET_BYTES, tile_choice, udiv, umod
from .warp_tile import WarpTilePlan, describe_warp_tile, warp_producer_work, warp_shared_arrays, warp_tile_plan

# Taichi 1.7.4's CPU backend hands a range-for to its threads in tasks of 512 iterations, whatever
# loop_config(block_dim) or default_cpu_block_dim say (measured: a 64-item loop ran on one of the two
# cores, 600 items on 1.17 of them), and a layer has tens of work items.  So the producer's loop runs
# CPU_TASK_ITERATIONS iterations per item, all but the first empty: one task per item, and every core busy.
CPU_TASK_ITERATIONS = 512


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
        a row's index once per tile row, not once per staged word.  Plane sizes
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
                   items_cap: int = 0, per_group: bool = False, serial: bool = False):
    """Compile-time specialised producer kernel.

    layout: TOKEN_MAJOR (ring, addressed through origins) or HEAD_MAJOR (growing plane).
    bypass: the current token is read from k_cur/v_cur (f32) and stored into the plane by workgroup 0.
    record: add 1 + VISIT_OWNER*workgroup to ``visits[layer, block]`` per visit (ownership tests).
    items_cap: on a GPU, the most work items a launch may have, compiled in as the loop's bound
    (producer_kernel); 0: the bound is computed from the arguments.
    per_group: every group its own position, origins and split (a batch's sequences: group_producer_kernel).
    serial (CPU): the work items on the launching thread (serial_producer_kernel).
    """
    at = addressing(layout, n_kv)
    if gpu:
        plan = active_tile_plan(head_dim, heads_per_kv)
        if per_group:
            return group_producer_kernel(n_kv, gpu=(plan, plan_work(plan, bypass, record, at, fused_store=bypass)))
        return build_gpu_producer(plan, n_kv, bypass, record, at, items_cap)
    cpu_item = cpu_item_work(head_dim, heads_per_kv, n_kv, bypass, record, at)
    if per_group:
        return group_producer_kernel(n_kv, cpu_item=cpu_item, serial=serial)
    return serial_producer_kernel(cpu_item, n_kv) if serial else producer_kernel(n_kv, cpu_item=cpu_item)


def build_gpu_producer(plan, n_kv: int, bypass: bool, record: bool, at, items_cap: int = 0):
    """The GPU producer for a tile plan (the lab's tune_gpu.py builds both tiles in one process)."""
    return producer_kernel(n_kv, gpu=(plan, plan_work(plan, bypass, record, at, fused_store=bypass)),
                           items_cap=items_cap)


def tile_plan(heads_per_kv: int, head_dim: int, budget: int, arch: str | None = None, tile: str | None = None,
              unroll: int | None = None):
    """The GPU producer's plan: the warp tile where it applies (and ``tile`` is not "block"), else the block
    tile; ``unroll``: the warp tile's (its UNROLL for ``arch`` when None)."""
    plan = warp_tile_plan(heads_per_kv, head_dim, budget, WU=unroll, arch=arch) if tile != "block" else None
    return plan or gpu_tile_plan(heads_per_kv, head_dim, budget)


def describe_plans(G: int, D: int) -> list[str]:
    """The GPU producer's tile on each backend, in words (muser-decode --explain prints it)."""
    lines = [f"GPU producer tile for {G} heads per KV head at head_dim {D} (kernels/producer/warp_tile.py, "
             f"block_tile.py):"]
    for arch, budget in SHARED_BUDGET_BYTES.items():
        try:
            p = tile_plan(G, D, budget, arch, **tile_choice())
        except ValueError as exc:
            lines.append(f"  {arch}: {exc}")
            continue
        text = describe_warp_tile(p, budget) if isinstance(p, WarpTilePlan) else describe_block_tile(p, arch, budget)
        lines.append(f"  {arch}: {text}")
    return lines


def plan_work(plan, bypass: bool, record: bool, at, fused_store: bool, layer_base: int = 0,
              slot_is_group: bool = False):
    """The per-thread work of either tile (one signature, block_tile.gpu_producer_work's)."""
    build = warp_producer_work if isinstance(plan, WarpTilePlan) else gpu_producer_work
    return build(plan, bypass, record, at, fused_store, layer_base, slot_is_group)


def plan_shared(plan) -> tuple:
    """The shared arrays of either tile, declared where called (block_tile.shared_arrays says why)."""
    return warp_shared_arrays(plan) if isinstance(plan, WarpTilePlan) else shared_arrays(plan)


def producer_kernel(n_kv: int, cpu_item=None, gpu=None, items_cap: int = 0):
    """The producer kernel, one signature for both paths: the CPU runs ``cpu_item`` (a ti.func of a work
    item) once per work item; a GPU runs ``gpu`` = (plan, work), T threads per work item, each with
    the workgroup's shared arrays (block_tile.shared_arrays).  items_cap (GPU): the loop's bound is
    items_cap workgroups, a constant, and those past the launch's n_group x n_kv x nwg items do nothing
    (split_geometry.gpu_items_cap says why); the caller keeps the items within it."""
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
            # one work item per (layer, kv head, workgroup), one item per CPU task (CPU_TASK_ITERATIONS says why)
            for t in range(n_group * n_kv * nwg * CPU_TASK_ITERATIONS):
                if t & (CPU_TASK_ITERATIONS - 1) == 0:
                    cpu_item(t // CPU_TASK_ITERATIONS, q, k_cur, v_cur, k_plane, v_plane, partials, visits, layers,
                             slots, position, window, capacity, origin_logical, origin_physical, nwg, nsg, scale)

    return producer


def serial_producer_kernel(cpu_item, n_kv: int):
    """The CPU producer without Taichi's thread pool: the launch's items first, first + stride, ... one after
    another on the launching thread, each the same work as in producer_kernel (so the same bits).  Taichi's Python
    path runs one layer's items all on one thread at short context (first 0, stride 1: split_geometry.cpu_serial),
    where waking Taichi's pool costs more than the work (docs/PERF.md, "A model's calls on the CPU, one layer at a
    time"); the compiled path folds the same items into its layer kernel (layer_kernel.py)."""

    @ti.kernel
    def serial_producer(
        q: f32_3d, k_cur: f32_3d, v_cur: f32_3d, k_plane: packed_plane, v_plane: packed_plane,
        partials: f32_4d, visits: i32_2d,
        layers: i32_1d, slots: i32_1d, n_group: ti.i32,
        position: ti.i32, window: ti.i32, capacity: ti.i32, origin_logical: ti.i32, origin_physical: ti.i32,
        nwg: ti.i32, nsg: ti.i32, scale: ti.f32, first: ti.i32, stride: ti.i32,
    ):
        ti.loop_config(serialize=True)
        for j in range((n_group * n_kv * nwg - first + stride - 1) // stride):
            cpu_item(first + j * stride, q, k_cur, v_cur, k_plane, v_plane, partials, visits, layers, slots,
                     position, window, capacity, origin_logical, origin_physical, nwg, nsg, scale)

    return serial_producer


def group_producer_kernel(n_kv: int, cpu_item=None, gpu=None, serial: bool = False):
    """The producer over groups that each have their own position, origins and split: a batch's sequences, group
    g being sequence g (its activations row ``layers[g]``, its plane slot ``slots[g]``, its values in
    ``state[g, GROUP_*]``).  The launch walks ``n_group x n_kv x nwg_max`` work items; group g's item (kvh, wg)
    runs only where wg < its own nwg, and is handed to the same per-item work as producer_kernel's as the item
    index it has in a launch of g's own split, so each group's partials are, bit for bit, those of a launch of
    its own.  Capacity and window are the class's (one pool: every sequence's ring and plane alike).  serial (CPU):
    the items first, first + stride, ... on the launching thread (two more arguments), as serial_producer_kernel."""
    gpu_path = gpu is not None
    plan, work = gpu if gpu_path else (None, None)
    T = plan.T if gpu_path else 1

    @ti.func
    def own_item(item, state: ti.template(), nwg_max):
        """(group, the item's index in a launch of the group's own split, or -1 where wg is past that split)."""
        per = n_kv * nwg_max
        g = item // per
        kvh, wg = (item % per) // nwg_max, item % nwg_max
        nwg = state[g, GROUP_NWG]
        own = -1
        if wg < nwg:
            own = (g * n_kv + kvh) * nwg + wg
        return g, own

    @ti.func
    def cpu_own_item(item, q: ti.template(), k_cur: ti.template(), v_cur: ti.template(), k_plane: ti.template(),
                     v_plane: ti.template(), partials: ti.template(), visits: ti.template(), layers: ti.template(),
                     slots: ti.template(), state: ti.template(), window, capacity, nwg_max, scale):
        g, own = own_item(item, state, nwg_max)
        if own >= 0:
            cpu_item(own, q, k_cur, v_cur, k_plane, v_plane, partials, visits, layers, slots,
                     state[g, GROUP_POSITION], window, capacity, state[g, GROUP_ORIGIN_LOGICAL],
                     state[g, GROUP_ORIGIN_PHYSICAL], state[g, GROUP_NWG], state[g, GROUP_NSG], scale)

    if serial:
        @ti.kernel
        def serial_group_producer(
            q: f32_3d, k_cur: f32_3d, v_cur: f32_3d, k_plane: packed_plane, v_plane: packed_plane,
            partials: f32_4d, visits: i32_2d, layers: i32_1d, slots: i32_1d, n_group: ti.i32, state: i32_2d,
            window: ti.i32, capacity: ti.i32, nwg_max: ti.i32, scale: ti.f32, first: ti.i32, stride: ti.i32,
        ):
            ti.loop_config(serialize=True)
            for j in range((n_group * n_kv * nwg_max - first + stride - 1) // stride):
                cpu_own_item(first + j * stride, q, k_cur, v_cur, k_plane, v_plane, partials, visits, layers, slots,
                             state, window, capacity, nwg_max, scale)

        return serial_group_producer

    @ti.kernel
    def group_producer(
        q: f32_3d, k_cur: f32_3d, v_cur: f32_3d, k_plane: packed_plane, v_plane: packed_plane,
        partials: f32_4d, visits: i32_2d, layers: i32_1d, slots: i32_1d, n_group: ti.i32, state: i32_2d,
        window: ti.i32, capacity: ti.i32, nwg_max: ti.i32, scale: ti.f32,
    ):
        if ti.static(gpu_path):
            ti.loop_config(block_dim=T)
            for t in range(n_group * n_kv * nwg_max * T):
                g, own = own_item(udiv(t, T), state, nwg_max)
                if own >= 0:  # uniform across a workgroup: its T threads share the item
                    work(umod(t, T), own, ti.static(plan_shared(plan)), q, k_cur, v_cur, k_plane, v_plane, partials,
                         visits, layers, slots, state[g, GROUP_POSITION], window, capacity,
                         state[g, GROUP_ORIGIN_LOGICAL], state[g, GROUP_ORIGIN_PHYSICAL], state[g, GROUP_NWG],
                         state[g, GROUP_NSG], scale)
        else:
            for t in range(n_group * n_kv * nwg_max * CPU_TASK_ITERATIONS):  # one item a CPU task, as producer_kernel
                if t & (CPU_TASK_ITERATIONS - 1) == 0:
                    cpu_own_item(t // CPU_TASK_ITERATIONS, q, k_cur, v_cur, k_plane, v_plane, partials, visits,
                                 layers, slots, state, window, capacity, nwg_max, scale)

    return group_producer


def active_tile_plan(head_dim: int, heads_per_kv: int):
    """The GPU producer's tile on the active backend (its shared-memory budget; MUSER_GPU_TILE and
    MUSER_GPU_UNROLL where set, gpu_common.tile_choice)."""
    arch = backend.active()
    return tile_plan(heads_per_kv, head_dim, SHARED_BUDGET_BYTES[arch], arch, **tile_choice())


def plan_key(head_dim: int, heads_per_kv: int, gpu: bool):
    """What a kernel cache key needs of the tile: the active plan on a GPU (MUSER_GPU_TILE may change it
    between engines of one process), None on the CPU."""
    return active_tile_plan(head_dim, heads_per_kv) if gpu else None


def gpu_work(head_dim: int, heads_per_kv: int, n_kv: int, layout: str, bypass: bool, layer_base: int):
    """(per-thread work, tile plan) of the GPU producer for the one-dispatch step (one_dispatch.py): the
    producer's ti.func without its fused store, which that step makes a task of its own, over every layer
    of a class: group layer g is ``layers[layer_base + g]`` in the step's one layer table, plane slot g."""
    plan = active_tile_plan(head_dim, heads_per_kv)
    work = plan_work(plan, bypass, False, addressing(layout, n_kv), fused_store=False, layer_base=layer_base,
                     slot_is_group=True)
    return work, plan


__all__ = ["build_producer", "build_gpu_producer", "group_producer_kernel", "addressing", "active_tile_plan",
           "describe_plans", "gpu_work", "plan_key", "plan_shared", "plan_work", "producer_kernel",
           "serial_producer_kernel", "tile_plan",
           "TOKEN_MAJOR", "HEAD_MAJOR"]
