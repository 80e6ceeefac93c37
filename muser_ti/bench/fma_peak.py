"""This CPU's f32 peak, measured two ways: what a Taichi kernel reaches, and what the CPU does (C, full width).

    python -m muser_ti.bench.fma_peak          # the Taichi kernel: prints {"gflop_s": ..., "threads": ...} as JSON

The Taichi kernel runs in a process of its own: it starts Taichi on the CPU with fast_math on, which lets LLVM's
loop vectorizer reorder the sums (the engine's CPU runtime keeps fast_math off, backend.py says why), and a figure
is only a peak if nothing else runs beside it.  Each thread sums SCALES products of a row in L1 with a constant
each (``acc[k] += x[i] * c[k]``): the vectorizer makes the SCALES sums vector accumulators, so a step is one load
of x and SCALES multiply-adds.  The code that runs has no FMA: Taichi 1.7.4's JIT compiles with default
TargetOptions and fuses nothing, so each is a ``vmulps`` and a ``vaddps`` (on ymm on an Ice Lake Xeon; its
printed listing shows ``vfmadd``, which never runs: docs/lab/taichi-cpu-target.md).
(Register-resident chains ``acc = acc * a + b`` were tried first: LLVM 15 unrolls and spills them,
11-16 GFLOP/s here.)

That is the peak **Taichi reaches** on this CPU, not the CPU's: Taichi 1.7.4's LLVM plans the loop for the vector
width its optimiser's target machine allows and fuses no multiply-add (docs/PERF.md, "The Taichi CPU-name limit").  The CPU's own peak is
measured by ``c_peak``: a small C kernel built at bench time with the system's C compiler (``-O2 -mavx2 -mfma``
for 256-bit vectors, ``-O2 -mavx512f`` for 512-bit), twelve independent FMA chains in registers per thread, one
thread per core (pthreads), the best of its repeats.  The FLOP floor is quoted at both:

    python -m muser_ti.bench.fma_peak --all    # {"taichi": ..., "c256": ..., "c512": ...} (c512 where AVX-512 is)
"""

import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

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


# ---- the CPU's own peak: C, the full vector width -----------------------------------------------------------
C_CHAINS = 12  # independent FMA chains a thread: covers 4-cycle latency x 2 FMA pipes with room (Zen, Intel)
C_SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#if WIDTH == 512
typedef __m512 V;
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define LANES 16
static float hsum(V v) { return _mm512_reduce_add_ps(v); }
#else
typedef __m256 V;
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define LANES 8
static float hsum(V v) { float f[8]; _mm256_storeu_ps(f, v); float s = 0; for (int i = 0; i < 8; i++) s += f[i]; return s; }
#endif
static long iters;
static float sink[256];
static void *run(void *arg) {
    long id = (long)arg;
    V a = SET1(0.999999f), b = SET1(1e-6f);
    V c0 = SET1(id), c1 = SET1(1), c2 = SET1(2), c3 = SET1(3), c4 = SET1(4), c5 = SET1(5);
    V c6 = SET1(6), c7 = SET1(7), c8 = SET1(8), c9 = SET1(9), c10 = SET1(10), c11 = SET1(11);
    for (long i = 0; i < iters; i++) {
        c0 = FMA(c0, a, b); c1 = FMA(c1, a, b); c2 = FMA(c2, a, b); c3 = FMA(c3, a, b);
        c4 = FMA(c4, a, b); c5 = FMA(c5, a, b); c6 = FMA(c6, a, b); c7 = FMA(c7, a, b);
        c8 = FMA(c8, a, b); c9 = FMA(c9, a, b); c10 = FMA(c10, a, b); c11 = FMA(c11, a, b);
        __asm__ volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5));
        __asm__ volatile("" : "+v"(c6), "+v"(c7), "+v"(c8), "+v"(c9), "+v"(c10), "+v"(c11));
    }
    sink[id % 256] = hsum(c0) + hsum(c1) + hsum(c2) + hsum(c3) + hsum(c4) + hsum(c5) + hsum(c6) + hsum(c7)
                   + hsum(c8) + hsum(c9) + hsum(c10) + hsum(c11);
    return 0;
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    int threads = atoi(argv[1]), repeats = atoi(argv[3]);
    iters = atol(argv[2]);
    pthread_t th[256];
    double best = 1e30, total = 0;
    for (int r = 0; r < repeats; r++) {
        double t0 = now();
        for (long t = 0; t < threads; t++) pthread_create(&th[t], 0, run, (void *)t);
        for (int t = 0; t < threads; t++) pthread_join(th[t], 0);
        double dt = now() - t0;
        if (dt < best) best = dt;
        total += dt;
    }
    double flop = 2.0 * 12 * LANES * (double)iters * threads;
    printf("{\"width\": %d, \"threads\": %d, \"gflop_s\": %.2f, \"mean_gflop_s\": %.2f, \"best_s\": %.5f, "
           "\"check\": %g}\n", WIDTH, threads, flop / best / 1e9, flop * repeats / total / 1e9, best, sink[0]);
    return 0;
}
"""
C_FLAGS = {256: ["-O2", "-mavx2", "-mfma"], 512: ["-O2", "-mavx512f"]}
C_ITERS = 40_000_000  # per thread and call: ~0.1-0.3 s a call at 2-5 GHz


def c_widths() -> list[int]:
    """The vector widths this CPU runs (from its cpuid flags): 256 with AVX2+FMA, 512 with AVX-512F too."""
    from .native_ggml import cpu_flags

    flags = cpu_flags()
    return [w for w, need in ((256, {"avx2", "fma"}), (512, {"avx512f"})) if need <= flags]


def c_binary(width: int) -> Path:
    """The C kernel for ``width``-bit vectors, built once into ~/.cache/muser-ti/fma-peak/ (the source's hash and
    the flags name it)."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise RuntimeError("the C FMA peak needs a C compiler (gcc or cc on PATH)")
    flags = C_FLAGS[width]
    tag = hashlib.sha256((C_SOURCE + cc + " ".join(flags)).encode()).hexdigest()[:10]
    root = cache_root()
    exe = root / f"fma{width}-{tag}"
    if not exe.is_file():
        root.mkdir(parents=True, exist_ok=True)
        src = root / f"fma-{tag}.c"
        src.write_text(C_SOURCE)
        tmp = exe.with_suffix(f".tmp{os.getpid()}")
        subprocess.run([cc, *flags, f"-DWIDTH={width}", "-o", str(tmp), str(src), "-lpthread"], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, exe)
    return exe


def c_peak(width: int, threads=None, repeats: int = REPEATS, iters: int = C_ITERS) -> dict:
    """The CPU's f32 FMA peak with ``width``-bit vectors on ``threads`` threads (default: every core): the best
    GFLOP/s of ``repeats`` calls of the C kernel (a process of its own)."""
    threads = threads or os.cpu_count() or 1
    out = subprocess.run([str(c_binary(width)), str(threads), str(iters), str(repeats)], capture_output=True,
                         text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def peaks(repeats: int = REPEATS) -> dict:
    """Every peak this machine has, in GFLOP/s: 'taichi' (the Taichi kernel above, fresh process), 'c256' and,
    where there is AVX-512, 'c512'; each a best of ``repeats`` calls."""
    out = {"taichi": probe()["gflop_s"]}
    for w in c_widths():
        out[f"c{w}"] = c_peak(w, repeats=repeats)["gflop_s"]
    return out


FLOOR_RUNS = 3  # processes of the C kernel a kept peak is the best of (each the best of REPEATS calls)


def cache_root() -> Path:
    """~/.cache/muser-ti/fma-peak/ (MUSER_FMA_PEAK_CACHE elsewhere): the C kernels and the kept peaks."""
    return Path(os.environ.get("MUSER_FMA_PEAK_CACHE") or Path.home() / ".cache" / "muser-ti" / "fma-peak")


def machine() -> str:
    """What a kept peak belongs to: this CPU's model and its core count."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def _shown(path: Path) -> str:
    try:
        return "~/" + path.relative_to(Path.home()).as_posix()
    except ValueError:
        return str(path)


def kept_peak(measure_c, runs: int = FLOOR_RUNS) -> tuple[float, str]:
    """The C peak this machine keeps in ``floor-peaks.json`` (keyed by machine()), measured as the best of ``runs``
    processes of ``measure_c()`` where it has none.  One run's best moves with what else the host runs (151 to
    201 GFLOP/s between runs on the 2-core VM), and a floor quoted at a moving peak moves with it; the best of
    several is the nearest to the CPU's, and kept, every run quotes the same one."""
    path = cache_root() / "floor-peaks.json"
    try:
        kept = json.loads(path.read_text())
        kept = kept if isinstance(kept, dict) else {}
    except (OSError, ValueError):
        kept = {}
    entry = kept.get(machine())
    if not (isinstance(entry, dict) and isinstance(entry.get("gflop_s"), (int, float)) and entry.get("by")):
        results = [measure_c() for _ in range(runs)]
        best = max(results, key=lambda r: r["gflop_s"])
        entry = {"gflop_s": best["gflop_s"], "by": f"C, {best['width']}-bit FMA, the best of {runs} runs",
                 "runs": [r["gflop_s"] for r in results], "measured": time.strftime("%Y-%m-%d")}
        kept[machine()] = entry
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(kept, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home: measured again next time
    return float(entry["gflop_s"]), f"{entry['by']}, kept in {_shown(path)}"  # the file has the date and runs


def floor_peak(repeats: int = REPEATS) -> tuple[float, str]:
    """(GFLOP/s, what measured it): the peak a FLOP floor is quoted at.  The CPU's own, the C kernel at its widest
    vectors, where this machine has a C compiler: measured once per machine and kept (kept_peak); else the Taichi
    kernel's, named so (a lower peak: a higher floor than the CPU's), measured every time."""
    widths = c_widths()
    if widths:
        try:
            return kept_peak(lambda: c_peak(max(widths), repeats=repeats))
        except (RuntimeError, OSError, subprocess.SubprocessError):
            pass  # no compiler, or it failed: the Taichi kernel's peak, said so
    return probe()["gflop_s"], "Taichi's kernel: no C FMA kernel built here"


if __name__ == "__main__":
    if "--all" in sys.argv[1:]:
        print(json.dumps(peaks()))
    elif "--c" in sys.argv[1:]:
        print(json.dumps({f"c{w}": c_peak(w) for w in c_widths()}))
    else:
        print(json.dumps(measure()))
