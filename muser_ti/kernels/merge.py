"""The reducer: merge per-workgroup [M, S, O] partials into the attention output (§16.2's merge).

    gmax = max_i M_i;   S = sum_i S_i * exp(M_i - gmax);   out = (sum_i O_i * exp(M_i - gmax)) / S

The divide happens once, at the end: the producers normalised nothing along the way.  exp is the
precise one (Taichi runs with fast_math off), as reduce_v2's precise::exp demands.
"""


import taichi as ti

from .common import MAX_WORKGROUPS, RUNNING_MAX_INIT, WORKGROUP_THREADS, cached, f32_4d, i32_1d

MAX_GPU_WG = 1024  # >= kernels.splitk.GPU_MAX_WORKGROUPS: one factor per partial in shared memory


def build_reduce(head_dim: int, n_heads: int, gpu: bool, out_dtype):
    D, H = head_dim, n_heads
    W = MAX_WORKGROUPS
    T = WORKGROUP_THREADS

    def build():
        out_t = ti.types.ndarray(dtype=out_dtype, ndim=3)

        @ti.func
        def tree(red: ti.template(), tid, is_max: ti.template()):
            """Reduce red[0:T] into red[0] (max or sum), halving the active threads each step; every
            thread reads the result."""
            ti.simt.block.sync()
            width = T // 2
            while width > 0:
                if tid < width:
                    if ti.static(is_max):
                        red[tid] = ti.max(red[tid], red[tid + width])
                    else:
                        red[tid] = red[tid] + red[tid + width]
                ti.simt.block.sync()
                width //= 2
            return red[0]

        @ti.func
        def global_max(partials: ti.template(), g, h, nwg):
            gmax = partials[g, h, 0, 0]
            for i in range(1, nwg):
                gmax = ti.max(gmax, partials[g, h, i, 0])
            return gmax

        @ti.func
        def gpu_work(t, partials: ti.template(), out: ti.template(), layers: ti.template(), nwg, write):
            """Thread t of the GPU launch: one workgroup per (layer, head).  The factors exp(M_i - gmax) are
            computed once, in parallel, into shared memory; then threads over d sum the weighted partials
            (coalesced loads).  ``write`` = 0 leaves ``out`` as it was (a token the scan refused)."""
            tid = t % T
            g, h = (t // T) // H, (t // T) % H
            f_sh = ti.simt.block.SharedArray((MAX_GPU_WG,), ti.f32)
            red = ti.simt.block.SharedArray((T,), ti.f32)
            local = RUNNING_MAX_INIT
            i = tid
            while i < nwg:
                local = ti.max(local, partials[g, h, i, 0])
                i += T
            red[tid] = local
            gmax = tree(red, tid, True)
            ti.simt.block.sync()  # everyone has read red[0] before it is rewritten
            local_sum = 0.0
            i = tid
            while i < nwg:
                f = ti.exp(partials[g, h, i, 0] - gmax)
                f_sh[i] = f
                local_sum += partials[g, h, i, 1] * f
                i += T
            red[tid] = local_sum
            total = tree(red, tid, False)
            inv = 1.0 / total if total > 0.0 else 0.0
            d = tid
            while d < D:
                acc = 0.0
                for i2 in range(nwg):
                    acc += partials[g, h, i2, 2 + d] * f_sh[i2]
                if write:
                    out[layers[g], h, d] = ti.cast(acc * inv, out_dtype)
                d += T

        @ti.kernel
        def reduce(partials: f32_4d, out: out_t, layers: i32_1d, n_group: ti.i32, nwg: ti.i32):
            if ti.static(not gpu):
                for item in range(n_group * H):  # one (layer, head) per item; factors computed once
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
            else:
                ti.loop_config(block_dim=T)
                for t in range(n_group * H * T):
                    gpu_work(t, partials, out, layers, nwg, 1)

        reduce.gpu_work = gpu_work
        return reduce

    return cached(("reduce", D, H, gpu, str(out_dtype)), build)
