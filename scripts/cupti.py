"""CUPTI through torch.profiler: what ran on the GPU during each of a few marked calls.

Taichi launches its CUDA kernels through the driver API on the primary context, the one torch uses,
so CUPTI sees them, with their device timestamps, beside the host's driver calls.  Taichi's own kernel
profiler times each task with events of its own and overstates short tasks (5-7 us for a one-thread
task CUPTI puts at 1-2 us, docs/PERF.md run 10).  Used by scripts/bench.py (one layer's GPU busy time)
and scripts/tune_gpu.py (step traces).
"""

import json
import os
import statistics
import tempfile
from pathlib import Path

TIMELINE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_driver", "cuda_runtime")


def profile_calls(call, repeats: int, before=None, after=None, path=None) -> list[dict]:
    """Run ``call`` ``repeats`` times under torch.profiler, each marked "step" (``before`` runs unmarked
    ahead of each, ``after`` once at the end, inside the profile); the chrome trace's events, also
    written to ``path`` when given."""
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


TIMELINE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_driver", "cuda_runtime")


def summarize_trace(events: list[dict], n_steps: int) -> dict:
    """Per-step medians from a chrome trace's events: each "step" annotation's wall, the kernels that
    ran inside it (by name), GPU busy time (union of kernel spans), and host driver/runtime calls; and
    one step's timeline, event by event (docs/PERF.md run 10 reads one)."""
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
        busy = intervals_union(spans)
        first = min((a for a, _ in spans), default=t0)
        last = max((b for _, b in spans), default=t0)
        per_step.append({
            "wall_us": s["dur"],
            "gpu_busy_us": busy,
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
