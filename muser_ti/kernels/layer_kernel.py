"""One layer of a per-layer token as one launch: the token scan, the store, the producer and the merge, folded.

Why.  Through Taichi's C-API each launch costs the host ~1.2 us and each array argument ~1.4 us more on the CPU
(docs/PERF.md, "A model's calls on the CPU, one layer at a time"), 16-18 us a launch on CUDA; a layer's four
kernels (scan, store, producer, reducer) bind 21 arrays between them, this one kernel 11.  Folding is also what a
captured CUDA graph needs: one node a layer where there were four.

What it runs, in order, each part where ``parts`` (LAYER_*) asks for it:

1. the scan (token_scan's ``check`` for every value of the layer's q, k, v), stamping the flags;
2. the store of the token's K and V rows into the route's plane;
3. the producer's work items ``first, first + stride, ...`` (the CPU) or all of them (a GPU);
4. the merge of the partials into ``out``.

Parts 2-4 run only where the scan passed the token (token_scan.token_accepted since this token's stamp), so a
refused layer leaves the planes and ``out`` as they were; the CPU's host reads the summary after the launch and
names the value.  Same bits as the four kernels: every part runs the ti.func the separate kernel runs (the
scan's ``check``, the store's ``pack`` in the producers' fused store, the producer's work item, the reducer's
merge) on the same split, and tests/test_layer_launch.py holds the C-API path (which launches this kernel) to the
Python path (which launches the four).

The CPU runs every part on the launching thread.  Where a deeper layer's items are dealt to the producer lanes
(layer_launch.ProducerLanes), the caller launches scan and store, then the items on each thread, then the merge:
the lanes must not read a ring's new row before it is stored.  On a GPU the parts are the kernel's tasks, which
the device runs one after the other; the interleaved route's producer reads the token's row from the f32
activations (the bypass) and the store is a task of its own, as in the one-dispatch step (one_dispatch.py).
"""

import taichi as ti

from .common import HEAD_MAJOR, TOKEN_MAJOR, cached, f32_3d, f32_4d, i32_1d, i32_2d
from .halves import HALVES_PER_WORD, packed_plane
from .producer import active_tile_plan, addressing, plan_key, plan_shared, plan_work
from .producer.cpu import cpu_item_work
from .producer.gpu_common import udiv, umod
from .reducer import build_reduce
from .token_scan import build_token_scan, token_accepted

LAYER_SCAN, LAYER_STORE, LAYER_PRODUCE, LAYER_REDUCE = 1, 2, 4, 8
LAYER_ALL = LAYER_SCAN | LAYER_STORE | LAYER_PRODUCE | LAYER_REDUCE
LAYER_ARGS = 23  # the kernel's arguments (layer_launch.py fills them by index)


def build_layer_kernel(head_dim: int, heads_per_kv: int, n_kv: int, n_heads: int, gpu: bool, layout: str,
                       items_cap: int = 0):
    """The one-launch layer of a route: ``layout`` TOKEN_MAJOR (splitk: the ring, the row stored, then read back
    from the plane like every other) or HEAD_MAJOR (interleaved: the growing plane, the row bypassed as f32).
    ``items_cap`` (GPU): the producer's loop bound, the launcher's (producer.producer_kernel says why)."""
    if gpu and items_cap <= 0:
        raise ValueError("the GPU's folded layer needs the launcher's items_cap (its producer's loop bound)")
    D, G, KV, H = head_dim, heads_per_kv, n_kv, n_heads
    W = D // HALVES_PER_WORD
    bypass = layout == HEAD_MAJOR

    def build():
        at = addressing(layout, KV)
        check = build_token_scan(H, KV, D).check
        reduce = build_reduce(D, H, gpu, ti.f32)
        # (every name the kernel reads is bound on both archs: Taichi reads the kernel's closure whole)
        plan = work = cpu_item = merge = None
        T = 1
        if gpu:
            plan = active_tile_plan(D, G)
            work = plan_work(plan, bypass, False, at, fused_store=False)
            T = plan.T
        else:
            # the CPU's interleaved item stores its KV head's row itself (workgroup 0), as the separate producer's
            cpu_item = cpu_item_work(D, G, KV, bypass, False, at)
            merge = reduce.cpu_item

        @ti.kernel
        def layer(
            q: f32_3d, k_cur: f32_3d, v_cur: f32_3d, out: f32_3d, flags: i32_1d, stamp: ti.i32, parts: ti.i32,
            k_plane: packed_plane, v_plane: packed_plane, partials: f32_4d, visits: i32_2d,
            layers: i32_1d, slots: i32_1d,
            position: ti.i32, window: ti.i32, capacity: ti.i32, origin_logical: ti.i32, origin_physical: ti.i32,
            nwg: ti.i32, nsg: ti.i32, scale: ti.f32, first: ti.i32, stride: ti.i32,
        ):
            if ti.static(gpu):
                for r, d in ti.ndrange(H + 2 * KV, D):
                    check(q, k_cur, v_cur, flags, stamp, 0, r, d)
                for kvh, w in ti.ndrange(KV, W):
                    if token_accepted(flags, stamp):
                        row = at.physical_of(position, capacity, origin_logical, origin_physical)
                        at.fused_store(k_cur, v_cur, k_plane, v_plane, layers[0], slots[0], kvh, row, w)
                ti.loop_config(block_dim=T)
                for t in range(items_cap * T):
                    if udiv(t, T) < KV * nwg:  # uniform across a workgroup
                        work(umod(t, T), udiv(t, T), ti.static(plan_shared(plan)), q, k_cur, v_cur, k_plane,
                             v_plane, partials, visits, layers, slots, position, window, capacity, origin_logical,
                             origin_physical, nwg, nsg, scale)
                for t in range(H * D):
                    reduce.gpu_work(t, partials, out, layers, nwg, token_accepted(flags, stamp), 0)
            else:
                # one serial task: every part on the launching thread, in order
                if parts & LAYER_SCAN:
                    for r in range(H + 2 * KV):
                        for d in range(D):
                            check(q, k_cur, v_cur, flags, stamp, 0, r, d)
                if token_accepted(flags, stamp):
                    if ti.static(not bypass):
                        if parts & LAYER_STORE:
                            row = at.physical_of(position, capacity, origin_logical, origin_physical)
                            for kvh in range(KV):
                                for w in range(W):
                                    at.fused_store(k_cur, v_cur, k_plane, v_plane, layers[0], slots[0], kvh, row, w)
                    if parts & LAYER_PRODUCE:
                        for j in range((KV * nwg - first + stride - 1) // stride):
                            cpu_item(first + j * stride, q, k_cur, v_cur, k_plane, v_plane, partials, visits, layers,
                                     slots, position, window, capacity, origin_logical, origin_physical, nwg, nsg,
                                     scale)
                    if parts & LAYER_REDUCE:
                        for h in range(H):
                            merge(h, partials, out, layers, nwg)

        return layer

    return cached(("layer_kernel", D, G, KV, H, gpu, layout, items_cap, plan_key(D, G, gpu)), build)


ROUTE_LAYOUTS = {"splitk": TOKEN_MAJOR, "interleaved": HEAD_MAJOR}  # the project's own routes (ladder.py)


def build_layer_kernels(head_dim: int, heads_per_kv: int, n_kv: int, n_heads: int, gpu: bool, items_cap: int = 0):
    """{"splitk": ..., "interleaved": ...}: the one-launch layer of each of the project's own routes."""
    return {route: build_layer_kernel(head_dim, heads_per_kv, n_kv, n_heads, gpu, layout, items_cap)
            for route, layout in ROUTE_LAYOUTS.items()}


__all__ = ["LAYER_ALL", "LAYER_ARGS", "LAYER_PRODUCE", "LAYER_REDUCE", "LAYER_SCAN", "LAYER_STORE",
           "ROUTE_LAYOUTS", "build_layer_kernel", "build_layer_kernels"]
