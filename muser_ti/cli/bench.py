"""Benchmarks: the project's own routes against peers measured in the same run.

    muser-bench --arch cpu                      # layers at 2,048/32,768/131,072, steps at 2,048/32,768
    muser-bench --arch cpu --json out/bench.json   # (or: python scripts/bench.py ...)

One layer per route: a one-layer geometry with Glimmer's heads (splitk: an SWA layer whose window is
the depth; interleaved: a NoPE layer), prefilled to depth-1, then timed as step + rewind(1) so every
repeat attends exactly `depth` rows.  Whole step: Glimmer's 52 layers at the given depth.
Peers, same run, same data shapes: ggml's ggml_flash_attn_ext (ggml-python 0.0.45, the pinned
library) over f16 planes of the same layout; the float64 numpy reference; torch SDPA if torch is
installed.  Every figure is a median of --repeats runs; GB/s counts the KV bytes the layer must read.
On a GPU (--arch cuda/vulkan/metal) a step is timed twice: with numpy in and out (Engine.step), and
with q/k/v/out already on the device (Engine.step_device, to the device's completion).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import muser_ti as mt
from muser_ti import reference
from muser_ti.measure import (GRAPH_REPLAYS, copy_bandwidth_gb_s, cupti_busy, graph_repeat_us, machine, median_time,
                              recorded_dispatches)

ROUTE_KIND = {"splitk": "swa", "interleaved": "nope"}
COPY_GB_S = 0.0  # measured device copy bandwidth (GPU runs); the byte floor of every figure


def cpu_flop_floor_s(flop: float) -> float:
    """Arithmetic floor on this CPU: cores x clock x 32 FLOP/cycle (two 8-wide f32 FMA ports, AVX2)."""
    mhz = 2450.0
    try:
        mhz = max(float(l.split(":")[1]) for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("cpu MHz"))
    except (OSError, ValueError):
        pass
    return flop / ((os.cpu_count() or 1) * mhz * 1e6 * 32)


def prefill(eng: mt.Engine, n: int, rng, chunk: int = 4096) -> None:
    c = eng.cfg
    done = 0
    while done < n:
        m = min(chunk, n - done)
        shape = (m, c.n_layers, c.n_kv_heads, c.head_dim)
        eng.prefill(rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32))
        done += m


def random_token(c: mt.Geometry, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One decode token's q, k, v (float32, standard normal)."""
    return tuple(rng.standard_normal(shape, dtype=np.float32) for shape in
                 ((c.n_layers, c.n_heads, c.head_dim), (c.n_layers, c.n_kv_heads, c.head_dim),
                  (c.n_layers, c.n_kv_heads, c.head_dim)))


def rewound_median(eng: mt.Engine, call, repeats: int, warmup: int, settle=None) -> float:
    """Median seconds of ``call`` (one step) at the engine's depth; rewinds between repeats and ``settle``
    run untimed, and the last step is left in place, so the planes then hold what the timed steps attended."""
    p = eng.position
    times = []
    for _ in range(warmup + repeats):
        if eng.position > p:
            eng.rewind(p)
        if settle is not None:
            settle()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def timed_step(eng: mt.Engine, rng, repeats: int, warmup: int = 2) -> tuple[float, np.ndarray]:
    """Median seconds of eng.step at the engine's depth (rewound_median), and the q it attended."""
    q, k, v = random_token(eng.cfg, rng)
    return rewound_median(eng, lambda: eng.step(q, k, v), repeats, warmup), q


def timed_device_step(eng: mt.Engine, rng, repeats: int, warmup: int = 2) -> float:
    """Median seconds of eng.step_device with q, k, v and out already on the device, to the device's
    completion (ti.sync inside the timing, and before it untimed)."""
    import taichi as ti

    dev = device_token(*random_token(eng.cfg, rng))
    out = ti.ndarray(ti.f32, dev[0].shape)
    return rewound_median(eng, lambda: (eng.step_device(*dev, out), ti.sync()), repeats, warmup, settle=ti.sync)


def device_token(*host: np.ndarray) -> list:
    """Float32 ndarrays holding the given host arrays (a token as step_device takes it)."""
    import taichi as ti

    dev = []
    for a in host:
        dev.append(ti.ndarray(ti.f32, a.shape))
        dev[-1].from_numpy(a)
    return dev


class Peers:
    """The peers, each over planes holding the same rows as the engine's."""

    def __init__(self, cfg: mt.Geometry, repeats: int):
        self.cfg = cfg
        self.repeats = repeats
        try:
            from muser_ti.pinned.ggml import GgmlFlashAttn

            self.ggml = GgmlFlashAttn(cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.attention_scale, os.cpu_count())
        except Exception as exc:  # reported, not fatal: the bench still runs the project's routes
            print(f"ggml peer unavailable: {exc}", file=sys.stderr)
            self.ggml = None
        try:
            import torch

            self.torch = torch
        except ImportError:
            self.torch = None

    def ggml_layer(self, q, k, v, layout: str) -> float:
        """k, v: f16 planes of one layer (token-major [N, kv, d] or head-major [kv, N, d])."""
        c = self.cfg
        if layout == reference.TOKEN_MAJOR:
            rs, hs, n = c.n_kv_heads * c.head_dim, c.head_dim, k.shape[0]
        else:
            rs, hs, n = c.head_dim, k.shape[1] * c.head_dim, k.shape[1]
        return median_time(lambda: self.ggml.attend(q, k, v, first_row=0, n_rows=n, row_stride_elems=rs,
                                                    head_stride_elems=hs), self.repeats)

    def torch_layer(self, q, k, v, layout: str) -> float:
        t = self.torch
        kt = k if layout == reference.HEAD_MAJOR else np.swapaxes(k, 0, 1)
        vt = v if layout == reference.HEAD_MAJOR else np.swapaxes(v, 0, 1)
        # f32 on the CPU (torch's CPU f16 SDPA is slower); one call per layer as a user writes it
        qq = t.from_numpy(q)[None, :, None, :]
        kk = t.from_numpy(np.ascontiguousarray(kt, np.float32))[None]
        vv = t.from_numpy(np.ascontiguousarray(vt, np.float32))[None]
        f = t.nn.functional.scaled_dot_product_attention
        return median_time(lambda: f(qq, kk, vv, scale=self.cfg.attention_scale, enable_gqa=True), self.repeats)

    def reference_layer(self, q, k, v, layout: str) -> float:
        kt = k if layout == reference.TOKEN_MAJOR else np.swapaxes(k, 0, 1)
        vt = v if layout == reference.TOKEN_MAJOR else np.swapaxes(v, 0, 1)
        return median_time(lambda: reference.attention(q, kt, vt, self.cfg.attention_scale), max(3, self.repeats // 3), 1)


def layer_geometry(base: mt.Geometry, route: str, depth: int) -> mt.Geometry:
    kind = ROUTE_KIND[route]
    return base.with_overrides(name=f"{base.name}-1{kind}", n_layers=1, layer_pattern=(kind,),
                               window=depth, max_context=depth, swa_ring_slack=0)


def bench_layer(base, route, depth, arch, peers: Peers, rng, repeats) -> dict:
    cfg = layer_geometry(base, route, depth)
    eng = mt.Engine(cfg, arch=arch, force=route)
    prefill(eng, depth - 1, rng)
    ours, q = timed_step(eng, rng, repeats)
    assert eng.routes == [route], eng.routes
    kh, vh = eng.cache.host_views(ROUTE_KIND[route])
    k, v, layout = kh[0], vh[0], reference.TOKEN_MAJOR if route == "splitk" else reference.HEAD_MAJOR
    row = {"what": f"1 layer {route}", "depth": depth, "visible": depth, "ours_ms": ours * 1e3}
    qh = q[0]
    if peers.ggml is not None:
        row["ggml_ms"] = peers.ggml_layer(qh, k, v, layout) * 1e3
    if peers.torch is not None:
        row["torch_ms"] = peers.torch_layer(qh, k, v, layout) * 1e3
    row["numpy_ref_ms"] = peers.reference_layer(qh, k, v, layout) * 1e3
    return finish(row, base, [depth])


def bench_step(base, depth, arch, peers: Peers, rng, repeats) -> dict:
    eng = mt.Engine(base, arch=arch, pinned="off")  # the project's own routes; ggml is the peer
    prefill(eng, depth - 1, rng)
    ours, q = timed_step(eng, rng, repeats)
    visibles = [base.visible(kind, depth - 1) for kind in base.layer_kinds]
    row = {"what": f"{base.n_layers}-layer step", "depth": depth, "visible": max(visibles), "ours_ms": ours * 1e3,
           "routes": dict(eng.route_counts)}
    # peers: one call per layer, as a user of each library would write the step (zero-copy plane views)
    host = {kind: eng.cache.host_views(kind) for kind in eng.planes}
    planes = [(host[kind][0][eng.cache.slot[layer]], host[kind][1][eng.cache.slot[layer]], eng.planes[kind].state,
               reference.TOKEN_MAJOR if kind == "swa" else reference.HEAD_MAJOR)
              for layer, kind in enumerate(base.layer_kinds)]
    for name, fn in (("ggml_ms", peers.ggml_layer if peers.ggml else None),
                     ("torch_ms", peers.torch_layer if peers.torch else None)):
        if fn is None:
            continue
        total = 0.0
        for layer, (k, v, st, layout) in enumerate(planes):
            n = visibles[layer]
            if layout == reference.TOKEN_MAJOR:
                rows = reference.gather(k, st, reference.visible_logicals(depth - 1, base.window), layout)
                vrows = reference.gather(v, st, reference.visible_logicals(depth - 1, base.window), layout)
            else:
                rows, vrows = k[:, :n], v[:, :n]
            total += fn(q[layer], np.ascontiguousarray(rows), np.ascontiguousarray(vrows), layout)
        row[name] = total * 1e3
    return finish(row, base, visibles)


# ---- GPU: one layer's GPU time (CUPTI, or Taichi's kernel profiler), wall time per step, torch, copy floor ----

def gpu_layer(base, route, depth, arch, rng, repeats, torch) -> dict:
    """One layer's producer + reducer.  On CUDA with torch: the GPU's busy time per launch pair from CUPTI
    (cupti_layer_row); with MUSER_TI_KERNEL_PROFILER=1, Taichi's kernel profiler (which overstates short
    tasks); else (Vulkan) the device time from graph replays (graph_repeat_us), with the wall time of 10
    back-to-back pairs from Python beside it (host_wall_ms), which on NVIDIA's Vulkan is mostly the host's
    launches."""
    import taichi as ti

    cfg = layer_geometry(base, route, depth)
    eng = mt.Engine(cfg, arch=arch, force=route)
    prefill(eng, depth - 1, rng)
    timed_step(eng, rng, 2)  # leaves the planes at `depth` rows and compiles everything
    profiled = os.environ.get("MUSER_TI_KERNEL_PROFILER") == "1"
    nwg, nsg = eng.split_geometry(depth, 1)
    row = {"depth": depth, "visible": depth, "workgroups": nwg, "simdgroups": nsg}
    trace = cupti_layer_row(eng, route, repeats) if torch is not None and arch == "cuda" and not profiled else None
    if trace is not None and trace["gpu_busy_us"] == 0:  # ncu holds CUPTI while it profiles (scripts/lab/run.sh profile)
        print(f"{route} at {depth}: CUPTI saw no kernels (another profiler attached?); timing wall instead",
              file=sys.stderr)
        trace = None
    if trace is not None:
        row.update({"what": f"1 layer {route} (GPU busy, CUPTI)", "ours_ms": trace["gpu_busy_us"] * 1e-3,
                    "kernel_us": trace["kernel_us"], "host_wall_ms": trace["wall_us"] * 1e-3})
    else:
        launch = layer_launch(eng, route)
        times, tasks = [], {}
        for _ in range(repeats):
            ti.sync()
            if profiled:  # device time of the launch's tasks (CUDA; Taichi's profiler crashes on Vulkan)
                ti.profiler.clear_kernel_profiler_info()
                launch()
                ti.sync()
                times.append(ti.profiler.get_kernel_profiler_total_time())
                for name, ms in profiled_tasks():
                    tasks.setdefault(name, []).append(ms)
            else:  # wall time of 10 back-to-back launches pairs, host launch cost included
                t0 = time.perf_counter()
                for _ in range(10):
                    launch()
                ti.sync()
                times.append((time.perf_counter() - t0) / 10)
        if profiled:
            row.update({"what": f"1 layer {route} (device)", "ours_ms": statistics.median(times) * 1e3})
        else:
            device_us = graph_repeat_us(recorded_dispatches(eng.launcher, launch), GRAPH_REPLAYS, repeats)
            row.update({"what": f"1 layer {route} (device, graph replays)", "ours_ms": device_us * 1e-3,
                        "host_wall_ms": statistics.median(times) * 1e3})
        if tasks:  # where the device time goes: each kernel's tasks (a serial one computes a range-for's bound)
            row["tasks_ms"] = {name: statistics.median(ms) for name, ms in tasks.items()}
    if torch is not None:
        row["torch_ms"] = torch_sdpa_ms(torch, cfg, [depth], repeats)
    return finish(row, base, [depth])


def layer_launch(eng: mt.Engine, route: str):
    """A call that launches one layer engine's producer + reducer over its planes as they stand (the
    last step's position), with no step around it."""
    kind = ROUTE_KIND[route]
    layers = tuple(eng.cfg.swa_layers if kind == "swa" else eng.cfg.nope_layers)
    lc = eng.launcher
    producer, reduce = (lc.splitk, lc.reduce_f32) if route == "splitk" else (lc.interleaved, lc.reduce_v2)
    st, p = eng.planes[kind].state, eng.position - 1
    return lambda: lc.run_producer(producer, reduce, kind, layers, st, p, lc.k_cur, lc.v_cur, lc.out)


def cupti_layer_row(eng: mt.Engine, route: str, repeats: int, path=None) -> dict:
    """One layer's launch pair under CUPTI (muser_ti.measure), synchronised each time: medians of the GPU's
    busy time (the union of the pair's kernel spans), each kernel's time and the host's wall per pair."""
    import taichi as ti

    launch = layer_launch(eng, route)

    def pair():
        launch()
        ti.sync()

    return cupti_busy(pair, repeats, before=ti.sync, path=path)


def profiled_tasks() -> list[tuple[str, float]]:
    """(kernel:task, ms) of every task since the profiler was cleared, named like "producer:range_for"."""
    from taichi.lang import impl

    prog = impl.get_runtime().prog
    prog.sync_kernel_profiler()
    prog.update_kernel_profiler()
    out = []
    for rec in prog.get_kernel_profiler_records():
        m = re.match(r"(\w+?)_c\d+_\d+_kernel_\d+_(\w+)$", rec.name)
        out.append((f"{m[1]}:{m[2]}" if m else rec.name, rec.kernel_time))
    return out


def torch_sdpa_ms(torch, cfg, visibles, repeats) -> float:
    """torch SDPA, f16, enable_gqa, one call per layer as a user writes it; CUDA-event median."""
    dev = "cuda"
    H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qs = [torch.randn(1, H, 1, D, device=dev, dtype=torch.float16) for _ in visibles]
    ks = [torch.randn(1, KV, n, D, device=dev, dtype=torch.float16) for n in visibles]
    vs = [torch.randn(1, KV, n, D, device=dev, dtype=torch.float16) for n in visibles]
    f = torch.nn.functional.scaled_dot_product_attention

    def once():
        for q, k, v in zip(qs, ks, vs):
            f(q, k, v, scale=cfg.attention_scale, enable_gqa=True)

    for _ in range(3):
        once()
    times = []
    for _ in range(max(repeats, 20)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        once()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def gpu_step(base, depth, arch, rng, repeats, torch) -> dict:
    eng = mt.Engine(base, arch=arch, pinned="off")
    prefill(eng, depth - 1, rng)
    ours, _ = timed_step(eng, rng, repeats, warmup=3)
    eng.rewind(eng.position - 1)  # timed_step leaves its last step in place
    resident = timed_device_step(eng, rng, repeats, warmup=3)
    visibles = [base.visible(kind, depth - 1) for kind in base.layer_kinds]
    row = {"what": f"{base.n_layers}-layer step (wall, host incl.)", "depth": depth, "visible": max(visibles),
           "ours_ms": ours * 1e3, "launches": eng.launches_last_step, "routes": dict(eng.route_counts),
           # the same step with q/k/v/out on the device (Engine.step_device), as an on-device decoder calls it
           "device_io_ms": resident * 1e3}
    if torch is not None:
        row["torch_ms"] = torch_sdpa_ms(torch, base, visibles, repeats)
        row["device_io_over_torch"] = row["device_io_ms"] / row["torch_ms"]
    return finish(row, base, visibles)


def finish(row: dict, cfg: mt.Geometry, visibles: list[int]) -> dict:
    kv_bytes = sum(visibles) * cfg.kv_bytes_per_row
    flop = 4.0 * cfg.n_heads * cfg.head_dim * sum(visibles)  # QK and PV, a multiply and an add each
    row["kv_mb"] = kv_bytes / 1e6
    row["ours_gb_s"] = kv_bytes / (row["ours_ms"] * 1e-3) / 1e9
    row["ours_gflop_s"] = flop / (row["ours_ms"] * 1e-3) / 1e9
    if COPY_GB_S:
        row["byte_floor_ms"] = kv_bytes / (COPY_GB_S * 1e9) * 1e3
        row["ours_over_floor"] = row["ours_ms"] / row["byte_floor_ms"]
    else:
        row["flop_floor_ms"] = cpu_flop_floor_s(flop) * 1e3
    for peer in ("ggml", "torch", "numpy_ref"):
        if f"{peer}_ms" in row:
            row[f"ours_over_{peer}"] = row["ours_ms"] / row[f"{peer}_ms"]
    return row


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    cols = [("what", "what"), ("depth", "depth"), ("workgroups", "nwg"), ("ours_ms", "ours ms"), ("ggml_ms", "ggml ms"),
            ("ours_over_ggml", "ours/ggml"), ("torch_ms", "torch ms"), ("ours_over_torch", "ours/torch"),
            ("device_io_ms", "device I/O ms"), ("device_io_over_torch", "device I/O/torch"),
            ("numpy_ref_ms", "numpy f64 ms"), ("ours_gb_s", "ours GB/s"), ("ours_gflop_s", "ours GFLOP/s"),
            ("flop_floor_ms", "FLOP floor ms"), ("byte_floor_ms", "byte floor ms"), ("ours_over_floor", "ours/floor")]
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    for _, name in cols:
        t.add_column(name, justify="right")
    for r in rows:
        t.add_row(*[(f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r.get(k, ""))) for k, _ in cols])
    # a log file is not a terminal: rich would fold the table into 80 columns and cut every figure to "0.04…"
    Console(width=None if sys.stdout.isatty() else 200).print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="glimmer.yaml")
    ap.add_argument("--arch", default="cpu")
    ap.add_argument("--layer-depths", default="2048,32768,131072")
    ap.add_argument("--step-depths", default="2048,32768")
    ap.add_argument("--routes", default="splitk,interleaved")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows and the machine description here")
    ap.add_argument("--mode", default="layers", choices=["layers", "steps"],
                    help="GPU archs: per-layer device time (run with MUSER_TI_KERNEL_PROFILER=1) or per-step wall time")
    args = ap.parse_args(argv)

    base = mt.load_config(args.config)
    rng = np.random.default_rng(args.seed)
    rows = []
    if args.arch in ("cuda", "vulkan"):
        return gpu_main(args, base, rng, argv)
    peers = Peers(base, args.repeats)
    for depth in int_list(args.layer_depths):
        for route in [r for r in args.routes.split(",") if r]:
            rows.append(bench_layer(base, route, depth, args.arch, peers, rng, args.repeats))
            print(json.dumps(rows[-1]), flush=True)
    for depth in int_list(args.step_depths):
        rows.append(bench_step(base, depth, args.arch, peers, rng, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    info = {"machine": machine(), "arch": args.arch, "config": base.source, "repeats": args.repeats}
    return report(rows, info, args, argv, f"{base.name} on {args.arch}: medians of {args.repeats} "
                                          f"({info['machine'].get('cpu', '')})")


def report(rows: list[dict], info: dict, args, argv, title: str) -> int:
    """Print the table and write the JSON (rows, machine, the command that made them)."""
    info = {**info, "command": "muser-bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "rows": rows}
    print_table(rows, title)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(info, indent=2))
    return 0


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def gpu_main(args, base, rng, argv) -> int:
    """GPU mode: --mode layers (one layer's GPU time: gpu_layer says how) or steps (wall time)."""
    global COPY_GB_S
    try:
        import torch

        torch = torch if torch.cuda.is_available() else None
    except ImportError:
        torch = None
    if torch is not None:
        COPY_GB_S = copy_bandwidth_gb_s(torch)
        print(f"device copy bandwidth: {COPY_GB_S:.0f} GB/s", flush=True)
    rows = []
    if args.mode == "layers":
        for depth in int_list(args.layer_depths):
            for route in [r for r in args.routes.split(",") if r]:
                rows.append(gpu_layer(base, route, depth, args.arch, rng, args.repeats, torch))
                print(json.dumps(rows[-1]), flush=True)
    else:
        for depth in int_list(args.step_depths):
            rows.append(gpu_step(base, depth, args.arch, rng, args.repeats, torch))
            print(json.dumps(rows[-1]), flush=True)
    info = {"machine": machine(), "arch": args.arch, "mode": args.mode, "copy_gb_s": COPY_GB_S}
    return report(rows, info, args, argv, f"{base.name} on {args.arch} ({args.mode}): medians of {args.repeats}")


if __name__ == "__main__":
    sys.exit(main())
