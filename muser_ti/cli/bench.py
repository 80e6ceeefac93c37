"""Benchmarks: the project's own routes against peers measured in the same run.

    muser-bench --arch cpu                      # layers at 2,048/32,768/131,072, steps at 2,048/32,768
    muser-bench --arch cpu --json out/bench.json   # (or: python scripts/bench.py ...)

One layer per route: a one-layer geometry with Glimmer's heads (splitk: an SWA layer whose window is
the depth; interleaved: a NoPE layer), prefilled to depth-1, then timed as step + rewind(1) so every
repeat attends exactly `depth` rows.  Whole step: Glimmer's 52 layers at the given depth.
Peers, same run, same data shapes: ggml's ggml_flash_attn_ext (ggml-python 0.0.45, the pinned
library) over f16 planes of the same layout; the float64 numpy reference; torch SDPA if torch is
installed.  Every figure is a median of --repeats runs; GB/s counts the KV bytes the layer must read.
On a GPU (--arch cuda/vulkan/metal) a step is timed twice: with numpy in and out (Engine.step), and
with q/k/v/out already on the device (Engine.step_device, to the device's completion).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import muser_ti as mt
from muser_ti import reference
from muser_ti.measure import machine, median_time

from .bench_common import (ROUTE_KIND, finish, int_list, layer_geometry, prefill, report, timed_step)

class Peers:
    """The peers, each over planes holding the same rows as the engine's."""

    def __init__(self, cfg: mt.Geometry, repeats: int):
        self.cfg = cfg
        self.repeats = repeats
        try:
            from muser_ti.pinned.ggml import GgmlFlashAttn

            self.ggml = GgmlFlashAttn(cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.attention_scale, os.cpu_count())
        except Exception as exc:  # reported, not fatal: the bench still runs the project's routes
            print(f"ggml peer unavailable: {exc}", file=sys.stderr)
            self.ggml = None
        try:
            import torch

            self.torch = torch
        except ImportError:
            self.torch = None

    def ggml_layer(self, q, k, v, layout: str) -> float:
        """k, v: f16 planes of one layer (token-major [N, kv, d] or head-major [kv, N, d])."""
        c = self.cfg
        if layout == reference.TOKEN_MAJOR:
            rs, hs, n = c.n_kv_heads * c.head_dim, c.head_dim, k.shape[0]
        else:
            rs, hs, n = c.head_dim, k.shape[1] * c.head_dim, k.shape[1]
        return median_time(lambda: self.ggml.attend(q, k, v, first_row=0, n_rows=n, row_stride_elems=rs,
                                                    head_stride_elems=hs), self.repeats)

    def torch_layer(self, q, k, v, layout: str) -> float:
        t = self.torch
        kt = k if layout == reference.HEAD_MAJOR else np.swapaxes(k, 0, 1)
        vt = v if layout == reference.HEAD_MAJOR else np.swapaxes(v, 0, 1)
        # f32 on the CPU (torch's CPU f16 SDPA is slower); one call per layer as a user writes it
        qq = t.from_numpy(q)[None, :, None, :]
        kk = t.from_numpy(np.ascontiguousarray(kt, np.float32))[None]
        vv = t.from_numpy(np.ascontiguousarray(vt, np.float32))[None]
        f = t.nn.functional.scaled_dot_product_attention
        return median_time(lambda: f(qq, kk, vv, scale=self.cfg.attention_scale, enable_gqa=True), self.repeats)

    def reference_layer(self, q, k, v, layout: str) -> float:
        kt = k if layout == reference.TOKEN_MAJOR else np.swapaxes(k, 0, 1)
        vt = v if layout == reference.TOKEN_MAJOR else np.swapaxes(v, 0, 1)
        return median_time(lambda: reference.attention(q, kt, vt, self.cfg.attention_scale), max(3, self.repeats // 3), 1)


def bench_layer(base, route, depth, arch, peers: Peers, rng, repeats) -> dict:
    cfg = layer_geometry(base, route, depth)
    eng = mt.Engine(cfg, arch=arch, force=route)
    prefill(eng, depth - 1, rng)
    ours, q = timed_step(eng, rng, repeats)
    assert eng.routes == [route], eng.routes
    kh, vh = eng.cache.host_views(ROUTE_KIND[route])
    k, v, layout = kh[0], vh[0], reference.TOKEN_MAJOR if route == "splitk" else reference.HEAD_MAJOR
    row = {"what": f"1 layer {route}", "depth": depth, "visible": depth, "ours_ms": ours * 1e3}
    qh = q[0]
    if peers.ggml is not None:
        row["ggml_ms"] = peers.ggml_layer(qh, k, v, layout) * 1e3
    if peers.torch is not None:
        row["torch_ms"] = peers.torch_layer(qh, k, v, layout) * 1e3
    row["numpy_ref_ms"] = peers.reference_layer(qh, k, v, layout) * 1e3
    return finish(row, base, [depth])


def bench_step(base, depth, arch, peers: Peers, rng, repeats) -> dict:
    eng = mt.Engine(base, arch=arch, pinned="off")  # the project's own routes; ggml is the peer
    prefill(eng, depth - 1, rng)
    ours, q = timed_step(eng, rng, repeats)
    visibles = [base.visible(kind, depth - 1) for kind in base.layer_kinds]
    row = {"what": f"{base.n_layers}-layer step", "depth": depth, "visible": max(visibles), "ours_ms": ours * 1e3,
           "routes": dict(eng.route_counts)}
    # peers: one call per layer, as a user of each library would write the step (zero-copy plane views)
    host = {kind: eng.cache.host_views(kind) for kind in eng.planes}
    planes = [(host[kind][0][eng.cache.slot[layer]], host[kind][1][eng.cache.slot[layer]], eng.planes[kind].state,
               reference.TOKEN_MAJOR if kind == "swa" else reference.HEAD_MAJOR)
              for layer, kind in enumerate(base.layer_kinds)]
    for name, fn in (("ggml_ms", peers.ggml_layer if peers.ggml else None),
                     ("torch_ms", peers.torch_layer if peers.torch else None)):
        if fn is None:
            continue
        total = 0.0
        for layer, (k, v, st, layout) in enumerate(planes):
            n = visibles[layer]
            if layout == reference.TOKEN_MAJOR:
                rows = reference.gather(k, st, reference.visible_logicals(depth - 1, base.window), layout)
                vrows = reference.gather(v, st, reference.visible_logicals(depth - 1, base.window), layout)
            else:
                rows, vrows = k[:, :n], v[:, :n]
            total += fn(q[layer], np.ascontiguousarray(rows), np.ascontiguousarray(vrows), layout)
        row[name] = total * 1e3
    return finish(row, base, visibles)



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="glimmer.yaml")
    ap.add_argument("--arch", default="cpu")
    ap.add_argument("--layer-depths", default="2048,32768,131072")
    ap.add_argument("--step-depths", default="2048,32768")
    ap.add_argument("--routes", default="splitk,interleaved")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows and the machine description here")
    ap.add_argument("--mode", default="layers", choices=["layers", "steps"],
                    help="GPU archs: one layer's GPU busy time, or the whole step's wall time per token")
    args = ap.parse_args(argv)

    base = mt.load_config(args.config)
    rng = np.random.default_rng(args.seed)
    rows = []
    if args.arch in ("cuda", "vulkan"):
        from .bench_gpu import gpu_main

        return gpu_main(args, base, rng, argv)
    peers = Peers(base, args.repeats)
    for depth in int_list(args.layer_depths):
        for route in [r for r in args.routes.split(",") if r]:
            rows.append(bench_layer(base, route, depth, args.arch, peers, rng, args.repeats))
            print(json.dumps(rows[-1]), flush=True)
    for depth in int_list(args.step_depths):
        rows.append(bench_step(base, depth, args.arch, peers, rng, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    info = {"machine": machine(), "arch": args.arch, "config": base.source, "repeats": args.repeats}
    return report(rows, info, args, argv, f"{base.name} on {args.arch}: medians of {args.repeats} "
                                          f"({info['machine'].get('cpu', '')})")


if __name__ == "__main__":
    sys.exit(main())
