"""The CPU half of muser-bench: ours and llama.cpp's CPU kernel, each alone in a process of its own, in turns.

On a small machine a figure is only worth its neighbours: with another process busy, ggml's threads wait at
every node's barrier for a descheduled thread (2-5x slower on the 2-core development VM) while the engine
barely moves, and the ratio means nothing.  So every (case, side) runs in a fresh process, the sides take
turns for --rounds rounds, and a figure is the median of its processes' medians, each over --repeats calls
after two untimed ones, wall time per call for both sides.  The floor is the case's FLOPs at this CPU's f32
FMA peak, measured the same way by muser_ti.bench.fma_peak (a kernel of our own), not taken from a data sheet.

Cases: one layer per route (splitk: an SWA ring whose window is the depth; interleaved: a NoPE plane) and the
whole model's step, at the given depths.  Ours: Engine(pinned="off").step + rewind(1), so every call attends
exactly the depth.  ggml: ggml_flash_attn_ext (the pinned ggml-python 0.0.45), every layer of a step a node
of one graph on a persistent threadpool of os.cpu_count() threads, over f16 planes of the engine's layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import numpy as np

import muser_ti as mt
from muser_ti.bench import fma_peak
from muser_ti.bench.timing import child_env, machine, median_time

from .bench_common import finish, layer_geometry, prefill, report, timed_step

SIDES = ("ours", "ggml")


def cases(args) -> list[str]:
    """Case names: 'layer:<route>:<depth>' and 'step:<depth>'."""
    layer = [f"layer:{route}:{d}" for d in args.layer_depths for route in args.routes]
    return layer + [f"step:{d}" for d in args.step_depths]


def case_geometry(base: mt.Geometry, case: str) -> mt.Geometry:
    kind, *rest = case.split(":")
    if kind == "layer":
        return layer_geometry(base, rest[0], int(rest[1]))
    depth = int(rest[0])
    return base.with_overrides(max_context=max(depth, base.max_context))


def case_depth(case: str) -> int:
    return int(case.split(":")[-1])


# ---- one side of one case, in this process ---------------------------------------------------------------
def time_ours(base: mt.Geometry, case: str, repeats: int) -> float:
    cfg, depth = case_geometry(base, case), case_depth(case)
    eng = mt.Engine(cfg, arch="cpu", pinned="off")
    rng = np.random.default_rng(0)
    prefill(eng, depth - 1, rng)
    seconds, _ = timed_step(eng, rng, repeats)
    return seconds


def random_halves(rng, shape) -> np.ndarray:
    """f16 values of magnitude in [1/8, 1) with random signs, made from random bits (fast at 10**8 values)."""
    bits = rng.integers(0x3000, 0x3C00, size=shape, dtype=np.uint16) | (rng.integers(0, 2, size=shape, dtype=np.uint16) << 15)
    return bits.view(np.float16)


def time_ggml(base: mt.Geometry, case: str, repeats: int) -> float:
    from muser_ti.pinned.ggml import GgmlFlashAttn, KVView

    cfg, depth = case_geometry(base, case), case_depth(case)
    rng = np.random.default_rng(0)
    KV, D = cfg.n_kv_heads, cfg.head_dim
    views, planes = [], []
    for kind in cfg.layer_kinds:
        rows = min(depth, cfg.window) if kind == "swa" else depth
        if kind == "swa":  # a full ring, token-major [rows, kv, d]: attention does not depend on row order
            k, v = random_halves(rng, (rows, KV, D)), random_halves(rng, (rows, KV, D))
            strides = (KV * D, D)
        else:  # head-major [kv, rows, d]
            k, v = random_halves(rng, (KV, rows, D)), random_halves(rng, (KV, rows, D))
            strides = (D, rows * D)
        planes.append((k, v))
        views.append(KVView(k, v, 0, rows, *strides))
    runner = GgmlFlashAttn(D, cfg.n_heads, KV, cfg.attention_scale, os.cpu_count(), n_nodes=len(views))
    q = rng.standard_normal((len(views), cfg.n_heads, D), dtype=np.float32)
    return median_time(lambda: runner.attend_many(q, views), repeats)


def run_side(args) -> int:
    """--side: time one side of one case here and print {"ms": ...} as the last line."""
    base = mt.load_config(args.config)
    timer = {"ours": time_ours, "ggml": time_ggml}[args.side]
    print(json.dumps({"ms": timer(base, args.case, args.repeats) * 1e3}), flush=True)
    return 0


# ---- the orchestration: every (case, side) in its own process, in turns --------------------------------
def in_process(args, case: str, side: str) -> float:
    command = [sys.executable, "-m", "muser_ti.cli.bench_cpu", "--side", side, "--case", case,
               "--config", args.config, "--repeats", str(args.repeats)]
    done = subprocess.run(command, capture_output=True, text=True, env=child_env())
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["ms"]


def cpu_main(args, base: mt.Geometry, argv) -> int:
    sides = [s for s in SIDES if s != "ggml" or mt.pinned_library_status("cpu")[0]]
    if "ggml" not in sides:
        print(f"ggml peer unavailable: {mt.pinned_library_status('cpu')[1]}", file=sys.stderr)
    peaks = [fma_peak.probe()["gflop_s"] for _ in range(args.rounds)]
    peak = statistics.median(peaks)
    print(json.dumps({"fma_peak_gflop_s": peaks}), flush=True)
    rows = []
    for case in cases(args):
        ms = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side in sides:
                ms[side].append(in_process(args, case, side))
        cfg, depth = case_geometry(base, case), case_depth(case)
        visibles = [cfg.visible(kind, depth - 1) for kind in cfg.layer_kinds]
        kind = case.split(":")[0]
        what = f"1 layer {case.split(':')[1]}" if kind == "layer" else f"{cfg.n_layers}-layer step"
        row = {"what": what, "depth": depth, "ours_ms": statistics.median(ms["ours"]), "ours_runs_ms": ms["ours"]}
        if "ggml" in ms:
            row |= {"ggml_ms": statistics.median(ms["ggml"]), "ggml_runs_ms": ms["ggml"]}
        rows.append(finish(row, cfg, visibles, fma_peak_gflop_s=peak))
        print(json.dumps(rows[-1]), flush=True)
    info = {"machine": machine(), "arch": "cpu", "config": base.source, "repeats": args.repeats, "rounds": args.rounds,
            "fma_peak_gflop_s": peak, "fma_peak_runs": peaks,
            "timing": "wall time per call; each (case, side) alone in its own process, sides in turns; "
                      "medians of the processes' medians"}
    return report(rows, info, args, argv, f"{base.name} on cpu: wall per call, medians of {args.rounds} processes "
                                          f"x {args.repeats} calls, each side alone ({info['machine'].get('cpu', '')}, "
                                          f"FMA peak {peak:.0f} GFLOP/s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="one side of one CPU bench case (muser-bench runs these)")
    ap.add_argument("--side", choices=SIDES, required=True)
    ap.add_argument("--case", required=True)
    ap.add_argument("--config", default="glimmer.yaml")
    ap.add_argument("--repeats", type=int, default=7)
    return run_side(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
