"""The host's cost of attention one layer at a time (Engine.token) against the all-layers step (Engine.step).

A model's forward calls the engine once per layer; step() takes every layer's q at once and runs each route's
layers in one launch sequence.  Both do the same device work per token (token() sizes each layer's split as
step() sizes its launch over the route's layers), so the difference per token, divided by the layer count,
is what the per-layer call costs the host: its Python, its checks and its launches.  The per-layer call is
timed on each launch path (``--launch``: Taichi's C-API, layer_launch.py, and Taichi's Python launch path).

Timed the same way on every side: wall time per token, the sides in turn token by token in engines fed the
same tokens (the arrays a model hands: numpy on the CPU, torch CUDA tensors on CUDA), medians over ``tokens``
tokens after a warm-up.  Run it with the other core idle:

    python -m muser_ti.bench.per_layer --config glimmer.yaml --arch cpu --depth 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

LAUNCH_SIDES = ("capi", "python")


def measure(cfg, arch: str, depth: int, tokens: int, launches=LAUNCH_SIDES, seed: int = 0) -> dict:
    """Median seconds per token of step() and of token() by layer on each launch path, at ``depth`` keys."""
    import muser_ti as mt

    stepper = mt.Engine(cfg, arch=arch)
    layered = {path: mt.Engine(cfg, arch=arch, launch=path) for path in launches}
    engines = [stepper, *layered.values()]
    rng = np.random.default_rng(seed)
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    chunk = 1024
    for start in range(0, depth, chunk):  # the prefill in chunks: a deep one would hold GBs of float32 at once
        n = min(chunk, depth - start)
        k = rng.standard_normal((n, L, KV, D)).astype(np.float32)
        v = rng.standard_normal((n, L, KV, D)).astype(np.float32)
        for eng in engines:
            eng.prefill(k, v)
    torch = None
    if arch == "cuda":
        import torch
    sides = ["step", *layered]
    times = {side: [] for side in sides}
    warmup = 3
    for i in range(tokens + warmup):
        q = rng.standard_normal((L, H, D)).astype(np.float32)
        k = rng.standard_normal((L, KV, D)).astype(np.float32)
        v = rng.standard_normal((L, KV, D)).astype(np.float32)
        if torch is not None:  # what a model on the GPU hands the engine: CUDA tensors, read in place
            layer_arrays = [torch.from_numpy(a).cuda() for a in (q, k, v)]
            torch.cuda.synchronize()
        else:
            layer_arrays = (q, k, v)
        order = sides if i % 2 else sides[::-1]
        for side in order:
            t0 = time.perf_counter()
            if side == "step":
                stepper.step(q, k, v)
            else:
                lq, lk, lv = layer_arrays
                with layered[side].token() as t:
                    for layer in range(L):
                        t.attend(layer, lq[layer], lk[layer], lv[layer])
                if torch is not None:
                    torch.cuda.synchronize()
            if i >= warmup:
                times[side].append(time.perf_counter() - t0)
    ms = {side: statistics.median(t) * 1e3 for side, t in times.items()}
    row = {"arch": stepper.arch, "depth": depth, "layers": L, "tokens": tokens, "step_ms": ms["step"],
           "routes": dict(stepper.route_counts)}
    for path, eng in layered.items():
        row[f"token_{path}_ms"] = ms[path]
        row[f"overhead_{path}_us_per_layer"] = (ms[path] - ms["step"]) / L * 1e3
        row[f"{path}_path"] = "compiled" if eng.launcher.compiled_layers() is not None else "python"
    return row


def main(argv=None) -> int:
    from muser_ti.bench.timing import machine
    from muser_ti.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="glimmer.yaml")
    ap.add_argument("--arch", default="cpu")
    ap.add_argument("--depth", type=int, action="append", help="keys already in the cache (repeatable; default 64, 2048)")
    ap.add_argument("--tokens", type=int, default=30)
    ap.add_argument("--launch", default=",".join(LAUNCH_SIDES), help="the per-layer launch paths to time, comma-separated")
    ap.add_argument("--json", action="store_true", help="only JSON on stdout")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    launches = [p for p in args.launch.split(",") if p]
    rows = [measure(cfg, args.arch, depth, args.tokens, launches) for depth in (args.depth or [64, 2048])]
    if args.json:
        json.dump({"machine": machine(), "rows": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(f"{cfg.name} on {rows[0]['arch']}, {rows[0]['layers']} layers, medians of {args.tokens} tokens, alternating")
    head = "".join(f" {'by layer, ' + p + ' (ms)':>22} {'host cost a layer (us)':>23}" for p in launches)
    print(f"{'keys':>7} {'step (ms)':>10}{head}")
    for r in rows:
        cells = "".join(f" {r[f'token_{p}_ms']:>22.2f} {r[f'overhead_{p}_us_per_layer']:>23.1f}" for p in launches)
        print(f"{r['depth']:>7,} {r['step_ms']:>10.2f}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
