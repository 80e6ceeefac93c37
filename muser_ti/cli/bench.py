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

from .bench_common import int_list


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="glimmer.yaml")
    ap.add_argument("--arch", default="cpu")
    ap.add_argument("--layer-depths", default="2048,32768,131072")
    ap.add_argument("--step-depths", default="2048,32768")
    ap.add_argument("--routes", default="splitk,interleaved")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per process (after two untimed ones)")
    ap.add_argument("--rounds", type=int, default=3, help="CPU: processes per (case, side), the sides in turns")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows and the machine description here")
    ap.add_argument("--mode", default="layers", choices=["layers", "steps"],
                    help="GPU archs: one layer's GPU busy time, or the whole step's wall time per token")
    args = ap.parse_args(argv)

    base = mt.load_config(args.config)
    if args.arch in ("cuda", "vulkan"):
        from .bench_gpu import gpu_main

        return gpu_main(args, base, np.random.default_rng(args.seed), argv)
    if args.arch != "cpu":
        raise SystemExit(f"muser-bench: --arch {args.arch} is not benchmarked here (cpu, cuda, vulkan)")
    from .bench_cpu import cpu_main

    args.layer_depths, args.step_depths = int_list(args.layer_depths), int_list(args.step_depths)
    args.routes = [r for r in args.routes.split(",") if r]
    return cpu_main(args, base, argv)


if __name__ == "__main__":
    sys.exit(main())
