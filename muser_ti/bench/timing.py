"""Timing helpers shared by the bench command (muser_ti/cli/bench.py) and the lab's tools (scripts/lab/).

How each figure is timed matters more than the figure: a peer and our kernel in one table are timed the
same way.  Three ways live here:

* wall time of a whole call (``median_time``): what a user waits for, the host included;
* a GPU layer's busy time from CUPTI through torch.profiler (``profile_calls`` + ``summarize_trace``):
  the union of the kernels' device spans, no host gaps;
* a dispatch list's device time from graph replays (``graph_repeat_us``), where there is no CUPTI
  (Vulkan): K and 3K replays, the difference over 2K, so a run's fixed costs cancel.

Beside them, ``random_halves``: the f16 K/V the peers' caches are filled with (the CPU bench's and the batch
bench's ggml sides).

Nothing here imports the lab; the lab imports this.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

TIMELINE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_driver", "cuda_runtime")
GRAPH_REPLAYS = 8  # K of graph_repeat_us: K and 3K pairs a graph


def median_time(fn, repeats: int, warmup: int = 2) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def child_env() -> dict:
    """The environment for a measurement in a process of its own: this one's, with this package importable
    (a checkout run as ``python scripts/...`` has it on sys.path only)."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding muser_ti/
    paths = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def machine() -> dict:
    """The machine a figure was taken on: platform, Python, cores and the CPU's model name."""
    info = {"platform": platform.platform(), "python": platform.python_version(), "cores": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


# ---- GPU: a dispatch list's device time from graph replays ------------------------------------------
def recorded_dispatches(launcher, launch) -> list:
    """The (kernel, args) dispatches that ``launch()`` makes through ``launcher`` (an engine's Launcher),
    recorded, not launched."""
    launcher.recorded = []
    try:
        launch()
        return launcher.recorded
    finally:
        launcher.recorded = None


def graph_repeat_us(dispatches, k: int, repeats: int) -> float:
    """The device's time in us for one run of ``dispatches``: replayed k and 3k times as one ti.graph each,
    to completion; (t(3k) - t(k)) / 2k, so a run's fixed costs (a Vulkan wait among them) cancel.  An upper
    bound: where the device outruns the host's issue of a dispatch in a graph, it is that issue's cost."""
    import taichi as ti

    from ..replay import GraphReplay

    replay = GraphReplay()

    def run(n):
        replay.run(dispatches * n)
        ti.sync()

    return (median_time(lambda: run(3 * k), repeats) - median_time(lambda: run(k), repeats)) / (2 * k) * 1e6


# ---- CUDA: CUPTI through torch.profiler ------------------------------------------------------------
def profile_calls(call, repeats: int, before=None, after=None, path=None) -> list[dict]:
    """Run ``call`` ``repeats`` times under torch.profiler, each marked "step" (``before`` runs unmarked
    ahead of each, ``after`` once at the end, inside the profile); the chrome trace's events, also
    written to ``path`` when given.  Taichi launches its CUDA kernels through the driver API on the
    primary context, the one torch uses, so CUPTI sees them with their device timestamps."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            if before is not None:
                before()
            with record_function("step"):
                call()
        if after is not None:
            after()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        return json.loads(Path(path).read_text())["traceEvents"]
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        return json.loads(Path(tmp).read_text())["traceEvents"]
    finally:
        os.unlink(tmp)


def intervals_union(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) spans (us)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize_trace(events: list[dict], n_steps: int) -> dict:
    """Per-step medians from a chrome trace's events: each "step" annotation's wall, the kernels that
    ran inside it (by name), GPU busy time (union of kernel spans), and host driver/runtime calls; and
    one step's timeline, event by event."""
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("name") == "step"),
                   key=lambda e: e["ts"])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    calls = [e for e in events if e.get("cat") in ("cuda_driver", "cuda_runtime")]
    per_step = []
    for i, s in enumerate(steps):
        t0 = s["ts"]
        t1 = steps[i + 1]["ts"] if i + 1 < len(steps) else float("inf")  # kernels may finish after the host span
        ks = [k for k in kernels if t0 <= k["ts"] < t1]
        cs = [c for c in calls if t0 <= c["ts"] < t0 + s["dur"]]
        by_kernel: dict = {}
        for k in ks:
            by_kernel.setdefault(k["name"], []).append(k["dur"])
        by_call: dict = {}
        for c in cs:
            by_call.setdefault(c["name"], []).append(c["dur"])
        spans = [(k["ts"], k["ts"] + k["dur"]) for k in ks]
        first = min((a for a, _ in spans), default=t0)
        last = max((b for _, b in spans), default=t0)
        per_step.append({
            "wall_us": s["dur"],
            "gpu_busy_us": intervals_union(spans),
            "gpu_span_us": last - first,  # first kernel start to last kernel end
            "first_kernel_after_us": first - t0,
            "last_kernel_end_after_host_us": last - (t0 + s["dur"]),
            "kernels": {n: sum(d) for n, d in by_kernel.items()},
            "kernel_count": len(ks),
            "calls": {n: (len(d), sum(d)) for n, d in by_call.items()},
        })
    per_step = per_step[-n_steps:]
    med = statistics.median

    def med_of(key):
        return med([p[key] for p in per_step])

    # one step's timeline, the step before last (the last one's kernels may run past the profiler's end):
    # (us from the step's start, us, category, name) of every kernel, copy and driver call in it
    timeline = []
    if len(steps) >= 2:
        s, t1 = steps[-2], steps[-1]["ts"]
        timeline = [(round(e["ts"] - s["ts"], 1), round(e["dur"], 1), e["cat"], e["name"][:60]) for e in
                    sorted((e for e in events if e.get("cat") in TIMELINE_CATEGORIES and s["ts"] <= e.get("ts", -1) < t1),
                           key=lambda e: e["ts"])]
    names = sorted({n for p in per_step for n in p["kernels"]})
    call_names = sorted({n for p in per_step for n in p["calls"]})
    return {
        "steps": len(per_step),
        "wall_us": med_of("wall_us"),
        "gpu_busy_us": med_of("gpu_busy_us"),
        "gpu_span_us": med_of("gpu_span_us"),
        "gpu_idle_in_span_us": med([p["gpu_span_us"] - p["gpu_busy_us"] for p in per_step]),
        "first_kernel_after_us": med_of("first_kernel_after_us"),
        "last_kernel_end_after_host_us": med_of("last_kernel_end_after_host_us"),
        "kernel_count": med_of("kernel_count"),
        "kernel_us": {n: med([p["kernels"].get(n, 0.0) for p in per_step]) for n in names},
        "host_calls": {n: {"count": med([p["calls"].get(n, (0, 0))[0] for p in per_step]),
                           "us": med([p["calls"].get(n, (0, 0.0))[1] for p in per_step])} for n in call_names},
        "timeline": timeline,
    }


def cupti_busy(call, repeats: int, before=None, path=None) -> dict:
    """``call()`` (which must end with a device sync) under CUPTI, ``repeats`` times: medians of the GPU's
    busy time, each kernel's time and the host's wall per call (summarize_trace's keys)."""
    call()
    return summarize_trace(profile_calls(call, repeats, before=before, path=path), repeats)


# ---- CUDA peers and the byte floor (torch) ---------------------------------------------------------
def copy_bandwidth_gb_s(torch, n_bytes=4 << 30) -> float:
    """Device-to-device copy, bytes read + written over time: the floor every GB/s figure sits beside."""
    src = torch.empty(n_bytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return 2 * n_bytes / statistics.median(times) / 1e9




def random_halves(rng, shape) -> np.ndarray:
    """f16 values of magnitude in [1/8, 1) with random signs, made from random bits (fast at 10**8 values)."""
    bits = rng.integers(0x3000, 0x3C00, size=shape, dtype=np.uint16)
    bits |= rng.integers(0, 2, size=shape, dtype=np.uint16) << 15
    return bits.view(np.float16)


__all__ = ["GRAPH_REPLAYS", "copy_bandwidth_gb_s", "cupti_busy", "graph_repeat_us", "intervals_union", "machine",
           "median_time", "profile_calls", "random_halves", "recorded_dispatches", "summarize_trace"]
