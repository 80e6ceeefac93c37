"""Decode attention as a model calls it: the engine against each framework's own attention, per token.

One decode token of Muse Glimmer calls attention 52 times, once a layer, with the framework's own arrays:
sliding layers over their last ``window`` keys, full (NoPE) layers over the whole context.  Each side here
makes exactly those calls, with the arrays a model hands it, in one process, timed the same way (wall time
of the token's 52 calls, the device synchronised at the end of each token), alternating token by token:

* the engine: ``eng.token()`` and ``t.attend(layer, q, k, v)`` with the framework's tensors in and out
  (torch CPU tensors, torch CUDA tensors zero-copy on arch="cuda", mlx arrays);
* torch: ``scaled_dot_product_attention(q, k, v, enable_gqa=True)`` over the cache a transformers
  ``DynamicCache`` holds (float32 [1, kv heads, keys, d]), after appending the token as its ``update`` does;
* mlx: mlx-lm's own caches (``RotatingKVCache`` / ``KVCache``, as its Glimmer makes them) and attention call.

The peers keep K/V in float32 (what the reduced-width test models run in); the engine keeps f16 planes.
Run it with the other core idle:

    python -m muser_ti.bench.in_model --peer torch --depth 2048 --depth 32768
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def _filled_engine(cfg, arch: str, depth: int, rng):
    import muser_ti as mt

    eng = mt.Engine(cfg, arch=arch)
    L, KV, D = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    for start in range(0, depth, 1024):  # in chunks: a deep prefill would hold GBs of float32 at once
        n = min(1024, depth - start)
        eng.prefill(rng.standard_normal((n, L, KV, D)).astype(np.float32),
                    rng.standard_normal((n, L, KV, D)).astype(np.float32))
    return eng


class TorchPeer:
    """transformers' decode attention: the cache as DynamicCache keeps it, sdpa with enable_gqa."""

    name = "torch sdpa"

    def __init__(self, cfg, depth: int, device: str, rng):
        import torch

        self.torch, self.device, self.cfg = torch, device, cfg
        self.caches = []
        for kind in cfg.layer_kinds:
            keys = min(depth, cfg.window) if kind == "swa" else depth
            shape = (1, cfg.n_kv_heads, keys, cfg.head_dim)
            self.caches.append([torch.randn(shape, device=device), torch.randn(shape, device=device)])

    def tensors(self, q, k, v):
        t = self.torch
        return ([t.from_numpy(q[layer][None, :, None]).to(self.device) for layer in range(len(q))],
                [t.from_numpy(k[layer][None, :, None]).to(self.device) for layer in range(len(q))],
                [t.from_numpy(v[layer][None, :, None]).to(self.device) for layer in range(len(q))])

    def token(self, qs, ks, vs) -> None:
        F = self.torch.nn.functional
        for layer, kind in enumerate(self.cfg.layer_kinds):
            kc, vc = self.caches[layer]
            # DynamicCache.update: the new row appended (a sliding layer keeps its last window rows)
            kc = self.torch.cat([kc[:, :, 1:] if kind == "swa" else kc, ks[layer]], dim=2)
            vc = self.torch.cat([vc[:, :, 1:] if kind == "swa" else vc, vs[layer]], dim=2)
            self.caches[layer] = [kc, vc]
            F.scaled_dot_product_attention(qs[layer], kc, vc, enable_gqa=True, scale=self.cfg.attention_scale)
        if self.device != "cpu":
            self.torch.cuda.synchronize()

    def engine_arrays(self, qs, ks, vs):
        return ([q[0, :, 0] for q in qs], [k[0, :, 0] for k in ks], [v[0, :, 0] for v in vs])

    def sync(self) -> None:
        if self.device != "cpu":
            self.torch.cuda.synchronize()


class MlxPeer:
    """mlx-lm's decode attention: its Glimmer's own caches (``RotatingKVCache(max_size=window)`` for the sliding
    layers, ``KVCache`` for the full ones, as ``Model.make_cache`` makes them) and its own attention call
    (``mlx_lm.models.base.scaled_dot_product_attention``, which runs mx.fast's over what the cache returns)."""

    name = "mlx sdpa"

    def __init__(self, cfg, depth: int, device: str, rng):
        import mlx.core as mx
        from mlx_lm.models.base import scaled_dot_product_attention
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        self.mx, self.cfg, self.sdpa = mx, cfg, scaled_dot_product_attention
        self.caches = []
        for kind in cfg.layer_kinds:
            cache = RotatingKVCache(max_size=cfg.window, keep=0) if kind == "swa" else KVCache()
            keys = min(depth, cfg.window) if kind == "swa" else depth
            shape = (1, cfg.n_kv_heads, keys, cfg.head_dim)
            cache.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))  # the prompt's K/V
            self.caches.append(cache)
        mx.eval([c.state for c in self.caches])

    def tensors(self, q, k, v):
        mx = self.mx
        out = ([mx.array(q[layer][None, :, None]) for layer in range(len(q))],
               [mx.array(k[layer][None, :, None]) for layer in range(len(q))],
               [mx.array(v[layer][None, :, None]) for layer in range(len(q))])
        mx.eval(out)
        return out

    def token(self, qs, ks, vs) -> None:
        mx = self.mx
        for layer, cache in enumerate(self.caches):
            kc, vc = cache.update_and_fetch(ks[layer], vs[layer])
            out = self.sdpa(qs[layer], kc, vc, cache=cache, scale=self.cfg.attention_scale, mask=None)
            mx.eval(out)  # a model's next layer needs this one's output
        mx.eval([c.state for c in self.caches])

    def engine_arrays(self, qs, ks, vs):
        return ([q[0, :, 0] for q in qs], [k[0, :, 0] for k in ks], [v[0, :, 0] for v in vs])

    def sync(self) -> None:
        pass


PEERS = {"torch": TorchPeer, "mlx": MlxPeer}


def measure(cfg, peer_name: str, arch: str, depth: int, tokens: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    eng = _filled_engine(cfg, arch, depth, rng)
    device = "cuda" if arch == "cuda" else "cpu"
    peer = PEERS[peer_name](cfg, depth, device, rng)
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    times = {"engine": [], "peer": []}
    warmup = 2
    for i in range(tokens + warmup):
        q = rng.standard_normal((L, H, D)).astype(np.float32)
        k = rng.standard_normal((L, KV, D)).astype(np.float32)
        v = rng.standard_normal((L, KV, D)).astype(np.float32)
        qs, ks, vs = peer.tensors(q, k, v)
        eq, ek, ev = peer.engine_arrays(qs, ks, vs)
        for side in (("engine", "peer") if i % 2 else ("peer", "engine")):
            t0 = time.perf_counter()
            if side == "peer":
                peer.token(qs, ks, vs)
            else:
                with eng.token() as t:
                    for layer in range(L):
                        t.attend(layer, eq[layer], ek[layer], ev[layer])
                peer.sync()
            if i >= warmup:
                times[side].append(time.perf_counter() - t0)
    ours, theirs = statistics.median(times["engine"]), statistics.median(times["peer"])
    return {"arch": eng.arch, "peer": peer.name, "depth": depth, "tokens": tokens, "engine_ms": ours * 1e3,
            "peer_ms": theirs * 1e3, "ratio": ours / theirs, "routes": dict(eng.route_counts)}


def main(argv=None) -> int:
    from muser_ti.bench.timing import machine
    from muser_ti.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="glimmer.yaml")
    ap.add_argument("--peer", choices=sorted(PEERS), default="torch")
    ap.add_argument("--arch", default="cpu")
    ap.add_argument("--depth", type=int, action="append", help="context in tokens (repeatable; default 2048, 32768)")
    ap.add_argument("--tokens", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="only JSON on stdout")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    rows = [measure(cfg, args.peer, args.arch, depth, args.tokens) for depth in (args.depth or [2048, 32768])]
    if args.json:
        json.dump({"machine": machine(), "rows": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(f"{cfg.name}: one decode token's {cfg.n_layers} attention calls, medians of {args.tokens} tokens, alternating")
    print(f"{'context':>8} {'engine (' + rows[0]['arch'] + ', ms)':>18} {rows[0]['peer'] + ' (ms)':>16} {'ratio':>7}")
    for r in rows:
        print(f"{r['depth']:>8,} {r['engine_ms']:>18.2f} {r['peer_ms']:>16.2f} {r['ratio']:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
