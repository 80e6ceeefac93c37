"""Where a launch path's host time goes: one engine's per-layer token and a batch's step, taken apart (the lab).

Each case is built, warmed, timed (wall per token, the device synchronised, medians), then run again under
cProfile with the C calls the launch paths make wrapped in Python functions of their own name, so the profile
shows what the C side costs beside the Python around it:

* ``ti_launch_kernel``  Taichi's C-API launch (layer_launch.CompiledLayers, batch_compiled.CompiledGroups, lanes);
* ``cu_event_record`` / ``cu_stream_wait``  the stream fence's two driver calls (CUDA).

Cases (``--case``, repeatable):

* ``engine:PATH``  an Engine over Glimmer's 52 layers at ``--depth`` keys, ``t = eng.token()``, ``t.attend(...)`` per
  layer on torch tensors (CUDA tensors on CUDA), ``t.commit()``: the open, the layers and the commit timed apart;
  PATH the launch path (capi, python);
* ``batch:PATH:B``  a Batch of B sequences over one group of Glimmer's layers (bench/batch_decode.py's), a step's
  open, its four layers and its commit timed apart.

    python scripts/lab/launch_parts.py --arch cuda --depth 2048 --case engine:capi --case batch:capi:32
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import time

import numpy as np


def _wrap_c_calls() -> int:
    """Wrap the C functions held by the live launch objects in Python functions (cProfile shows their time)."""
    from muser_ti import batch_compiled, layer_launch

    def named(fn, name):
        def call(*a):
            return fn(*a)
        call.__name__ = call.__qualname__ = name
        call.__wrapped_c__ = fn
        return call

    n = 0
    for obj in gc.get_objects():
        if type(obj) in (layer_launch.CompiledLayers, batch_compiled.CompiledGroups):
            if not hasattr(obj._launch, "__wrapped_c__"):
                obj._launch = named(obj._launch, "ti_launch_kernel")
                n += 1
        elif type(obj) is layer_launch._StreamFence:
            if not hasattr(obj._record, "__wrapped_c__"):
                obj._record = named(obj._record, "cu_event_record")
                obj._wait = named(obj._wait, "cu_stream_wait")
                n += 1
    return n


def _profile(run, n: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for i in range(n):
        run(i)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def _steps(open_token, L: int, arch: str, shapes, tokens: int, rng):
    """Time ``tokens`` steps of ``open_token()``'s token over L layers on fresh torch draws of ``shapes`` (q, k, v,
    each [L, ...]; CUDA tensors on CUDA): medians (ms) of the open, the layers' calls until they return ("issued"),
    the layers with the device synchronised, the commit, the whole step; and the step, for the profile."""
    import torch

    device = "cuda" if arch == "cuda" else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    draws = [tuple(torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to(device) for s in shapes)
             for _ in range(4)]
    parts = {"open": [], "issued": [], "layers": [], "commit": [], "step": []}

    def run(i, record=False):
        q, k, v = draws[i % len(draws)]
        t0 = time.perf_counter()
        t = open_token()
        t1 = time.perf_counter()
        for layer in range(L):
            t.attend(layer, q[layer], k[layer], v[layer])
        t_issued = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        t.commit()
        sync()
        t3 = time.perf_counter()
        if record:
            for name, dt in zip(parts, (t1 - t0, t_issued - t1, t2 - t1, t3 - t2, t3 - t0)):
                parts[name].append(dt)

    for i in range(3):
        run(i)
    for i in range(tokens):
        run(i, True)
    return {name: statistics.median(ts) * 1e3 for name, ts in parts.items()}, run


def engine_case(cfg, arch, depth, path, tokens, top, rng):
    import muser_ti as mt

    eng = mt.Engine(cfg, arch=arch, launch=path)
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    for start in range(0, depth, 1024):
        n = min(1024, depth - start)
        eng.prefill(rng.standard_normal((n, L, KV, D), dtype=np.float32),
                    rng.standard_normal((n, L, KV, D), dtype=np.float32))
    med, run = _steps(eng.token, L, arch, ((L, H, D), (L, KV, D), (L, KV, D)), tokens, rng)
    compiled = eng.launcher.compiled_layers() is not None
    head = (f"engine:{path} ({'C-API' if compiled else 'Python path'}) depth {depth}: {med['step']:.3f} ms a token, "
            f"{med['step'] / L * 1e3:.1f} us a layer, the layers' calls returned after {med['issued'] / L * 1e3:.1f} "
            f"us a layer (medians of {tokens}); the token's open {med['open']:.3f} ms, commit {med['commit']:.3f} "
            f"ms; routes {dict(eng.route_counts)}")
    _wrap_c_calls()
    return head, _profile(run, 5, top)


def batch_case(cfg, arch, depth, path, b, tokens, top, rng):
    from muser_ti.bench.batch_decode import _filled_batch, group_geometry

    g = group_geometry(cfg)
    bat = _filled_batch(g, arch, b, depth, depth + 64 + tokens, rng, path)
    L, H, KV, D = g.n_layers, g.n_heads, g.n_kv_heads, g.head_dim
    med, run = _steps(bat.token, L, arch, ((L, b, H, D), (L, b, KV, D), (L, b, KV, D)), tokens, rng)
    compiled = bat._launcher.compiled is not None
    head = (f"batch:{path}:{b} ({'C-API' if compiled else 'Python path'}) depth {depth}: open {med['open']:.3f} ms, "
            f"{L} layers {med['layers']:.3f} ms ({med['layers'] / L * 1e3:.1f} us a layer; the calls returned after "
            f"{med['issued'] / L * 1e3:.1f}), commit {med['commit']:.3f} ms (medians of {tokens})")
    _wrap_c_calls()
    return head, _profile(run, 5, top)


def main() -> None:
    from muser_ti import backend
    from muser_ti.config import load_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="cpu")
    ap.add_argument("--depth", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--case", action="append", help="engine:PATH or batch:PATH:B (repeatable)")
    ap.add_argument("--top", type=int, default=22)
    args = ap.parse_args()
    cfg = load_config("glimmer.yaml")
    backend.activate(args.arch)
    rng = np.random.default_rng(0)
    for case in args.case or ["engine:capi", "batch:capi:1"]:
        kind, path, *rest = case.split(":")
        if kind == "engine":
            head, prof = engine_case(cfg, args.arch, args.depth, path, args.tokens, args.top, rng)
        else:
            head, prof = batch_case(cfg, args.arch, args.depth, path, int(rest[0]), args.tokens, args.top, rng)
        print("==", head, flush=True)
        print(prof, flush=True)


if __name__ == "__main__":
    main()
