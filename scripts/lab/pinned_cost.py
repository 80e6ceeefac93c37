#!/usr/bin/env python3
"""One process's median wall time of a 52-layer CPU step at one depth, with the pinned rung on or off; appends a
JSON line to --out.  Run each side in its own process, alternating, with the other core idle (docs/lab/runs.md,
run 36):

    python scripts/lab/pinned_cost.py --pinned on --depth 33 --out rows.jsonl
    OMP_WAIT_POLICY=PASSIVE python scripts/lab/pinned_cost.py --pinned on --depth 33 --out rows.jsonl

Every timed step attends exactly the depth: the engine is prefilled to depth - 1 and rewound before each step.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

import muser_ti as mt
from muser_ti.cli.bench_common import prefill, timed_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pinned", choices=("on", "off"), required=True)
    ap.add_argument("--depth", type=int, default=33)
    ap.add_argument("--config", default="glimmer.yaml")
    ap.add_argument("--steps", type=int, default=60, help="timed steps, after 5 untimed")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    cfg = mt.load_config(args.config)
    rng = np.random.default_rng(0)
    eng = mt.Engine(cfg, arch="cpu", pinned=args.pinned)
    prefill(eng, args.depth - 1, rng)
    seconds, _ = timed_step(eng, rng, args.steps, warmup=5)
    row = {"pinned": args.pinned, "depth": args.depth, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
           "median_ms": seconds * 1e3, "routes": dict(eng.route_counts)}
    with args.out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
