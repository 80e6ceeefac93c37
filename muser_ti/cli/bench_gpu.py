"""The bench command's GPU part (muser-bench --arch cuda|vulkan): one layer's GPU busy time against torch
SDPA and llama.cpp's CUDA kernel, all by CUPTI in one process (graph replays on Vulkan), and the whole
step's wall time per token, one token at a time and pipelined, against torch's 52 calls."""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

import muser_ti as mt
from muser_ti import reference
from muser_ti.bench.timing import (GRAPH_REPLAYS, copy_bandwidth_gb_s, cupti_busy, graph_repeat_us, machine,
                                   recorded_dispatches)

from .bench_common import (ROUTE_KIND, device_token, finish, layer_geometry, prefill, random_token, report,
                           timed_device_step, timed_step)

def gpu_layer(base, route, depth, arch, rng, repeats, torch, copy_gb_s: float) -> dict:
    """One layer's producer + reducer, timed as GPU busy time.  On CUDA: CUPTI (through torch.profiler)
    around each launch pair, and around each peer's call in the same process: torch SDPA (enable_gqa, f16)
    and, where a CUDA build of the pinned ggml is present, llama.cpp's own kernel over the same K/V bytes,
    whose output is also held against ours and the float64 reference.  On Vulkan (no CUPTI) the device
    time from graph replays (graph_repeat_us, an upper bound), with the wall time of 10 back-to-back pairs
    from Python beside it (host_wall_ms); its peers are the CUDA rows."""
    import taichi as ti

    cfg = layer_geometry(base, route, depth)
    eng = mt.Engine(cfg, arch=arch, force=route)
    prefill(eng, depth - 1, rng)
    q, k, v = random_token(cfg, rng)
    out = eng.step(q, k, v)  # the planes now hold `depth` rows; every kernel compiled
    nwg, nsg = eng.split_geometry(depth, 1)
    row = {"depth": depth, "visible": depth, "workgroups": nwg, "simdgroups": nsg,
           "ours_rel_err": reference.relative_error(out, eng.reference(q, k, v))}
    if arch == "cuda" and torch is not None:
        trace = cupti_layer_row(eng, route, repeats)
        if trace["gpu_busy_us"] == 0:  # ncu holds CUPTI while it profiles (scripts/lab/run.sh profile)
            raise SystemExit(f"{route} at {depth}: CUPTI saw no kernels (another profiler attached?)")
        row.update({"what": f"1 layer {route} (GPU busy, CUPTI)", "ours_ms": trace["gpu_busy_us"] * 1e-3,
                    "kernel_us": trace["kernel_us"], "host_wall_ms": trace["wall_us"] * 1e-3,
                    "torch_ms": torch_sdpa_busy_ms(torch, cfg, depth, repeats)})
        row.update(ggml_cuda_peer(eng, route, q, out, repeats))
    else:
        launch = layer_launch(eng, route)
        times = []
        for _ in range(repeats):
            ti.sync()
            t0 = time.perf_counter()
            for _ in range(10):
                launch()
            ti.sync()
            times.append((time.perf_counter() - t0) / 10)
        device_us = graph_repeat_us(recorded_dispatches(eng.launcher, launch), GRAPH_REPLAYS, repeats)
        row.update({"what": f"1 layer {route} (device, graph replays)", "ours_ms": device_us * 1e-3,
                    "host_wall_ms": statistics.median(times) * 1e3})
    return finish(row, base, [depth], copy_gb_s)


def torch_sdpa_busy_ms(torch, cfg, depth: int, repeats: int) -> float:
    """torch SDPA's GPU busy time for one layer (f16, enable_gqa, one query), by CUPTI as ours."""
    H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = torch.randn(1, H, 1, D, device="cuda", dtype=torch.float16)
    k = torch.randn(1, KV, depth, D, device="cuda", dtype=torch.float16)
    v = torch.randn(1, KV, depth, D, device="cuda", dtype=torch.float16)
    f = torch.nn.functional.scaled_dot_product_attention

    def call():
        f(q, k, v, scale=cfg.attention_scale, enable_gqa=True)
        torch.cuda.synchronize()

    return cupti_busy(call, repeats, before=torch.cuda.synchronize)["gpu_busy_us"] * 1e-3


def ggml_cuda_peer(eng: mt.Engine, route: str, q: np.ndarray, ours: np.ndarray, repeats: int) -> dict:
    """llama.cpp's CUDA kernel over the rows our layer attended (the same f16 bytes), by CUPTI; and its
    output against ours and the float64 reference, in the llama rung's units (max |V|).  Empty where no
    CUDA build of the pinned ggml is present (muser_ti/bench/ggml_cuda_peer.py says how to get one)."""
    from muser_ti.bench import ggml_cuda_peer as ggml_peer  # the module (this function is its user)

    ok, why = ggml_peer.status()
    if not ok:
        print(f"llama.cpp CUDA peer not timed: {why}", file=sys.stderr)
        return {}
    cfg, kind = eng.cfg, ROUTE_KIND[route]
    p = eng.position - 1
    kp, vp = (a[0] for a in eng.plane_halves(kind))
    st = eng.planes[kind].state
    layout = reference.TOKEN_MAJOR if kind == "swa" else reference.HEAD_MAJOR
    rows = reference.visible_logicals(p, cfg.window if kind == "swa" else 0)
    k = reference.gather(kp, st, rows, layout)  # [rows, KV, D]
    v = reference.gather(vp, st, rows, layout)
    peer = ggml_peer.GgmlCudaAttn(cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, len(rows), cfg.attention_scale)
    try:
        peer.load(np.swapaxes(k, 0, 1), np.swapaxes(v, 0, 1))
        theirs = peer.attend(q[0])
        ref = reference.attention(q[0], k.astype(np.float64), v.astype(np.float64), cfg.attention_scale)
        vmax = float(np.abs(v).max())
        busy = cupti_busy(peer.compute, repeats)["gpu_busy_us"]
    finally:
        peer.close()
    return {"ggml_ms": busy * 1e-3, "ggml_err_vtol": float(np.abs(theirs - ref).max()) / vmax,
            "ours_vs_ggml_vtol": float(np.abs(ours[0] - theirs).max()) / vmax}


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
    """One layer's launch pair under CUPTI (muser_ti.bench.timing), synchronised each time: medians of the GPU's
    busy time (the union of the pair's kernel spans), each kernel's time and the host's wall per pair."""
    import taichi as ti

    launch = layer_launch(eng, route)

    def pair():
        launch()
        ti.sync()

    return cupti_busy(pair, repeats, before=ti.sync, path=path)


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


PIPELINE = 16  # step_device tokens timed back to back, one synchronisation after them


def gpu_step(base, depth, arch, rng, repeats, torch, copy_gb_s: float) -> dict:
    """The whole model's step, wall time per token, three ways: step() (numpy in and out); step_device()
    with a synchronisation after every token (one token at a time, as a decoder that reads each result
    waits); and PIPELINE tokens of step_device() back to back then one synchronisation, per token, with
    per-token checks (a device wait each for the scan's flags) and with deferred checks (none).  The engine
    is prefilled to depth - PIPELINE, so every timed token attends between depth - PIPELINE + 1 and depth
    keys.  Peer: torch SDPA, one call per layer, wall time per token."""
    import taichi as ti

    # slack of PIPELINE rows in the rings, so the pipelined tokens can be rewound (every token attends the
    # window all the same)
    eng = mt.Engine(base.with_overrides(swa_ring_slack=max(base.swa_ring_slack, PIPELINE)), arch=arch, pinned="off")
    prefill(eng, depth - PIPELINE, rng)
    ours, _ = timed_step(eng, rng, repeats, warmup=3)
    eng.rewind(eng.position - 1)  # timed_step leaves its last step in place
    waits = eng.launcher.transfer.waits
    resident = timed_device_step(eng, rng, repeats, warmup=3)
    visibles = [base.visible(kind, depth - 1) for kind in base.layer_kinds]
    row = {"what": f"{base.n_layers}-layer step (wall per token, host incl.)", "depth": depth,
           "visible": max(visibles), "ours_ms": ours * 1e3, "launches": eng.launches_last_step,
           "routes": dict(eng.route_counts),
           # with q/k/v/out on the device (Engine.step_device), as an on-device decoder calls it
           "device_io_ms": resident * 1e3,
           "device_waits_per_token": (eng.launcher.transfer.waits - waits) / (repeats + 3)}
    eng.rewind(eng.position - 1)
    dev = device_token(*random_token(eng.cfg, rng))
    out = ti.ndarray(ti.f32, dev[0].shape)
    for mode in ("per_token", "deferred"):
        eng.device_checks = mode
        row[f"pipelined_{mode}_ms"] = pipelined_device_steps(eng, dev, out, repeats) * 1e3
    if torch is not None:
        row["torch_ms"] = torch_sdpa_ms(torch, base, visibles, repeats)
        row["device_io_over_torch"] = row["device_io_ms"] / row["torch_ms"]
    return finish(row, base, visibles, copy_gb_s)


def pipelined_device_steps(eng: mt.Engine, dev, out, repeats: int, warmup: int = 2) -> float:
    """Median seconds per token of PIPELINE step_device calls back to back, then eng.sync() and ti.sync(),
    the engine rewound to the same position between repeats (untimed)."""
    import taichi as ti

    p = eng.position
    times = []
    for _ in range(warmup + repeats):
        eng.rewind(p)
        ti.sync()
        t0 = time.perf_counter()
        for _ in range(PIPELINE):
            eng.step_device(*dev, out)
        eng.sync()
        ti.sync()
        times.append((time.perf_counter() - t0) / PIPELINE)
    eng.rewind(p)
    return statistics.median(times[warmup:])


def gpu_main(args, base, rng, argv) -> int:
    """GPU mode: --mode layers (one layer's GPU busy time: gpu_layer says how) or steps (wall time)."""
    try:
        import torch

        torch = torch if torch.cuda.is_available() else None
    except ImportError:
        torch = None
    copy_gb_s = 0.0
    if torch is not None:
        copy_gb_s = copy_bandwidth_gb_s(torch)
        print(f"device copy bandwidth: {copy_gb_s:.0f} GB/s", flush=True)
    rows = []
    if args.mode == "layers":
        for depth in args.layer_depths:
            for route in args.routes:
                rows.append(gpu_layer(base, route, depth, args.arch, rng, args.repeats, torch, copy_gb_s))
                print(json.dumps(rows[-1]), flush=True)
    else:
        for depth in args.step_depths:
            rows.append(gpu_step(base, depth, args.arch, rng, args.repeats, torch, copy_gb_s))
            print(json.dumps(rows[-1]), flush=True)
    info = {"machine": machine(), "arch": args.arch, "mode": args.mode, "copy_gb_s": copy_gb_s}
    return report(rows, info, args, argv, f"{base.name} on {args.arch} ({args.mode}): medians of {args.repeats}")
