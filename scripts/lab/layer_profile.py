"""Where a per-layer token's host time goes on CUDA with torch CUDA tensors (the lab; docs/lab/runs.md).

The whole token (52 ``t.attend`` calls, the public path) is taken apart into what it is made of, each timed
alone over the same 52 layers inside one open token (abandoned after, so the cache is left as it was):

* ``api``      the public path: ``with eng.token() as t: t.attend(layer, q, k, v)`` x 52, device synchronised;
* ``launch``   the launcher's call per layer (copies in, the route's graph, copy out), no API checks;
* ``graph``    the route's graph alone on the engine's one-layer ndarrays (no copies);
* ``copies``   the four device-to-device copies alone;
* ``torch``    torch's cat + sdpa per layer, as in muser_ti.bench.in_model;

then cProfile of a few public tokens, the functions by own time.  Wall per token, medians.

    python scripts/lab/layer_profile.py --depth 2048 --tokens 20
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np


def main() -> None:
    import torch

    import muser_ti as mt
    from muser_ti.bench.in_model import TorchPeer, _filled_engine
    from muser_ti.config import load_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=20)
    args = ap.parse_args()
    cfg = load_config("glimmer.yaml")
    rng = np.random.default_rng(0)
    eng = _filled_engine(cfg, "cuda", args.depth, rng)
    peer = TorchPeer(cfg, args.depth, "cuda", rng)
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def arrays():
        q = torch.randn((L, H, D), device="cuda")
        k = torch.randn((L, KV, D), device="cuda")
        v = torch.randn((L, KV, D), device="cuda")
        return [q[i] for i in range(L)], [k[i] for i in range(L)], [v[i] for i in range(L)]

    def api(qs, ks, vs):
        with eng.token() as t:
            for layer in range(L):
                t.attend(layer, qs[layer], ks[layer], vs[layer])
        torch.cuda.synchronize()

    launcher = eng.launcher
    out = torch.empty((1, H, D), device="cuda")

    def inside(body):
        def run(qs, ks, vs):
            t = eng.token()
            try:
                body(t, qs, ks, vs)
                torch.cuda.synchronize()
            finally:
                t.abandon()
        return run

    def launch(t, qs, ks, vs):
        for layer in range(L):
            launcher.attend_layer_cuda(t.plans[0], layer, t.route_sizes[0], qs[layer][None], ks[layer][None],
                                       vs[layer][None], out, t._scan_stamp(layer))
        t._scans.clear()

    dev = launcher.layer_device_arrays()

    def graph(t, qs, ks, vs):
        for layer in range(L):
            launcher.attend_layer(t.plans[0], layer, t.route_sizes[0], *dev)

    tr = launcher.transfer
    addrs = [tr.address(a) for a in dev]

    def copies(t, qs, ks, vs):
        for layer in range(L):
            for a, x in zip(addrs, (qs[layer], ks[layer], vs[layer], out)):
                tr.device_copy(a, x.data_ptr(), x.numel() * 4)

    def peer_token(qs, ks, vs):
        peer.token([q[None, :, None] for q in qs], [k[None, :, None] for k in ks], [v[None, :, None] for v in vs])

    sides = {"api": api, "launch": inside(launch), "graph": inside(graph), "copies": inside(copies),
             "torch": peer_token}
    times = {name: [] for name in sides}
    for i in range(args.tokens + 3):
        qs, ks, vs = arrays()
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn(qs, ks, vs)
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    print(f"depth {args.depth}, {L} layers, wall per token, medians of {args.tokens}:")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:>7}  {med * 1e3:8.3f} ms  {med / L * 1e6:7.1f} us/layer")
    prof = cProfile.Profile()
    qs, ks, vs = arrays()
    prof.enable()
    for _ in range(5):
        api(qs, ks, vs)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue())
    print("routes", dict(eng.route_counts), "arch", mt.__name__, eng.arch)


if __name__ == "__main__":
    main()
