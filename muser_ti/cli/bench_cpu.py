"""The CPU half of muser-bench: ours and llama.cpp's CPU kernel, each alone in a process of its own, in turns.

On a small machine a figure is only worth its neighbours: with another process busy, ggml's threads wait at
every node's barrier for a descheduled thread (2-5x slower on the 2-core development VM) while the engine
barely moves, and the ratio means nothing.  So every (case, side) runs in a fresh process, the sides take
turns for --rounds rounds, and a figure is the median of its processes' medians, each over --repeats calls
after two untimed ones, wall time per call for both sides.

The peer is ggml as a llama.cpp user runs it: built natively for this machine (GGML_NATIVE on, llama.cpp's
default) from the pinned ggml-python 0.0.45's own source, by muser_ti.bench.native_ggml (the first run builds it
into ~/.cache/muser-ti/ggml-native/, minutes; a child process loads it through ggml-python pointed at that
folder).  The AVX2-baseline build the pinned rung uses (``pip install`` under scripts/setup.sh) is the second
column, ``ggml_baseline``.  Every row names both builds.

Floors: the case's FLOPs at this CPU's f32 FMA peak, at three peaks (muser_ti.bench.fma_peak): the C kernel at
the CPU's full vector width (512-bit where there is AVX-512: the floor, ``flop_floor_ms``), the C kernel at
256 bits, and the peak a Taichi kernel reaches (the toolchain's ceiling for ours).

Cases: one layer per route (splitk: an SWA ring whose window is the depth; interleaved: a NoPE plane) and the
whole model's step, at the given depths.  Ours: Engine(pinned="off").step + rewind(1), so every call attends
exactly the depth.  ggml: ggml_flash_attn_ext, every layer of a step a node of one graph on a persistent
threadpool of os.cpu_count() threads, over f16 planes of the engine's layouts.  ``MUSER_BENCH_CPU_SIDES``
(comma-separated, among ours, ggml, ggml_baseline, lavapipe) picks the sides; ``lavapipe`` is the engine on
Vulkan through Mesa's software driver, which is a CPU path too (llvmpipe compiles for the host's own features).
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
from muser_ti.bench import fma_peak, native_ggml
from muser_ti.bench.timing import child_env, machine, median_time, random_halves

from .bench_common import finish, layer_geometry, prefill, timed_step

SIDES = ("ours", "ggml", "ggml_baseline", "lavapipe")
DEFAULT_SIDES = ("ours", "ggml", "ggml_baseline")
LAVAPIPE_ICD = "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json"


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
def time_ours(base: mt.Geometry, case: str, repeats: int, arch: str = "cpu") -> float:
    cfg, depth = case_geometry(base, case), case_depth(case)
    eng = mt.Engine(cfg, arch=arch, pinned="off")
    rng = np.random.default_rng(0)
    prefill(eng, depth - 1, rng)
    seconds, _ = timed_step(eng, rng, repeats)
    return seconds


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
    """--side: time one side of one case here and print {"ms": ..., "ggml": <the build it loaded>} last."""
    base = mt.load_config(args.config)
    if args.side == "lavapipe":
        ms = time_ours(base, args.case, args.repeats, arch="vulkan") * 1e3
    else:
        timer = {"ours": time_ours, "ggml": time_ggml, "ggml_baseline": time_ggml}[args.side]
        ms = timer(base, args.case, args.repeats) * 1e3
    out = {"ms": ms}
    if args.side.startswith("ggml"):
        out["ggml"] = native_ggml.loaded_build()
        if out["ggml"]["native"] != (args.side == "ggml"):  # the child loaded another build than it was meant to
            raise SystemExit(f"side {args.side} loaded {out['ggml']}")
    print(json.dumps(out), flush=True)
    return 0


# ---- the orchestration: every (case, side) in its own process, in turns --------------------------------
def side_env(side: str) -> dict:
    if side == "ggml":
        return native_ggml.child_env(native=True)
    env = child_env()
    if side == "lavapipe":
        env["VK_ICD_FILENAMES"] = LAVAPIPE_ICD
    return env


def in_process(args, case: str, side: str) -> dict:
    command = [sys.executable, "-m", "muser_ti.cli.bench_cpu", "--side", side, "--case", case,
               "--config", args.config, "--repeats", str(args.repeats)]
    done = subprocess.run(command, capture_output=True, text=True, env=side_env(side))
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def pick_sides() -> tuple[list[str], dict]:
    """The sides to time and, for each left out, why."""
    want = [s.strip() for s in os.environ.get("MUSER_BENCH_CPU_SIDES", ",".join(DEFAULT_SIDES)).split(",") if s.strip()]
    bad = [s for s in want if s not in SIDES]
    if bad:
        raise SystemExit(f"MUSER_BENCH_CPU_SIDES: unknown sides {bad} (among {', '.join(SIDES)})")
    missing = {}
    if "ggml" in want and native_ggml.built() is None:
        try:
            print(f"building ggml natively for this machine into {native_ggml.build_dir()} (once; minutes)",
                  file=sys.stderr, flush=True)
            native_ggml.ensure_built()
        except Exception as e:  # no compiler, no network for the sdist: say so, time the rest
            missing["ggml"] = f"the native ggml build failed: {e}"
    if "ggml_baseline" in want and not mt.pinned_library_status("cpu")[0]:
        missing["ggml_baseline"] = mt.pinned_library_status("cpu")[1]
    if "lavapipe" in want and not os.path.exists(LAVAPIPE_ICD):
        missing["lavapipe"] = f"no {LAVAPIPE_ICD} (apt install mesa-vulkan-drivers)"
    return [s for s in want if s not in missing], missing


def measure_peaks(rounds: int) -> dict:
    """Each peak's runs (GFLOP/s): 'taichi', 'c256' and, with AVX-512, 'c512' (muser_ti.bench.fma_peak)."""
    runs = {}
    for _ in range(rounds):
        for name, value in fma_peak.peaks().items():
            runs.setdefault(name, []).append(value)
    return runs


def builds(sides) -> dict:
    """What each ggml side runs, in words (the rows carry it)."""
    out = {}
    if "ggml" in sides:
        out["ggml"] = native_ggml.describe()
    if "ggml_baseline" in sides:
        out["ggml_baseline"] = "ggml v0.15.3 AVX2 baseline (pip's ggml-python 0.0.45 build, GGML_NATIVE=OFF)"
    return out


def cpu_main(args, base: mt.Geometry, argv) -> int:
    sides, missing = pick_sides()
    for side, why in missing.items():
        print(f"{side} peer unavailable: {why}", file=sys.stderr)
    peak_runs = measure_peaks(args.rounds)
    peaks = {name: statistics.median(v) for name, v in peak_runs.items()}
    full = f"c{max(fma_peak.c_widths())}" if fma_peak.c_widths() else "taichi"
    print(json.dumps({"fma_peak_gflop_s": peak_runs}), flush=True)
    named = builds(sides)
    rows = []
    for case in cases(args):
        ms = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side in sides:
                ms[side].append(in_process(args, case, side)["ms"])
        cfg, depth = case_geometry(base, case), case_depth(case)
        visibles = [cfg.visible(kind, depth - 1) for kind in cfg.layer_kinds]
        kind = case.split(":")[0]
        what = f"1 layer {case.split(':')[1]}" if kind == "layer" else f"{cfg.n_layers}-layer step"
        row = {"what": what, "depth": depth, "ours_ms": statistics.median(ms["ours"]), "ours_runs_ms": ms["ours"]}
        for side in sides:
            if side != "ours":
                row |= {f"{side}_ms": statistics.median(ms[side]), f"{side}_runs_ms": ms[side]}
                if side in named:
                    row[f"{side}_build"] = named[side]
        row = finish(row, cfg, visibles, fma_peak_gflop_s=peaks[full])
        row["flop_floor_at"] = f"{full}: {peaks[full]:.0f} GFLOP/s"
        flop = row["ours_gflop_s"] * row["ours_ms"] * 1e-3 * 1e9
        for name, value in peaks.items():
            row[f"flop_floor_{name}_ms"] = flop / (value * 1e9) * 1e3
        if "ggml_baseline_ms" in row:
            row["ours_over_ggml_baseline"] = row["ours_ms"] / row["ggml_baseline_ms"]
        if "lavapipe_ms" in row:
            row["lavapipe_over_ggml"] = row["lavapipe_ms"] / row["ggml_ms"] if "ggml_ms" in row else None
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    info = {"machine": machine(), "cpu_isa": native_ggml.isa(), "avx512_fp16": native_ggml.has_avx512_fp16(),
            "arch": "cpu", "config": base.source, "repeats": args.repeats, "rounds": args.rounds, "sides": sides,
            "ggml_builds": named, "fma_peaks_gflop_s": peaks, "fma_peak_runs": peak_runs, "floor_peak": full,
            "fma_peak_gflop_s": peaks[full],
            "timing": "wall time per call; each (case, side) alone in its own process, sides in turns; "
                      "medians of the processes' medians"}
    peaks_text = ", ".join(f"{k} {v:.0f}" for k, v in peaks.items())
    title = (f"{base.name} on cpu: wall per call, medians of {args.rounds} processes x {args.repeats} calls, each side "
             f"alone ({info['machine'].get('cpu', '')}, {native_ggml.isa_summary()}; FMA peaks GFLOP/s: {peaks_text})")
    return report(rows, info, args, argv, title, named)


COLUMNS = [("what", "what"), ("depth", "depth"), ("ours_ms", "ours ms"), ("ggml_ms", "ggml native ms"),
           ("ours_over_ggml", "ours/native"), ("ggml_baseline_ms", "ggml AVX2 ms"),
           ("ours_over_ggml_baseline", "ours/AVX2"), ("lavapipe_ms", "lavapipe ms"), ("ours_gflop_s", "ours GFLOP/s"),
           ("flop_floor_ms", "floor ms (full width)"), ("flop_floor_c256_ms", "floor ms (256-bit)"),
           ("flop_floor_taichi_ms", "floor ms (Taichi peak)"), ("ours_over_floor", "ours/floor")]


def report(rows: list[dict], info: dict, args, argv, title: str, named: dict) -> int:
    """Print the table (every ggml build named under it) and write the JSON (rows, machine, the command)."""
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    info = {**info, "command": "muser-bench " + " ".join(argv if argv is not None else sys.argv[1:]), "rows": rows}
    t = Table(title=title, caption="; ".join(f"{k}: {v}" for k, v in named.items()) or None)
    cols = [c for c in COLUMNS if any(c[0] in r for r in rows)]
    for _, name in cols:
        t.add_column(name, justify="right")
    for r in rows:
        t.add_row(*[(f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r.get(k, ""))) for k, _ in cols])
    Console(width=None if sys.stdout.isatty() else 240).print(t)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(info, indent=2))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="one side of one CPU bench case (muser-bench runs these)")
    ap.add_argument("--side", choices=SIDES, required=True)
    ap.add_argument("--case", required=True)
    ap.add_argument("--config", default="glimmer.yaml")
    ap.add_argument("--repeats", type=int, default=7)
    return run_side(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
