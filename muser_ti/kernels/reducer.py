"""The reducer: merge per-workgroup [M, S, O] partials into the attention output (§16.2's merge).

    gmax = max_i M_i;   S = sum_i S_i * exp(M_i - gmax);   out = (sum_i O_i * exp(M_i - gmax)) / S

The divide happens once, at the end: the producers normalised nothing along the way.  exp is the
precise one (Taichi runs with fast_math off), as reduce_v2's precise::exp demands.
"""


import taichi as ti

from .common import GROUP_NWG, MAX_WORKGROUPS, cached, f32_4d, i32_1d, i32_2d

GPU_PARTIALS_IN_FLIGHT = 32  # U: partials a GPU reducer thread loads before it uses them.  A layer's reducer is
#                              H x D threads (4,096 for Glimmer: a warp an SM), so only a thread's own loads can
#                              hide their latency; past the last whole batch one more batch re-reads the last
#                              partial with weight 0.  Known deficit: a thread's serial stream (~35 % address
#                              math, ~40 % weights each of a head's D threads recomputes; docs/PERF.md)
GPU_MAXES_IN_FLIGHT = 64  # UM: the maxes a thread loads at once in the first pass (one value a partial)


def build_reduce(head_dim: int, n_heads: int, gpu: bool, out_dtype, layers_cap: int = 0, serial: bool = False,
                 per_group: bool = False):
    """The reducer kernel; layers_cap (GPU): the most layers a launch merges, which makes its loop's bound a
    constant (threads past the launch's layers do nothing), as the producers' (split_geometry.gpu_items_cap says
    why); 0: the bound is computed from n_group.  per_group: each group merges its own split's partials (a batch's
    sequences: ``state[g, GROUP_NWG]``, producer.group_producer_kernel) in place of one ``nwg``."""
    D, H = head_dim, n_heads
    W = MAX_WORKGROUPS
    U, UM = GPU_PARTIALS_IN_FLIGHT, GPU_MAXES_IN_FLIGHT

    def build():
        out_t = ti.types.ndarray(dtype=out_dtype, ndim=3)

        @ti.func
        def global_max(partials: ti.template(), g, h, nwg):
            gmax = partials[g, h, 0, 0]
            for i in range(1, nwg):
                gmax = ti.max(gmax, partials[g, h, i, 0])
            return gmax

        @ti.func
        def in_split(i, nwg):
            """Partial i of a batch, or the split's last where a batch runs past it (weight 0 in the sums)."""
            return ti.min(i, nwg - 1)

        @ti.func
        def global_max_batched(partials: ti.template(), g, h, nwg):
            """global_max, UM loads at a time; the last batch's reads past nwg re-read partial nwg - 1 (a
            max of finite values: any order and any repeat give the same bits)."""
            gmax = partials[g, h, 0, 0]
            for j in range((nwg + UM - 1) // UM):
                ms = ti.Vector([partials[g, h, in_split(j * UM + u, nwg), 0] for u in ti.static(range(UM))])
                for u in ti.static(range(UM)):
                    gmax = ti.max(gmax, ms[u])
            return gmax

        @ti.func
        def gpu_work(t, partials: ti.template(), out: ti.template(), layers: ti.template(), nwg, write,
                     layer_base: ti.template()):
            """Thread t of the GPU launch: out[layers[layer_base + g], h, d] for (g, h) = divmod(t // D, H),
            d = t % D.
            Each thread takes the max and the factors exp(M_i - gmax) of its head itself (nwg loads of M, S
            and O[d] each, the first two broadcast across the warp), U partials loaded ahead of their sums,
            which run in the CPU reducer's order (the last batch's reads past nwg weigh 0); no shared
            memory, so the one-dispatch step can run it beside the producers' task (block_tile.shared_arrays
            says why that matters).  ``write`` = 0
            leaves ``out`` as it was (a token the scan refused)."""
            item, d = t // D, t % D
            g, h = item // H, item % H
            gmax = global_max_batched(partials, g, h, nwg)
            total, acc = 0.0, 0.0
            for j in range((nwg + U - 1) // U):
                i0 = j * U
                ms = ti.Vector([partials[g, h, in_split(i0 + u, nwg), 0] for u in ti.static(range(U))])
                ss = ti.Vector([partials[g, h, in_split(i0 + u, nwg), 1] for u in ti.static(range(U))])
                os = ti.Vector([partials[g, h, in_split(i0 + u, nwg), 2 + d] for u in ti.static(range(U))])
                for u in ti.static(range(U)):
                    f = ti.exp(ms[u] - gmax)
                    if i0 + u >= nwg:  # a re-read past the split: weight 0 adds +0.0, so the sums keep their bits
                        f = 0.0
                    total += ss[u] * f
                    acc += os[u] * f
            inv = 1.0 / total if total > 0.0 else 0.0
            if write:
                out[layers[layer_base + g], h, d] = ti.cast(acc * inv, out_dtype)

        @ti.func
        def cpu_item(item, partials: ti.template(), out: ti.template(), layers: ti.template(), nwg):
            """One (layer, head) on the CPU; factors computed once."""
            g, h = item // H, item % H
            gmax = global_max(partials, g, h, nwg)
            factors = ti.Vector([0.0] * W)
            total = 0.0
            for i in range(nwg):
                f = ti.exp(partials[g, h, i, 0] - gmax)
                factors[i] = f
                total += partials[g, h, i, 1] * f
            inv = 1.0 / total if total > 0.0 else 0.0
            for d in range(D):
                acc = 0.0
                for i in range(nwg):
                    acc += partials[g, h, i, 2 + d] * factors[i]
                out[layers[g], h, d] = ti.cast(acc * inv, out_dtype)

        @ti.kernel
        def reduce_groups(partials: f32_4d, out: out_t, layers: i32_1d, n_group: ti.i32, state: i32_2d):
            if ti.static(not gpu):
                ti.loop_config(serialize=serial)
                for item in range(n_group * H):
                    cpu_item(item, partials, out, layers, state[item // H, GROUP_NWG])
            else:
                for t in range(n_group * H * D):
                    gpu_work(t, partials, out, layers, state[t // (H * D), GROUP_NWG], 1, 0)

        @ti.kernel
        def reduce(partials: f32_4d, out: out_t, layers: i32_1d, n_group: ti.i32, nwg: ti.i32):
            if ti.static(not gpu):
                # serial: one layer's merge (a per-layer token, token.py) is too small to pay for waking the
                # CPU's worker threads; each output is computed alike either way
                ti.loop_config(serialize=serial)
                for item in range(n_group * H):
                    cpu_item(item, partials, out, layers, nwg)
            elif ti.static(layers_cap > 0):
                for t in range(layers_cap * H * D):
                    if t < n_group * H * D:
                        gpu_work(t, partials, out, layers, nwg, 1, 0)
            else:
                for t in range(n_group * H * D):
                    gpu_work(t, partials, out, layers, nwg, 1, 0)

        if per_group:
            return reduce_groups
        reduce.gpu_work, reduce.cpu_item = gpu_work, cpu_item  # for the kernels that fold a merge in (layer_kernel.py)
        return reduce

    return cached(("reduce", D, H, gpu, str(out_dtype), layers_cap, serial, per_group), build)
