"""The whole decode step as one Taichi dispatch on a GPU: the token scan, the stores, the producers and
the reducers as four tasks (loops) of one kernel.

Why one dispatch.  Every Taichi kernel launch costs the host more than the device work of a short
step: Taichi sets each argument through its launch context, allocates and copies an argument buffer
and looks the task up by name, tens of microseconds for a producer (docs/PERF.md).  The graph route
launched the scan, read its flags, then
replayed five dispatches (store, two producers, two reducers).  Here the arguments are set once and the
tasks go out back to back; the device starts on the scan while the host still issues the later tasks.

Only one task may declare shared memory: Taichi 1.7.4 names a CUDA shared array after its statement
id, the ids restart in every task, and the tasks are linked into one module, so two tasks' arrays
alias (block_tile.shared_arrays).  Both producers therefore share one task and one set of arrays,
and the reducer uses none.

Why it stays exact.  The tasks run the same ti.funcs the separate kernels run (warp_tile / block_tile work,
reducer's gpu_work, the scan's check), so every output bit is the graph route's, as long as the compiler
makes the same arithmetic of the same source in both modules.  On CUDA they have matched in every run; a
SPIR-V driver may fuse a multiply and an add into an FMA module by module, and NVIDIA's did, until the scores
took the scale from the queries (gpu_common.query_stager says how it was found).
test_one_dispatch_step_gives_the_graph_routes_bits catches a driver that does.  Two things move:

* the stores: both classes' current rows are written by one task of their own, before the producers,
  instead of by store_token (SWA) and the interleaved producer's workgroup 0 (NoPE).  The interleaved
  producer still takes the current row from the f32 activations (the bypass), and splitk reads it back
  from the f16 plane as before;
* the gate: the scan runs first and every write the step makes (the plane rows and ``out``) asks its
  flags since a base stamp (token_scan.token_accepted), so a refused token leaves the planes and ``out`` as
  they were.  The host reads the flags after the step (Engine.step_device), or, with deferred checks,
  at its next synchronisation: one refused token then closes the gate for every token after it until
  the host has looked.  Engine.step checks its numpy token on the host first and opens the gate
  (token_scan.OPEN_GATE): its writes never wait on the scan.

Where it applies: CUDA and Vulkan, a geometry with both layer classes, each on its default route
(interleaved, splitk), and a step that grows no plane (the grow copy is not gated).  Every other step
takes the graph route (Engine._commit_step).  Metal keeps the graph route: this kernel binds 11 arrays
and could not be compiled or run for Metal on these machines.
"""

import taichi as ti

from .common import HEAD_MAJOR, TOKEN_MAJOR, cached, f32_3d, f32_4d, i32_1d
from .halves import HALVES_PER_WORD, packed_plane
from .reducer import build_reduce
from .producer import addressing, gpu_work, plan_key, plan_shared
from .producer.gpu_common import udiv, umod
from .split_geometry import gpu_split_func, gpu_workgroups_per_pair
from .token_scan import FLAG_CELLS, build_token_scan, token_accepted

ONE_DISPATCH_ARCHS = ("cuda", "vulkan")


def build_step_kernel(head_dim: int, heads_per_kv: int, n_kv: int, n_heads: int, n_nope: int, n_swa: int,
                      scale: float, window_nope: int, window_swa: int, target: int):
    """The one-dispatch step for a geometry with n_nope NoPE and n_swa SWA layers (compiled on its first
    launch, like every Taichi kernel); ``target``: the split's workgroup target (splitk.py).

    What is fixed for an engine is a compile-time constant, because every argument costs the host in
    Taichi's launch (microseconds each: scripts/lab/arg_cost.py), and a non-constant loop bound costs a
    one-thread task launched ahead of its loop: the layer counts (constant bounds for the scan, store and reducer tasks), the scale,
    both windows and the split's target, and with them the producers' bound (their most work items).
    What follows from those and the position is computed in the kernel, by the threads that use it:
    both classes' split geometry (split_geometry.gpu_split_func, what Engine.split_geometry gives) and the planes'
    capacities (their row dimension).  Both classes' layers are one table, NoPE then SWA, kept in
    ``flags`` after the scan's FLAG_CELLS cells (one array fewer);
    a class's plane slot is its group index (the groups are the whole classes, in order), so no slot
    tables are bound; this token's plane rows are computed from the plane states' origins, the only
    per-token numbers besides the position, the stamp and the gate's base."""
    D, KV, H, L = head_dim, n_kv, n_heads, n_nope + n_swa
    LT = FLAG_CELLS  # where the layer table starts in flags

    def build():
        nope_work, plan = gpu_work(D, heads_per_kv, KV, HEAD_MAJOR, bypass=True, layer_base=LT)
        swa_work, swa_plan = gpu_work(D, heads_per_kv, KV, TOKEN_MAJOR, bypass=False, layer_base=LT + n_nope)
        assert swa_plan == plan  # the tile depends on the group shape only: one set of shared arrays serves both
        check = build_token_scan(H, KV, D).check
        reduce_work = build_reduce(D, H, True, ti.f32).gpu_work
        at_nope, at_swa = addressing(HEAD_MAJOR, KV), addressing(TOKEN_MAJOR, KV)
        split_nope = gpu_split_func(n_nope * KV, target, window_nope)
        split_swa = gpu_split_func(n_swa * KV, target, window_swa)
        T = plan.T
        # each class's most work items: the producers' loop bound is a constant (split_geometry.gpu_items_cap says
        # why), NoPE items in [0, NOPE_ITEMS), SWA items after; a class's items past its split do nothing
        NOPE_ITEMS = n_nope * KV * gpu_workgroups_per_pair(n_nope * KV, target)
        SWA_ITEMS = n_swa * KV * gpu_workgroups_per_pair(n_swa * KV, target)

        @ti.kernel
        def step(
            q: f32_3d, k_cur: f32_3d, v_cur: f32_3d, out: f32_3d,
            flags: i32_1d,  # the scan's FLAG_CELLS cells, then the model layer of each NoPE, then each SWA layer
            stamp: ti.i32, base: ti.i32, position: ti.i32,
            # NoPE (interleaved): planes [slot, kv head, row, word], partials, the plane's origins
            k_nope: packed_plane, v_nope: packed_plane, part_nope: f32_4d, ol_nope: ti.i32, op_nope: ti.i32,
            # SWA (splitk): the same for the ring, [slot, row, kv head, word]
            k_swa: packed_plane, v_swa: packed_plane, part_swa: f32_4d, ol_swa: ti.i32, op_swa: ti.i32,
        ):
            # 1. the scan: flags[i] = stamp for a bad value (build_token_scan)
            for layer, r, d in ti.ndrange(L, H + 2 * KV, D):
                check(q, k_cur, v_cur, flags, stamp, layer, r, d)
            # 2. this token's rows in both classes' planes, if the scan passed it: a thread per packed word
            for g, kvh, w in ti.ndrange(L, KV, D // HALVES_PER_WORD):
                if token_accepted(flags, base):
                    if g < n_nope:
                        row = at_nope.physical_of(position, k_nope.shape[2], ol_nope, op_nope)
                        at_nope.fused_store(k_cur, v_cur, k_nope, v_nope, flags[LT + g], g, kvh, row, w)
                    else:
                        row = at_swa.physical_of(position, k_swa.shape[1], ol_swa, op_swa)
                        at_swa.fused_store(k_cur, v_cur, k_swa, v_swa, flags[LT + g], g - n_nope, kvh, row, w)
            # 3. both producers in one task, NoPE work items first (uniform per workgroup), in one set of
            # shared arrays: [M, S, O] per (layer, head, workgroup); they write only the partials (flags
            # stands in for the visit counts, which only record mode writes, and for the unused slot table)
            ti.loop_config(block_dim=T)
            for t in range((NOPE_ITEMS + SWA_ITEMS) * T):
                tid, item = umod(t, T), udiv(t, T)
                shared = ti.static(plan_shared(plan))  # declared here, in the loop body, once for both
                if item < NOPE_ITEMS:
                    nwg_nope, nsg_nope = split_nope(position)
                    if item < n_nope * KV * nwg_nope:
                        nope_work(tid, item, shared, q, k_cur, v_cur, k_nope, v_nope, part_nope, flags, flags,
                                  flags, position, window_nope, k_nope.shape[2], ol_nope, op_nope, nwg_nope,
                                  nsg_nope, scale)
                else:
                    nwg_swa, nsg_swa = split_swa(position)
                    if item - NOPE_ITEMS < n_swa * KV * nwg_swa:
                        swa_work(tid, item - NOPE_ITEMS, shared, q, k_cur, v_cur, k_swa, v_swa, part_swa, flags,
                                 flags, flags, position, window_swa, k_swa.shape[1], ol_swa, op_swa, nwg_swa,
                                 nsg_swa, scale)
            # 4. both reducers in one task, a thread per (layer, head, dim), NoPE layers first: out, if the scan
            # passed the token.  (Two reducer tasks in one kernel failed Taichi 1.7.4's SPIR-V codegen with
            # "Value tmpN does not yet exist" while the reducer had shared arrays.)
            for t in range(L * H * D):
                if t < n_nope * H * D:
                    reduce_work(t, part_nope, out, flags, split_nope(position)[0], token_accepted(flags, base), LT)
                else:
                    reduce_work(t - n_nope * H * D, part_swa, out, flags, split_swa(position)[0],
                                token_accepted(flags, base), LT + n_nope)

        return step

    return cached(("one_dispatch_step", D, heads_per_kv, KV, H, n_nope, n_swa, scale, window_nope, window_swa, target,
                   plan_key(D, heads_per_kv, True)), build)


__all__ = ["ONE_DISPATCH_ARCHS", "build_step_kernel"]
