"""The host's cost of attention one layer at a time (Engine.token) against the all-layers step (Engine.step).

A model's forward calls the engine once per layer; step() takes every layer's q at once and runs each route's
layers in one launch sequence.  Both do the same device work per token (token() sizes each layer's split as
step() sizes its launch over the route's layers), so the difference per token, divided by the layer count,
is what the per-layer call costs the host: its Python, its checks and its launches.

Timed the same way on both sides: wall time per token, the two alternating token by token in one engine pair
fed the same tokens, medians over ``tokens`` tokens after a warm-up.  Run it with the other core idle:

    python -m muser_ti.bench.per_layer --config glimmer.yaml --arch cpu --depth 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def measure(cfg, arch: str, depth: int, tokens: int, seed: int = 0) -> dict:
    """Median seconds per token of step() and of token() by layer, at ``depth`` keys, alternating."""
    import muser_ti as mt

    stepper, layered = mt.Engine(cfg, arch=arch), mt.Engine(cfg, arch=arch)
    rng = np.random.default_rng(seed)
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    chunk = 1024
    for start in range(0, depth, chunk):  # the prefill in chunks: a deep one would hold GBs of float32 at once
        n = min(chunk, depth - start)
        k = rng.standard_normal((n, L, KV, D)).astype(np.float32)
        v = rng.standard_normal((n, L, KV, D)).astype(np.float32)
        stepper.prefill(k, v)
        layered.prefill(k, v)
    times = {"step": [], "token": []}
    warmup = 3
    for i in range(tokens + warmup):
        q = rng.standard_normal((L, H, D)).astype(np.float32)
        k = rng.standard_normal((L, KV, D)).astype(np.float32)
        v = rng.standard_normal((L, KV, D)).astype(np.float32)
        order = ("step", "token") if i % 2 else ("token", "step")
        for side in order:
            t0 = time.perf_counter()
            if side == "step":
                stepper.step(q, k, v)
            else:
                with layered.token() as t:
                    for layer in range(L):
                        t.attend(layer, q[layer], k[layer], v[layer])
            if i >= warmup:
                times[side].append(time.perf_counter() - t0)
    step, token = statistics.median(times["step"]), statistics.median(times["token"])
    return {"arch": stepper.arch, "depth": depth, "layers": L, "tokens": tokens, "step_ms": step * 1e3,
            "token_by_layer_ms": token * 1e3, "overhead_us_per_layer": (token - step) / L * 1e6,
            "routes": dict(layered.route_counts)}


def main(argv=None) -> int:
    from muser_ti.bench.timing import machine
    from muser_ti.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="glimmer.yaml")
    ap.add_argument("--arch", default="cpu")
    ap.add_argument("--depth", type=int, action="append", help="keys already in the cache (repeatable; default 64, 2048)")
    ap.add_argument("--tokens", type=int, default=30)
    ap.add_argument("--json", action="store_true", help="only JSON on stdout")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    rows = [measure(cfg, args.arch, depth, args.tokens) for depth in (args.depth or [64, 2048])]
    if args.json:
        json.dump({"machine": machine(), "rows": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(f"{cfg.name} on {rows[0]['arch']}, {rows[0]['layers']} layers, medians of {args.tokens} tokens, alternating")
    print(f"{'keys':>7} {'step (ms)':>10} {'by layer (ms)':>14} {'host cost per layer (us)':>25}")
    for r in rows:
        print(f"{r['depth']:>7,} {r['step_ms']:>10.2f} {r['token_by_layer_ms']:>14.2f} {r['overhead_us_per_layer']:>25.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
