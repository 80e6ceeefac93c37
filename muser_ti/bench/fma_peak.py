"""This CPU's f32 fused-multiply-add peak, measured by a kernel of our own: the FLOP floor's denominator.

    python -m muser_ti.bench.fma_peak          # prints {"gflop_s": ..., "threads": ..., ...} as JSON

It runs in a process of its own: it starts Taichi on the CPU with fast_math on, which is what lets LLVM
emit ``vfmadd`` and vectorise a reduction (the engine's CPU runtime keeps fast_math off, backend.py says
why), and a figure is only a floor if nothing else runs beside it.  Each thread sums SCALES products of a
row in L1 with a constant each (``acc[k] += x[i] * c[k]``): LLVM's loop vectorizer makes the SCALES sums
vector accumulators, so a step is one load of x and SCALES fused multiply-adds, bound by FMA issue.
(Register-resident chains ``acc = acc * a + b`` were tried first: LLVM 15 unrolls and spills them,
11-16 GFLOP/s here.)
"""

import json
import os
import statistics
import subprocess
import sys
import time

SCALES = 6  # sums per step: 6 vector accumulators + 6 broadcast constants + a row vector fit 16 registers
ROW = 2048  # floats in the row: 8 KiB, in L1
PASSES = 1 << 16  # passes over the row per call and thread: ~50 ms on the development VM, far above a launch
REPEATS = 7


def measure(threads=None, repeats: int = REPEATS) -> dict:
    """Run the kernel here (this process must not have started Taichi): the best GFLOP/s of ``repeats`` calls
    (a peak: a busy host only ever slows a call, and the VM's host is not always quiet; the median is reported too).
    (No ``from __future__ import annotations`` in this module: Taichi reads the kernel's annotations.)"""
    import numpy as np
    import taichi as ti

    from ..kernels.producer import CPU_TASK_ITERATIONS

    threads = threads or os.cpu_count() or 1
    ti.init(arch=ti.cpu, fast_math=True, cpu_max_num_threads=threads, log_level=ti.WARN)
    K = SCALES

    @ti.kernel
    def sums(x: ti.types.ndarray(dtype=ti.f32, ndim=1), out: ti.types.ndarray(dtype=ti.f32, ndim=1), passes: ti.i32):
        # one item per thread, and one task per item (kernels/producer: CPU_TASK_ITERATIONS says why)
        for t in range(out.shape[0] * CPU_TASK_ITERATIONS):
            if t & (CPU_TASK_ITERATIONS - 1) == 0:
                acc = ti.Vector([0.0] * K)
                for _ in range(passes):
                    for i in range(ROW):
                        for k in ti.static(range(K)):
                            acc[k] += x[i] * (1.0 + k * 1e-3)
                out[t // CPU_TASK_ITERATIONS] = acc.sum()

    x = np.random.default_rng(0).uniform(-1e-3, 1e-3, ROW).astype(np.float32)
    out = np.zeros(threads, np.float32)
    sums(x, out, 1)  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sums(x, out, PASSES)
        times.append(time.perf_counter() - t0)
    if not np.isfinite(out).all():
        raise RuntimeError(f"the sums left their range: {out}")
    flop = 2.0 * K * ROW * PASSES * threads
    best, median = min(times), statistics.median(times)
    return {"gflop_s": flop / best / 1e9, "median_gflop_s": flop / median / 1e9, "threads": threads, "best_s": best,
            "flop": flop, "repeats": repeats}


def probe(timeout: float = 120.0) -> dict:
    """measure() in a fresh process (the caller may have started Taichi with other settings)."""
    from .timing import child_env

    done = subprocess.run([sys.executable, "-m", "muser_ti.bench.fma_peak"], capture_output=True, text=True,
                          timeout=timeout, check=True, env=child_env())
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(measure()))
