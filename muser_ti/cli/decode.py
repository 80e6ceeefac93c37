"""Main job: a decode session on seeded synthetic Q/K/V through the route ladder.

    muser-decode --config glimmer.yaml            # bare names resolve to configs/ (or: python scripts/decode.py)
    muser-decode --config glimmer.yaml --check    # compare every step with the float64 reference
    muser-decode --config glimmer.yaml --json     # the summary as JSON, alone on stdout

The default session prefills 2,040 tokens and decodes 24 more, so Glimmer's 2,048-token SWA rings
fill and wrap mid-run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter

import numpy as np

import muser_ti as mt
from muser_ti import ladder
from muser_ti.bench import fma_peak
from muser_ti.bandwidth import attention_flop
from muser_ti.cli import stdout_for_data
from muser_ti.reference import relative_error


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="glimmer.yaml", help="geometry YAML (a bare name resolves to configs/)")
    ap.add_argument("--tokens", type=int, default=24, help="tokens to decode (default 24)")
    ap.add_argument("--start-depth", type=int, default=2040, help="tokens to prefill before decoding (default 2040)")
    ap.add_argument("--arch", default="auto", choices=["auto", "cpu", "cuda", "vulkan", "metal"])
    ap.add_argument("--pinned", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--route", default=None, choices=list(ladder.ROUTES), help="force a route on the layers of its class")
    ap.add_argument("--capacity", type=int, default=None, help="per-session plane capacity override")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="compare every step with the float64 reference")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON only")
    ap.add_argument("--explain", action="store_true",
                    help="print the config's bandwidth arithmetic (chapter 16.7: KV bytes vs the weight stream by depth) and exit")
    return ap.parse_args(argv)


def synthetic(rng, shape):
    return rng.standard_normal(shape, dtype=np.float32)


def run(args) -> dict:
    cfg = mt.load_config(args.config)
    if args.start_depth < 0 or args.tokens < 1:
        raise SystemExit("--start-depth must be >= 0 and --tokens >= 1")
    if args.start_depth + args.tokens > cfg.max_context:
        raise SystemExit(f"--start-depth + --tokens = {args.start_depth + args.tokens} passes max_context={cfg.max_context}")
    eng = mt.Engine(cfg, arch=args.arch, pinned=args.pinned, force=args.route, capacity=args.capacity)
    rng = np.random.default_rng(args.seed)
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    quiet = args.json
    step_seconds, kv_bytes, errors = [], [], []
    per_class = {"swa": Counter(), "nope": Counter()}
    wrapped_at = None
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  disable=quiet, transient=False) as progress:
        chunk = 256
        task = progress.add_task("prefill", total=args.start_depth)
        done = 0
        while done < args.start_depth:  # prefill in chunks: bounded host memory at any depth
            n = min(chunk, args.start_depth - done)
            eng.prefill(synthetic(rng, (n, L, KV, D)), synthetic(rng, (n, L, KV, D)))
            done += n
            progress.update(task, advance=n)
        task = progress.add_task("decode" + (" + check" if args.check else ""), total=args.tokens)
        for _ in range(args.tokens):
            q, k, v = synthetic(rng, (L, H, D)), synthetic(rng, (L, KV, D)), synthetic(rng, (L, KV, D))
            t0 = time.perf_counter()
            out = eng.step(q, k, v)
            step_seconds.append(time.perf_counter() - t0)
            kv_bytes.append(eng.kv_bytes_last_step())
            for layer, route in enumerate(eng.routes):
                per_class[cfg.layer_kinds[layer]][route] += 1
            swa = eng.planes.get("swa")
            if wrapped_at is None and swa is not None and swa.state.origin_physical != 0:
                wrapped_at = eng.position - 1
            if args.check:
                errors.append(relative_error(out, eng.reference(q, k, v)))
            progress.update(task, advance=1)

    # the first step includes kernel compilation (or loading it from Taichi's cache): report it apart
    steady = step_seconds[1:] or step_seconds
    median = statistics.median(steady)
    summary = {
        "config": cfg.source,
        "model": cfg.name,
        "arch": eng.arch,
        "pinned_loaded": eng.pinned_loaded,
        "pinned": eng.pinned_description,
        "graph": eng.graph,
        "start_depth": args.start_depth,
        "tokens": args.tokens,
        "final_position": eng.position,
        "swa_ring": None if "swa" not in eng.planes else vars(eng.planes["swa"].state) | {"wrapped_at_position": wrapped_at},
        "routes_per_class": {kind: dict(c) for kind, c in per_class.items() if c},
        "launches_per_token": eng.launches_last_step,
        "first_step_s": step_seconds[0],
        "median_step_s": median,
        "tokens_per_s": 1.0 / median,
        "kv_bytes_per_token": int(statistics.mean(kv_bytes)),
        "kv_gb_per_s": statistics.mean(kv_bytes) / median / 1e9,
    }
    # the FLOP floor: this token's attention at the CPU's f32 FMA peak, measured by a kernel of our own in a
    # process of its own (muser_ti.bench.fma_peak), now that the engine is idle
    rows = statistics.mean(kv_bytes) / cfg.kv_bytes_per_row
    summary["flop_per_token"] = attention_flop(cfg, rows)
    if eng.arch == "cpu":
        peak = fma_peak.probe()["gflop_s"]
        summary["fma_peak_gflop_s"] = peak
        summary["flop_floor_s"] = summary["flop_per_token"] / (peak * 1e9)
        summary["share_of_floor"] = summary["flop_floor_s"] / median
    if args.check:
        summary["max_rel_error"] = max(errors)
        summary["rel_error_bound"] = mt.tolerances.F32_ROUTE_RTOL
    return summary


def print_summary(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"[bold]{s['model']}[/] ({s['config']}) on [bold]{s['arch']}[/], graph {s['graph']}")
    con.print(f"pinned llama library: {'loaded: ' if s['pinned_loaded'] else 'not loaded: '}{s['pinned']}")
    if s["swa_ring"]:
        r = s["swa_ring"]
        wrap = f"wrapped at position {r['wrapped_at_position']}" if r["wrapped_at_position"] is not None else (
            "wrapped before decoding" if r["origin_physical"] else "not wrapped")
        con.print(f"SWA ring: len {r['len']} / capacity {r['capacity']}, origin (logical {r['origin_logical']}, "
                  f"physical {r['origin_physical']}), {wrap}")
    t = Table(title=f"routes taken over {s['tokens']} tokens (layer-steps)")
    t.add_column("layer class")
    for route in ladder.ROUTES:
        t.add_column(route, justify="right")
    for kind, counts in s["routes_per_class"].items():
        t.add_row(kind, *[str(counts.get(r, 0)) for r in ladder.ROUTES])
    con.print(t)
    con.print(f"attention stack: {s['tokens_per_s']:.2f} tokens/s (median step {s['median_step_s'] * 1e3:.2f} ms, "
              f"first step {s['first_step_s'] * 1e3:.0f} ms incl. compile), {s['launches_per_token']} kernel launches/token")
    con.print(f"KV read per token: {s['kv_bytes_per_token'] / 1e6:.2f} MB ({s['kv_gb_per_s']:.2f} GB/s achieved)")
    if "flop_floor_s" in s:
        con.print(f"FLOP floor per token: {s['flop_floor_s'] * 1e3:.2f} ms ({s['flop_per_token'] / 1e9:.2f} GFLOP at this "
                  f"CPU's measured FMA peak, {s['fma_peak_gflop_s']:.0f} GFLOP/s): the step runs at "
                  f"{s['share_of_floor']:.0%} of it")
    if "max_rel_error" in s:
        ok = s["max_rel_error"] <= s["rel_error_bound"]
        con.print(f"max relative error vs float64 reference: {s['max_rel_error']:.3e} "
                  f"({'within' if ok else 'OVER'} the bound {s['rel_error_bound']:.0e})")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.explain:  # pure arithmetic on the geometry: no engine, no backend
        from muser_ti.bandwidth import explain
        from muser_ti.kernels.producer import describe_plans

        try:
            cfg = mt.load_config(args.config)
            print("\n".join(explain(cfg) + [""] + describe_plans(cfg.heads_per_kv, cfg.head_dim)))
        except mt.ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    with stdout_for_data(args.json) as out:  # --json: only the JSON reaches stdout (Taichi logs to stderr)
        try:
            summary = run(args)
        except (mt.ConfigError, mt.EngineError, mt.RouteError, mt.PinnedUnavailable) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(summary, indent=2), file=out)
        else:
            print_summary(summary)
    if args.check and summary["max_rel_error"] > summary["rel_error_bound"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
