"""Main job: a decode session on seeded synthetic Q/K/V through the route ladder.

    muser-decode --config glimmer.yaml            # bare names resolve to configs/ (or: python scripts/decode.py)
    muser-decode --config glimmer.yaml --check    # compare every step with the float64 reference
    muser-decode --config glimmer.yaml --json     # the summary as JSON, alone on stdout

The default session prefills 2,040 tokens and decodes 24 more, so Glimmer's 2,048-token SWA rings
fill and wrap mid-run.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

import muser_ti as mt
from muser_ti import backend, ladder
from muser_ti.bandwidth import attention_flop
from muser_ti.bench import fma_peak
from muser_ti.cli import (ArgumentParser, CommandError, Interrupted, guarded, kernel_cache, need, nonnegative_int,
                          positive_int, progress_bars, stdout_for_data)
from muser_ti.config import CONFIG_DIR
from muser_ti.engine import PINNED_MODES
from muser_ti.interrupts import held_back
from muser_ti.reference import relative_error

# What a cold compile of the main job took, measured with empty kernel caches (scripts/lab/readme_times.sh) on an
# idle 2-core AMD EPYC VM (Zen 4): the first step 64 s on the CPU (68 s in all), 89 s on lavapipe (162 s in all);
# earlier 64 s on a 2-core Intel Xeon VM shared with a test run
COLD_COMPILE = "Glimmer's took 64 s on a 2-core VM's CPU, 89 s on lavapipe"


def parser() -> ArgumentParser:
    ap = ArgumentParser(prog="muser-decode", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="glimmer.yaml", help="geometry YAML (a bare name resolves to configs/)")
    ap.add_argument("--tokens", type=positive_int, default=24, help="tokens to decode, >= 1")
    ap.add_argument("--start-depth", type=nonnegative_int, default=2040, help="tokens to prefill before decoding, >= 0")
    ap.add_argument("--arch", default="auto", choices=list(backend.ARCHS),
                    help="the Taichi backend: auto takes Metal, then CUDA, then a hardware Vulkan device, else the CPU")
    ap.add_argument("--pinned", default="auto", choices=list(PINNED_MODES),
                    help="llama.cpp's pinned kernel: auto leaves it off (its bound fails on some accepted input), on "
                         "takes it where its predicates hold and it is loaded, off never")
    ap.add_argument("--route", default=None, choices=list(ladder.ROUTES),
                    help="force a route on the layers of its class (default: the ladder chooses)")
    ap.add_argument("--capacity", type=positive_int, default=None,
                    help="every plane's capacity in rows, for this session (default: each plane's own: a ring holds "
                         "the window plus swa_ring_slack, a NoPE plane grows to max_context)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic Q, K and V")
    ap.add_argument("--check", action="store_true", help="compare every step with the float64 reference")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON only, alone on stdout")
    ap.add_argument("--explain", action="store_true",
                    help="print the config's bandwidth arithmetic (chapter 16.7: KV bytes vs the weight stream by depth) "
                         "and exit")
    return ap


def parse_args(argv=None):
    return parser().parse_args(argv)


def synthetic(rng, shape):
    return rng.standard_normal(shape, dtype=np.float32)


def capacity_needed(cfg: mt.Geometry, end: int) -> tuple[int, str]:
    """The least --capacity a session that ends at position ``end`` runs with, and why.  The option sets every
    plane's capacity, so the class that needs the most rows decides: a ring holds the rows its window sees at the
    last token, the current one included (min(end, window)); a NoPE plane holds every token (end)."""
    needs = []
    if cfg.nope_layers:
        needs.append((end, f"its NoPE planes keep all {end} of its tokens"))
    if cfg.swa_layers:
        rows = min(end, cfg.window)
        seen = (f"the last {rows} (its window)" if rows == cfg.window else
                f"all {rows} of its tokens (the session is shorter than the window of {cfg.window})")
        needs.append((rows, f"its SWA rings keep {seen}"))
    return max(rows for rows, _ in needs), " and ".join(why for _, why in needs)


def check_session(cfg: mt.Geometry, args) -> None:
    """Refuse, before anything runs, a session its geometry or --capacity cannot hold, naming the real limit
    (the planes' own check fires mid-prefill, at the chunk that first passes it)."""
    end = args.start_depth + args.tokens  # the position after the last decoded token
    if end > cfg.max_context:
        raise CommandError(f"--start-depth + --tokens = {end} passes {cfg.name}'s max_context of {cfg.max_context}")
    if args.capacity is None:
        return
    rows, why = capacity_needed(cfg, end)
    if args.capacity < rows:
        raise CommandError(f"--capacity {args.capacity}: it sets every plane's capacity, and this session "
                           f"({args.start_depth} prefilled + {args.tokens} decoded, {cfg.name}) needs {rows} rows: {why}; "
                           f"give --capacity >= {rows}, or leave it out")


def ring_wrap(capacity: int, start_depth: int, tokens: int) -> dict:
    """Where a ring of ``capacity`` rows first wrapped: the position whose row first overwrote an older one
    (the ring fills positions 0 .. capacity-1, so that is position ``capacity``), in which phase, and at which
    decoded token; the same three keys every time, null where they do not apply (--json's readers index them)."""
    if start_depth + tokens <= capacity:
        return {"wrapped_at_position": None, "wrapped_during": None, "wrapped_at_token": None}
    if capacity < start_depth:
        return {"wrapped_at_position": capacity, "wrapped_during": "prefill", "wrapped_at_token": None}
    return {"wrapped_at_position": capacity, "wrapped_during": "decode", "wrapped_at_token": capacity - start_depth + 1}


def config_shown(source: str) -> str:
    """The config as a user named it: a bare name for the shipped configs, else relative to here if inside."""
    path = Path(source).resolve()
    for base in (CONFIG_DIR.resolve(), Path.cwd().resolve()):
        if base != Path("/") and path.is_relative_to(base):
            return path.relative_to(base).as_posix()
    return source


def paths_shown(text: str) -> str:
    """``text`` with the paths under this folder made relative and the rest of the home folder as ``~``: the
    output names files as the user sees them from here, not one machine's layout."""
    for base, shown in ((Path.cwd().resolve(), ""), (Path.home().resolve(), "~/")):
        if str(base) != "/":
            text = text.replace(str(base) + "/", shown)
    return text


def check_route(route: str | None, pinned: str, eng: mt.Engine) -> None:
    """A forced vec route runs llama.cpp's pinned kernel, which only --pinned on puts in use (where the library
    loads): say so before anything runs, naming the option, not as the ladder's predicate failing at the first
    token."""
    if route not in ladder.PINNED_ROUTES or eng.pinned_loaded or ladder.strict_attention():
        return
    here, why = mt.pinned_library_status(eng.arch)
    if here:
        fix = "--pinned on puts it in use"
    elif eng.arch != "cpu" and mt.pinned_library_status("cpu")[0]:
        fix = f"it runs on the CPU only, so --arch cpu --pinned on ({why})"
    else:
        fix = f"the pinned library is unavailable here: {why}"
    raise CommandError(f"--route {route} forces llama.cpp's pinned kernel, which this session leaves out of use "
                       f"(--pinned {pinned}); {fix}")


def compile_notice(cfg: mt.Geometry) -> str:
    """The line a run whose kernels are not in Taichi's cache prints first (kernel_cache.Watch decides)."""
    return (f"compiling kernels (the first run of {cfg.name} with these options; {COLD_COMPILE}; Taichi keeps "
            f"them in {kernel_cache.shown_folder()})")


def run(args) -> dict:
    cfg = mt.load_config(args.config)
    check_session(cfg, args)
    need("rich", "muser-decode", "its progress bars and tables")
    eng = mt.Engine(cfg, arch=args.arch, pinned=args.pinned, force=args.route, capacity=args.capacity)
    check_route(args.route, args.pinned, eng)
    cache = kernel_cache.Watch(kernel_cache.session_key(cfg, eng.arch, pinned=args.pinned, route=args.route,
                                                        capacity=args.capacity, graph=eng.graph))
    if cache.cold:  # before the prefill: its store kernels are the first to compile
        print(compile_notice(cfg), file=sys.stderr, flush=True)
    summary = decode(eng, cfg, args)
    del eng  # the engine is done: Taichi's program can end, writing what it compiled into its cache
    summary["first_step_compiled"] = cache.finish()
    add_floor(summary, cfg)
    return summary


def decode(eng: mt.Engine, cfg: mt.Geometry, args) -> dict:
    """Prefill and decode the session with progress bars; the summary of what the engine did."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

    rng = np.random.default_rng(args.seed)
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    step_seconds, kv_bytes, errors = [], [], []
    per_class = {"swa": Counter(), "nope": Counter()}
    done = 0
    try:
        with progress_bars(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                           disable=args.json) as progress:
            chunk = 256
            task = progress.add_task("prefill", total=args.start_depth)
            while done < args.start_depth:  # prefill in chunks: bounded host memory at any depth
                n = min(chunk, args.start_depth - done)
                with held_back():  # Ctrl-C lands after the chunk
                    eng.prefill(synthetic(rng, (n, L, KV, D)), synthetic(rng, (n, L, KV, D)))
                    done += n
                progress.update(task, advance=n)
            task = progress.add_task("decode" + (" + check" if args.check else ""), total=args.tokens)
            for _ in range(args.tokens):
                q, k, v = synthetic(rng, (L, H, D)), synthetic(rng, (L, KV, D)), synthetic(rng, (L, KV, D))
                with held_back():  # Ctrl-C lands after the token
                    t0 = time.perf_counter()
                    out = eng.step(q, k, v)
                    step_seconds.append(time.perf_counter() - t0)
                kv_bytes.append(eng.kv_bytes_last_step())
                for layer, route in enumerate(eng.routes):
                    per_class[cfg.layer_kinds[layer]][route] += 1
                if args.check:
                    errors.append(relative_error(out, eng.reference(q, k, v)))
                progress.update(task, advance=1)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted after {len(step_seconds)} of {args.tokens} decoded tokens "
                          f"({done} of {args.start_depth} prefilled; the engine stopped at position {eng.position}, "
                          f"its last token whole)") from None

    # the first step includes building its kernels (compiling them, or loading them from Taichi's cache): apart
    steady = step_seconds[1:] or step_seconds
    median = statistics.median(steady)
    swa = eng.planes.get("swa")
    return {
        "config": config_shown(cfg.source),
        "model": cfg.name,
        "arch": eng.arch,
        "pinned_loaded": eng.pinned_loaded,
        "pinned": paths_shown(eng.pinned_description),
        "graph": eng.graph,
        "start_depth": args.start_depth,
        "tokens": args.tokens,
        "final_position": eng.position,
        "swa_ring": None if swa is None else vars(swa.state) | ring_wrap(swa.state.capacity, args.start_depth, args.tokens),
        "routes_per_class": {kind: dict(c) for kind, c in per_class.items() if c},
        "launches_per_token": eng.launches_last_step,
        "first_step_s": step_seconds[0],
        "first_step_compiled": None,  # Watch.finish says, once the engine is done
        "median_step_s": median,
        "tokens_per_s": 1.0 / median,
        "kv_bytes_per_token": int(statistics.mean(kv_bytes)),
        "kv_gb_per_s": statistics.mean(kv_bytes) / median / 1e9,
        "flop_per_token": attention_flop(cfg, statistics.mean(kv_bytes) / cfg.kv_bytes_per_row),
        "max_rel_error": max(errors) if args.check else None,
        "rel_error_bound": mt.tolerances.F32_ROUTE_RTOL if args.check else None,
    }


def add_floor(summary: dict, cfg: mt.Geometry) -> None:
    """The FLOP floor: the token's attention at the CPU's f32 FMA peak (muser_ti.bench.fma_peak.floor_peak: C at the
    full vector width where a compiler is here, measured once per machine and kept), on the CPU only; the keys
    are there, null, elsewhere (a --json reader finds the same keys on every run)."""
    floor = dict.fromkeys(("fma_peak_gflop_s", "fma_peak_by", "flop_floor_s", "share_of_floor"))
    if summary["arch"] == "cpu":
        peak, floor["fma_peak_by"] = fma_peak.floor_peak()
        floor["fma_peak_gflop_s"] = peak
        floor["flop_floor_s"] = summary["flop_per_token"] / (peak * 1e9)
        floor["share_of_floor"] = floor["flop_floor_s"] / summary["median_step_s"]
    summary.update(floor)


def first_step_words(compiled: bool | None) -> str:
    """What the first step's time holds besides the step: a compile only where this run compiled."""
    if compiled is None:
        return ""
    return ", incl. compiling its kernels" if compiled else ", its kernels loaded from Taichi's cache"


def print_summary(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"[bold]{s['model']}[/] ({s['config']}) on [bold]{s['arch']}[/], graph {s['graph']}")
    # "in use", not "loaded": the library can be loaded and still left out (pinned='auto', or planes off the CPU)
    con.print(f"pinned llama library: {'in use: ' if s['pinned_loaded'] else 'not in use: '}{s['pinned']}")
    if s["swa_ring"]:
        r = s["swa_ring"]
        if r["wrapped_during"] == "prefill":
            wrap = f"first wrapped at position {r['wrapped_at_position']}, during the prefill"
        elif r["wrapped_during"] == "decode":
            wrap = (f"wrapped at position {r['wrapped_at_position']}, at decoded token {r['wrapped_at_token']} "
                    f"of {s['tokens']}")
        else:
            wrap = "not wrapped"
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
              f"first step {s['first_step_s'] * 1e3:.0f} ms{first_step_words(s.get('first_step_compiled'))}), "
              f"{s['launches_per_token']} kernel launches/token")
    con.print(f"KV read per token: {s['kv_bytes_per_token'] / 1e6:.2f} MB ({s['kv_gb_per_s']:.2f} GB/s achieved)")
    if s.get("flop_floor_s") is not None:
        con.print(f"FLOP floor per token: {s['flop_floor_s'] * 1e3:.2f} ms ({s['flop_per_token'] / 1e9:.2f} GFLOP at this "
                  f"CPU's measured f32 peak, {s['fma_peak_gflop_s']:.0f} GFLOP/s: {s['fma_peak_by']}): the step runs at "
                  f"{s['share_of_floor']:.0%} of it")
    if s.get("max_rel_error") is not None:
        ok = s["max_rel_error"] <= s["rel_error_bound"]
        con.print(f"max relative error vs float64 reference: {s['max_rel_error']:.3e} "
                  f"({'within' if ok else 'OVER'} the bound {s['rel_error_bound']:.0e})")


@guarded()
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.explain:  # pure arithmetic on the geometry: no engine, no backend
        from muser_ti.bandwidth import explain
        from muser_ti.kernels.producer import describe_plans

        cfg = mt.load_config(args.config)
        print("\n".join(explain(cfg) + [""] + describe_plans(cfg.heads_per_kv, cfg.head_dim)))
        return 0
    with stdout_for_data(args.json) as out:  # --json: only the JSON reaches stdout (Taichi logs to stderr)
        summary = run(args)
        if args.json:
            print(json.dumps(summary, indent=2), file=out)
        else:
            print_summary(summary)
    if args.check and summary["max_rel_error"] > summary["rel_error_bound"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
