"""Batched decode attention: B sequences' next token, layer by layer, the engine against torch's SDPA.

A server's decode step runs every layer once for the whole batch.  Each side here makes the step's calls for a
group of Glimmer's layers (three sliding, one full: the pattern its 52 layers repeat 13 times, so the ratio is the
model's), with B sequences all at ``depth`` tokens of context, in one process, timed the same way (wall time of the
group's calls for one token of every sequence, the device synchronised at the end), alternating step by step:

* the engine: a :class:`~muser_ti.batch.Batch` of B sequences (its pool sized up front), ``batch.token()`` and
  ``t.attend(layer, q, k, v)`` with torch tensors [B, heads, d] in and out;
* torch: a static cache per layer as transformers' ``StaticCache`` holds it ([B, kv heads, keys, d]: a sliding
  layer's ``window`` rows written as a ring, a full layer's rows up to the context), the new row written in place
  (``index_copy_``), then ``scaled_dot_product_attention(q, k, v, enable_gqa=True)``; every sequence at the same
  depth (no padding).  On the CPU over the rows held, no mask (the peer's best case there); on CUDA over the whole
  static buffer with a mask of the rows held, as transformers' StaticCache attends: the shapes stay fixed from step
  to step (what CUDA graphs need; a shape that grows every step made torch's SDPA pick its kernel anew each step,
  ~10 ms on an H100).

* ggml (``--side ggml``, CPU, a process of its own): llama.cpp's kernel, one graph a layer with a node a sequence
  over f16 caches (:class:`GgmlBatch`); scripts/lab/batch_cpu.sh runs it on ggml built natively.

K/V: float32 on the CPU, bfloat16 on CUDA (what a GPU user runs); the engine keeps f16 planes.  The engine attends
a layer's sequences in one launch per route (muser_ti/batch_launch.py).  Run it with the other core idle:

    python -m muser_ti.bench.batch_decode --batch 1 --batch 8 --depth 2048 --depth 32768
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def group_geometry(cfg):
    """``cfg`` cut to one group of its layer pattern (Glimmer: three sliding layers, one full)."""
    from muser_ti.config import geometry_from_dict

    kinds = list(cfg.layer_kinds)
    period = next(p for p in range(1, len(kinds) + 1) if len(kinds) % p == 0 and kinds == kinds[:p] * (len(kinds) // p))
    return geometry_from_dict(dict(
        name=f"{cfg.name} (one group of {period} layers)", n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, n_layers=period, layer_pattern=kinds[:period], window=cfg.window,
        max_context=cfg.max_context, attention_scale=cfg.attention_scale, swa_ring_slack=cfg.swa_ring_slack))


def _filled_batch(cfg, arch: str, batch: int, depth: int, context: int, rng, launch: str = "auto"):
    from muser_ti.batch import Batch

    b = Batch(cfg, batch, arch=arch, context=context, launch=launch)
    L, KV, D = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    # random rows drawn once, in chunks (a deep prefill would hold GBs of float32 at once), each sequence's planes
    # filled from them: drawing them anew for every sequence was most of a batch of 128's setup
    chunks = [(rng.standard_normal((n, L, KV, D), dtype=np.float32), rng.standard_normal((n, L, KV, D),
                                                                                          dtype=np.float32))
              for n in [min(4096, depth - start) for start in range(0, depth, 4096)]]
    for _ in range(batch):
        eng = b.sequence(b.join())
        for k, v in chunks:
            eng.prefill(k, v)
    return b


class TorchStatic:
    """transformers' StaticCache and sdpa, at the batch's depth."""

    def __init__(self, cfg, batch: int, depth: int, context: int, device: str, dtype):
        import torch

        self.torch, self.cfg, self.device = torch, cfg, device
        self.caches, self.held = [], []
        for kind in cfg.layer_kinds:
            rows = cfg.window if kind == "swa" else context
            shape = (batch, cfg.n_kv_heads, rows, cfg.head_dim)
            self.caches.append((torch.randn(shape, device=device, dtype=dtype),
                                torch.randn(shape, device=device, dtype=dtype)))
        self.position = depth
        self.masked = device != "cpu"

    def token(self, qs, ks, vs) -> list:
        t, F, cfg = self.torch, self.torch.nn.functional, self.cfg
        outs = []
        for layer, kind in enumerate(cfg.layer_kinds):
            kc, vc = self.caches[layer]
            slot = self.position % cfg.window if kind == "swa" else self.position
            at = t.tensor([slot], device=self.device)
            kc.index_copy_(2, at, ks[layer])
            vc.index_copy_(2, at, vs[layer])
            held = min(self.position + 1, cfg.window) if kind == "swa" else self.position + 1
            if self.masked:  # the whole buffer, a mask of the rows held: fixed shapes
                mask = (t.arange(kc.shape[2], device=self.device) < held)[None, None, None, :]
                outs.append(F.scaled_dot_product_attention(qs[layer], kc, vc, attn_mask=mask, enable_gqa=True,
                                                           scale=cfg.attention_scale))
            else:
                outs.append(F.scaled_dot_product_attention(qs[layer], kc[:, :, :held], vc[:, :, :held],
                                                           enable_gqa=True, scale=cfg.attention_scale))
        self.position += 1
        self.sync()
        return outs

    def sync(self) -> None:
        if self.device != "cpu":
            self.torch.cuda.synchronize()


class GgmlBatch:
    """llama.cpp's kernel over the batch on the CPU: ggml's ``ggml_flash_attn_ext`` (muser_ti.pinned.ggml's runner,
    on whichever ggml the process imports: scripts/lab/batch_cpu.sh runs it on ggml built natively) over each
    sequence's f16 cache, as llama.cpp keeps it (a sliding layer's ring token-major, a full layer's rows head-major),
    the new row written in place (f32 to f16, llama.cpp's cache copy), then one graph compute a layer with a node a
    sequence, over the rows each holds."""

    def __init__(self, cfg, batch: int, depth: int, context: int, rng):
        from muser_ti.bench.timing import random_halves
        from muser_ti.pinned.ggml import GgmlFlashAttn

        self.cfg = cfg
        KV, D = cfg.n_kv_heads, cfg.head_dim
        self.planes = []
        for kind in cfg.layer_kinds:
            shape = (batch, cfg.window, KV, D) if kind == "swa" else (batch, KV, context, D)
            self.planes.append(tuple(random_halves(rng, shape) for _ in range(2)))
        self.runner = GgmlFlashAttn(D, cfg.n_heads, KV, cfg.attention_scale, os.cpu_count(), n_nodes=batch)
        self.batch, self.context, self.position = batch, context, depth

    def token(self, qs, ks, vs) -> list:
        from muser_ti.pinned.ggml import KVView

        cfg, B, KV, D = self.cfg, self.batch, self.cfg.n_kv_heads, self.cfg.head_dim
        outs = []
        for layer, kind in enumerate(cfg.layer_kinds):
            k, v = self.planes[layer]
            if kind == "swa":
                slot = self.position % cfg.window
                k[:, slot], v[:, slot] = ks[layer], vs[layer]
                held, strides = min(self.position + 1, cfg.window), (KV * D, D)
            else:
                k[:, :, self.position], v[:, :, self.position] = ks[layer], vs[layer]
                held, strides = self.position + 1, (D, self.context * D)
            views = [KVView(k[b], v[b], 0, held, *strides) for b in range(B)]
            outs.append(self.runner.attend_many(qs[layer], views).copy())
        self.position += 1
        return outs


SIDES = ("both", "engine", "peer", "ggml")


def measure(cfg, arch: str, batch: int, depth: int, tokens: int, seed: int = 0, side: str = "both",
            model_layers: int | None = None, launch: str = "auto") -> dict:
    """Medians of ``tokens`` steps; ``side``: both alternating in this process, or one alone (on a 2-core machine
    each side in a process of its own, the other core idle).  The engine's step is also taken apart: its open and
    commit (once a token, ``engine_open_commit_ms``) and its layers; ``model_ratio`` is the model's token of
    ``model_layers`` layers from them, open and commit once and the group's layers once a group, against the peer's
    group once a group.  ``launch``: the engine's launch path (Engine's option: "auto", "capi", "python")."""
    model_layers = model_layers or cfg.n_layers
    import torch

    rng = np.random.default_rng(seed)
    device = "cuda" if arch == "cuda" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    context = depth + tokens + 4
    sides = ("engine", "peer") if side == "both" else (side,)
    eng = _filled_batch(cfg, arch, batch, depth, context, rng, launch) if "engine" in sides else None
    peer = TorchStatic(cfg, batch, depth, context, device, dtype) if "peer" in sides else None
    ggml = GgmlBatch(cfg, batch, depth, context, rng) if "ggml" in sides else None
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    times = {"engine": [], "peer": [], "ggml": []}
    fixed = []  # the engine's step open and commit, apart from its layers (once a token, whatever the layer count)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    warmup = 2
    for i in range(tokens + warmup):
        def rand(*shape):
            return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(device=device, dtype=dtype)

        q, k, v = rand(L, batch, H, D), rand(L, batch, KV, D), rand(L, batch, KV, D)
        for one in (sides if i % 2 else sides[::-1]):
            t0 = time.perf_counter()
            if one == "peer":
                peer.token([x[:, :, None] for x in q], [x[:, :, None] for x in k], [x[:, :, None] for x in v])
            elif one == "ggml":
                ggml.token(q.numpy(), k.numpy(), v.numpy())
            else:
                t = eng.token()
                t1 = time.perf_counter()
                for layer in range(L):
                    t.attend(layer, q[layer], k[layer], v[layer])
                sync()  # the layers' kernels done: the commit's time is its own
                t2 = time.perf_counter()
                t.commit()
                sync()
                if i >= warmup:
                    fixed.append((t1 - t0) + (time.perf_counter() - t2))
            if i >= warmup:
                times[one].append(time.perf_counter() - t0)
    row = {"arch": arch, "peer": f"torch sdpa, static cache, {str(dtype).replace('torch.', '')}", "batch": batch,
           "depth": depth, "layers": L, "tokens": tokens, "side": side, "launch": launch}
    for one in sides:
        row[f"{one}_ms"] = statistics.median(times[one]) * 1e3
    if fixed:
        row["engine_open_commit_ms"] = statistics.median(fixed) * 1e3
    if side == "both":
        row["ratio"] = row["engine_ms"] / row["peer_ms"]
        # the model's token: its step opens and commits once for all its layers, the group's layers x groups
        groups = model_layers // L
        layers_ms = row["engine_ms"] - row["engine_open_commit_ms"]
        row["model_ratio"] = (row["engine_open_commit_ms"] + groups * layers_ms) / (groups * row["peer_ms"])
    if eng is not None:
        row["kv_bytes_per_sequence"] = eng.kv_bytes(eng.sequences[0])
    if ggml is not None:
        from muser_ti.bench.native_ggml import loaded_build

        row["ggml"] = loaded_build()
    return row


def main(argv=None) -> int:
    from muser_ti.bench.timing import machine
    from muser_ti.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="glimmer.yaml")
    ap.add_argument("--arch", default="cpu")
    ap.add_argument("--batch", type=int, action="append", help="sequences (repeatable; default 1, 8)")
    ap.add_argument("--depth", type=int, action="append", help="context in tokens (repeatable; default 2048, 32768)")
    ap.add_argument("--tokens", type=int, default=10, help="timed steps a side (medians)")
    ap.add_argument("--side", choices=SIDES, default="both",
                    help="engine and torch alternating, or one side alone (ggml: alone only)")
    ap.add_argument("--launch", action="append", choices=("auto", "capi", "python"),
                    help="the engine's launch path (repeatable: a row each; default auto)")
    ap.add_argument("--json", action="store_true", help="only JSON on stdout")
    args = ap.parse_args(argv)
    full = load_config(args.config)
    cfg = group_geometry(full)
    rows = [measure(cfg, args.arch, b, depth, args.tokens, side=args.side, model_layers=full.n_layers, launch=launch)
            for depth in (args.depth or [2048, 32768]) for b in (args.batch or [1, 8]) for launch in
            (args.launch or ["auto"])]
    if args.json:
        json.dump({"machine": machine(), "rows": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(f"{cfg.name}: one decode step of every sequence, medians of {args.tokens} steps, alternating "
          f"({full.name}'s {full.n_layers} layers are {full.n_layers // cfg.n_layers} such groups)")
    print(f"{'batch':>6} {'context':>8} {'launch':>7} {'engine (' + rows[0]['arch'] + ', ms)':>18} "
          f"{'open+commit':>12} "
          f"{rows[0]['peer'] + ' (ms)':>34} {'ratio':>7} {'model':>7} {'ggml (ms)':>10}")
    for r in rows:
        cells = [f"{r[k]:.2f}" if k in r else "-"
                 for k in ("engine_ms", "engine_open_commit_ms", "peer_ms", "ratio", "model_ratio", "ggml_ms")]
        print(f"{r['batch']:>6} {r['depth']:>8,} {r['launch']:>7} {cells[0]:>18} {cells[1]:>12} {cells[2]:>34} "
              f"{cells[3]:>7} {cells[4]:>7} {cells[5]:>10}")
    print(f"model: the ratio for {full.name}'s token, whose open and commit come once for its {full.n_layers} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
