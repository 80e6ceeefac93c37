"""Taichi's CPU thread pool against threads of the engine's own (run 47), three measurements:

    python scripts/lab/cpu_pool.py pool          # toy items of ~1.4 ms: Taichi's pool, back to back and with sleeps
                                                 # between launches, against the calling thread + a thread of its own
    python scripts/lab/cpu_pool.py args          # a serial kernel through the C-API, by its count of array arguments
    python scripts/lab/cpu_pool.py ways --depth 2048    # a layer's launches (Glimmer, the C-API path) three ways,
                                                 # alternating token by token: serial, Taichi's pool, lanes

Run it with the other core idle.  Each prints medians in microseconds (ways: the token, and each route's layer).
No ``from __future__ import annotations`` here: Taichi reads the local kernels' annotations as objects.
"""

import argparse
import collections
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import taichi as ti


def _median_us(f, runs: int, sleep: float = 0.0) -> float:
    for _ in range(2):
        f()
    times = []
    for _ in range(runs):
        if sleep:
            time.sleep(sleep)
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _module(kernels: dict) -> tuple:
    """``kernels`` (name -> Taichi kernel) saved as an AOT module; (saved folder)."""
    from muser_ti import aot

    folder = Path(tempfile.mkdtemp())
    aot.save({name: (k, None) for name, k in kernels.items()}, folder)
    return folder


def _address(arr) -> int:
    return int(ti.lang.impl.get_runtime().prog.get_ndarray_data_ptr_as_int(arr.arr))


def pool(reps: int) -> None:
    from muser_ti import capi

    f2 = ti.types.ndarray(dtype=ti.f32, ndim=2)

    @ti.func
    def item(a: ti.template(), i, reps):
        s = 0.0
        for _ in range(reps):
            for j in range(4096):
                s = s * 0.999 + a[i, j]
        a[i, 0] = s

    @ti.kernel
    def par(a: f2, n: ti.i32, reps: ti.i32):
        for t in range(n * 512):  # one item a task of 512 iterations, as the producer does
            if t & 511 == 0:
                item(a, t // 512, reps)

    @ti.kernel
    def ser(a: f2, first: ti.i32, stride: ti.i32, n: ti.i32, reps: ti.i32):
        ti.loop_config(serialize=True)
        for j in range((n - first + stride - 1) // stride):
            item(a, first + j * stride, reps)

    a = ti.ndarray(ti.f32, (64, 4096))
    a.from_numpy(np.random.default_rng(0).random((64, 4096), dtype=np.float32))
    folder = _module({"ser": ser})
    launch = capi.library().ti_launch_kernel
    rts = [capi.Runtime("cpu"), capi.Runtime("cpu")]  # a runtime a thread
    calls = []
    for rt in rts:
        k = rt.kernel(rt.load_module(folder), "ser")
        args = capi.arguments(5)
        capi.set_ndarray(args[0], rt.memory(_address(a), a.shape[0] * a.shape[1] * 4), tuple(a.shape), "f32")
        calls.append((rt.handle, k, args))

    def serial(i, first, stride, n):
        h, k, args = calls[i]
        for slot, v in zip((1, 2, 3, 4), (first, stride, n, reps)):
            capi.set_i32(args[slot], v)
        launch(h, k, 5, args)

    go, done = threading.Lock(), threading.Lock()
    go.acquire()
    done.acquire()
    job = {}

    def worker():
        while True:
            go.acquire()
            serial(1, *job["args"])
            done.release()

    threading.Thread(target=worker, daemon=True).start()

    def two_threads(n):
        job["args"] = (1, 2, n)
        go.release()
        serial(0, 0, 2, n)
        done.acquire()

    for n in (1, 2, 4):
        print(f"{n} items of {reps} passes: pool {_median_us(lambda: par(a, n, reps), 9):.0f} us, pool with 20 ms "
              f"sleeps {_median_us(lambda: par(a, n, reps), 9, 0.02):.0f} us, one thread "
              f"{_median_us(lambda: serial(0, 0, 1, n), 9):.0f} us, this thread + one of its own "
              f"{_median_us(lambda: two_threads(n), 9):.0f} us")


def args_cost() -> None:
    from muser_ti import capi

    f3 = ti.types.ndarray(dtype=ti.f32, ndim=3)

    @ti.kernel
    def k1(a: f3, n: ti.i32):
        ti.loop_config(serialize=True)
        for i in range(n):
            a[0, 0, i] = 1.0

    @ti.kernel
    def k3(a: f3, b: f3, c: f3, n: ti.i32):
        ti.loop_config(serialize=True)
        for i in range(n):
            a[0, 0, i] = b[0, 0, i] + c[0, 0, i]

    @ti.kernel
    def k6(a: f3, b: f3, c: f3, d: f3, e: f3, f: f3, n: ti.i32):
        ti.loop_config(serialize=True)
        for i in range(n):
            a[0, 0, i] = b[0, 0, i] + c[0, 0, i] + d[0, 0, i] + e[0, 0, i] + f[0, 0, i]

    @ti.kernel
    def k9(a: f3, b: f3, c: f3, d: f3, e: f3, f: f3, g: f3, h: f3, j: f3, n: ti.i32):
        ti.loop_config(serialize=True)
        for i in range(n):
            a[0, 0, i] = (b[0, 0, i] + c[0, 0, i] + d[0, 0, i] + e[0, 0, i] + f[0, 0, i] + g[0, 0, i] + h[0, 0, i]
                          + j[0, 0, i])

    folder = _module({"k1": k1, "k3": k3, "k6": k6, "k9": k9})
    rt = capi.Runtime("cpu")
    module = rt.load_module(folder)
    arrays = [ti.ndarray(ti.f32, (1, 4, 16)) for _ in range(9)]
    launch = capi.library().ti_launch_kernel
    for count in (1, 3, 6, 9):
        k = rt.kernel(module, f"k{count}")
        args = capi.arguments(count + 1)
        for i in range(count):
            capi.set_ndarray(args[i], rt.memory(_address(arrays[i]), 256), (1, 4, 16), "f32")
        capi.set_i32(args[count], 1)
        print(f"{count} array arguments: {_median_us(lambda: launch(rt.handle, k, count + 1, args), 3000):.2f} us "
              f"a launch")


def ways(depth: int, tokens: int) -> None:
    """Glimmer's 52 layers by t.attend at ``depth`` keys, alternating token by token: the compiled path's layer (its
    folded kernel, kernels/layer_kernel.py) on the calling thread alone ("serial": one launch) and with its lanes
    ("lanes": the scan and store, the producer's items dealt, the merge), each layer's launches timed; and Taichi's
    Python path, whose producer runs on Taichi's pool ("pool": its token only, its launches being another path's)."""
    import muser_ti as mt
    from muser_ti.config import load_config
    from muser_ti.kernels import split_geometry

    split_geometry.CPU_SERIAL_ROWS = 0  # the ways below choose, not the threshold
    cfg = load_config("glimmer.yaml")
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    rng = np.random.default_rng(1)
    engines = {"compiled": mt.Engine(cfg, arch="cpu", launch="capi"),
               "pool": mt.Engine(cfg, arch="cpu", launch="python")}
    for start in range(0, depth, 1024):
        n = min(1024, depth - start)
        k, v = (rng.standard_normal((n, L, KV, D), dtype=np.float32) for _ in range(2))
        for eng in engines.values():
            eng.prefill(k, v)
    layers = engines["compiled"].launcher.compiled_layers()
    lanes, attend = layers.lanes, layers.attend
    way, warm = ["lanes"], [False]
    producer_us = collections.defaultdict(list)

    def timed(plan, layer, route_sizes, io, stamp):
        layers.lanes = lanes if way[0] == "lanes" else None
        t0 = time.perf_counter()
        launches = attend(plan, layer, route_sizes, io, stamp)
        if warm[0]:
            producer_us[way[0], plan[2][layer]].append((time.perf_counter() - t0) * 1e6)
        return launches

    layers.attend = timed
    token_ms = collections.defaultdict(list)
    order = ["serial", "lanes", "pool"]
    for i in range(tokens + 3):
        q = rng.standard_normal((L, H, D), dtype=np.float32)
        k = rng.standard_normal((L, KV, D), dtype=np.float32)
        v = rng.standard_normal((L, KV, D), dtype=np.float32)
        warm[0] = i >= 3
        for w in (order if i % 2 else order[::-1]):
            way[0] = w
            eng = engines["pool" if w == "pool" else "compiled"]
            t0 = time.perf_counter()
            with eng.token() as t:
                for layer in range(L):
                    t.attend(layer, q[layer], k[layer], v[layer])
            if i >= 3:
                token_ms[w].append((time.perf_counter() - t0) * 1e3)
    for w in order:
        routes = ", ".join(f"{route} {statistics.median(producer_us[w, route]):.0f} us"
                           for route in ("splitk", "interleaved") if producer_us[w, route])
        print(f"{depth} keys, {w}: token {statistics.median(token_ms[w]):.1f} ms" + (f"; a layer's launches {routes}"
                                                                                     if routes else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("pool", "args", "ways"))
    ap.add_argument("--reps", type=int, default=200, help="pool: passes over a row (200: ~1.4 ms an item)")
    ap.add_argument("--depth", type=int, default=2048, help="ways: keys in the cache")
    ap.add_argument("--tokens", type=int, default=12, help="ways: timed tokens a way")
    args = ap.parse_args()
    ti.init(arch=ti.cpu, offline_cache=False, log_level=ti.WARN) if args.what != "ways" else None
    {"pool": lambda: pool(args.reps), "args": args_cost, "ways": lambda: ways(args.depth, args.tokens)}[args.what]()


if __name__ == "__main__":
    main()
