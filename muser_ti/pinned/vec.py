"""The vec routes' side of a step: what llama.cpp's kernel reads, and one dispatch per route's layers.

The kernel reads the cache's planes in place (the CPU backend: Taichi's own memory, through ggml), or
the mirror planes where there are some (the Metal bridge's buffers, or numpy for mirror="host").  A
layer's view is its plane's rows with the plane's own row stride: a full token row (n_kv_heads x
head_dim halves) on a token-major ring, one head's row on a head-major plane.  The serving graph reads
llama.cpp's cell-order SWA cache instead (llama_rung.ServingCache).
"""

from __future__ import annotations

import numpy as np

from ..config import SWA
from ..planes import PlaneState
from . import llama_rung


class VecRung:
    """llama.cpp's vec kernel over an engine's cache (``bridge_runner``: the Metal bridge, else ggml)."""

    def __init__(self, cfg, cache, bridge_runner=None):
        self.cfg = cfg
        self.cache = cache
        self.bridge_runner = bridge_runner
        self._runners: dict[int, object] = {}  # group size -> ggml graph runner (CPU)

    def planes(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """The K/V planes the vec routes read: the mirror when there is one, else the planes in place."""
        if self.cache.mirror is not None:
            return self.cache.mirror.k[kind], self.cache.mirror.v[kind]
        return self.cache.host_views(kind)

    def runner(self, n_nodes: int):
        runner = self._runners.get(n_nodes)
        if runner is None:
            from .ggml import GgmlFlashAttn

            g = self.cfg
            runner = self._runners[n_nodes] = GgmlFlashAttn(g.head_dim, g.n_heads, g.n_kv_heads, g.attention_scale,
                                                            llama_rung.default_threads(), n_nodes=n_nodes)
        return runner

    def views(self, kind: str, layers: tuple[int, ...], st: PlaneState, p: int) -> list:
        """One KVView per layer: what the vec kernel reads for the token at ``p`` (planes in state ``st``)."""
        from .ggml import KVView

        g, cache = self.cfg, self.cache
        kp, vp = self.planes(kind)
        views = []
        for layer in layers:
            slot = cache.slot[layer]
            if kind == SWA and cache.serving is not None:
                n_kv, mask = cache.serving.view(p)
                k_plane, v_plane, first = cache.serving.k[slot], cache.serving.v[slot], 0
            elif kind == SWA:
                first, n_kv, mask = llama_rung.ring_view(st, p, g.window)
                k_plane, v_plane = kp[slot], vp[slot]
            else:
                first, n_kv, mask = 0, p + 1, None
                k_plane, v_plane = kp[slot], vp[slot]
            # row stride: a full token row (n_kv*head_dim halves) token-major, one head row head-major
            rs, hs = (g.n_kv_heads * g.head_dim, g.head_dim) if kind == SWA else (g.head_dim, st.capacity * g.head_dim)
            views.append(KVView(k_plane, v_plane, first, n_kv, rs, hs, mask))
        return views

    def run(self, kind: str, layers: tuple[int, ...], st: PlaneState, p: int, q: np.ndarray, out: np.ndarray) -> None:
        """llama.cpp's vec kernel for ``layers`` at ``p``, one dispatch: out[layers] = attention."""
        views = self.views(kind, layers, st, p)
        runner = self.bridge_runner if self.bridge_runner is not None else self.runner(len(layers))
        out[list(layers)] = runner.attend_many(q[list(layers)], views)

    def stage_serving(self, p: int, new_states: dict[str, PlaneState]) -> None:
        """The serving graph keeps llama's cell order up to date on every token, whichever route runs,
        so the pinned kernel finds the cache llama.cpp would have."""
        ring = self.planes(SWA)
        row = new_states[SWA].physical(p)
        self.cache.serving.stage(p, ring[0][:, row], ring[1][:, row])


__all__ = ["VecRung"]
