"""Benchmarks: the project's own routes against peers measured the same way.

    muser-bench --arch cpu                      # layers at 2,048/32,768/131,072 keys, steps at 2,048/32,768
    muser-bench --arch cpu --json out/bench.json   # (or: python scripts/bench.py ...)
    muser-bench --arch cuda --mode layers       # one layer's GPU busy time: ours, torch SDPA, llama.cpp's CUDA kernel
    muser-bench --arch cuda --mode steps        # the whole step's wall time per token

CPU (bench_cpu.py): one layer per route and Glimmer's whole step, ours against ggml's flash_attn_ext (the
pinned library, the step's layers one graph), each side alone in a process of its own, in turns, wall time
per call, and the floor at this CPU's measured FMA peak.  GPU (bench_gpu.py): CUPTI busy time for layers,
wall time per token for steps.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import muser_ti as mt

from . import ArgumentParser, Interrupted, guarded, need, positive_int, positive_int_list
from .bench_common import ROUTE_KIND


def route_list(text: str) -> list[str]:
    """An argparse type: comma-separated routes a layer bench times (its own routes, one per layer class)."""
    routes = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in routes if r not in ROUTE_KIND]
    if not routes or bad:
        raise argparse.ArgumentTypeError(f"expected routes among {', '.join(ROUTE_KIND)}, got {text!r}")
    return routes


def parser() -> ArgumentParser:
    ap = ArgumentParser(prog="muser-bench", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="glimmer.yaml", help="geometry YAML (a bare name resolves to configs/)")
    ap.add_argument("--arch", default="cpu", choices=["cpu", "cuda", "vulkan"], help="the backend to measure on")
    ap.add_argument("--layer-depths", type=positive_int_list, default="2048,32768,131072",
                    help="keys a layer attends, comma-separated")
    ap.add_argument("--step-depths", type=positive_int_list, default="2048,32768",
                    help="keys a whole step attends, comma-separated")
    ap.add_argument("--routes", type=route_list, default="splitk,interleaved", help="routes the layer cases time")
    ap.add_argument("--repeats", type=positive_int, default=7, help="timed calls per process (after two untimed ones)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="CPU: processes per (case, side), the sides in turns")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random Q, K and V")
    ap.add_argument("--json", default=None,
                    help="write the rows and the machine description to this file (default: none, the table only)")
    ap.add_argument("--mode", default="layers", choices=["layers", "steps"],
                    help="GPU archs: one layer's GPU busy time, or the whole step's wall time per token")
    return ap


@guarded()
def main(argv=None) -> int:
    args = parser().parse_args(argv)

    base = mt.load_config(args.config)
    need("rich", "muser-bench", "its tables")
    try:
        if args.arch in ("cuda", "vulkan"):
            from .bench_gpu import gpu_main

            return gpu_main(args, base, np.random.default_rng(args.seed), argv)
        from .bench_cpu import cpu_main

        return cpu_main(args, base, argv)
    except KeyboardInterrupt:
        raise Interrupted("interrupted; the rows measured so far are printed above, one JSON line each "
                          "(--json writes its file only at the end)") from None


if __name__ == "__main__":
    sys.exit(main())
