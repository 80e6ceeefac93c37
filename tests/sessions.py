"""Shared test drivers: small geometries, token distributions, and a checked decode session."""

import itertools

import numpy as np
import pytest

import muser_ti as mt
from muser_ti import ladder
from muser_ti.config import SWA
from muser_ti.reference import attention, relative_error
from muser_ti.tolerances import F32_ROUTE_RTOL, F32_ROUTE_RTOL_LARGE, LLAMA_CPU_VTOL


def geometry(n_heads=8, n_kv_heads=2, head_dim=64, window=64, n_layers=4, pattern=("swa", "swa", "swa", "nope"),
             max_context=4096, slack=0, name="test"):
    return mt.geometry_from_dict(dict(
        name=name, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, n_layers=n_layers,
        layer_pattern=list(pattern), window=window, max_context=max_context, attention_scale="auto",
        swa_ring_slack=slack))


# Geometries the route tests sweep: Glimmer's own group shape (16 query heads per KV head, d 128),
# a small d 64 one, d 256 with multi-head (1:1) attention, and Qwen2.5-7B's 28 heads on 4 KV heads:
# 7 per group, no power of two, so the GPU producer's tile has idle score threads and its index
# helpers take their division path instead of shifts and masks.
GEOMETRIES = {
    "gqa16-d128": dict(n_heads=32, n_kv_heads=2, head_dim=128),
    "gqa4-d64": dict(n_heads=8, n_kv_heads=2, head_dim=64),
    "mha-d256": dict(n_heads=2, n_kv_heads=2, head_dim=256),
    "gqa7-d128": dict(n_heads=28, n_kv_heads=4, head_dim=128),
}

DISTRIBUTIONS = ("normal", "peaked", "sink", "large")

NOT_ON_LAVAPIPE = pytest.mark.not_on_lavapipe  # conftest.py: skipped on lavapipe, run on the CPU and hardware


def not_on_lavapipe(*values):
    """Parameter values whose cases lavapipe skips (conftest.py)."""
    return [pytest.param(v, marks=NOT_ON_LAVAPIPE) for v in values]


def covering_product(*axes):
    """Every combination of the axes as parameter sets, lavapipe keeping a covering set only: the combinations
    (axis_0[i], axis_1[i], ...) with indices taken modulo each axis' length, so every value of every axis runs
    on lavapipe at least once; the rest are not_on_lavapipe (the CPU and hardware backends run all)."""
    n = max(len(axis) for axis in axes)
    cover = {tuple(axis[i % len(axis)] for axis in axes) for i in range(n)}
    return [pytest.param(*combo, id="-".join(map(str, combo)), marks=() if combo in cover else NOT_ON_LAVAPIPE)
            for combo in itertools.product(*axes)]


class Session:
    """Drives an engine with seeded synthetic tokens and checks every step against the reference."""

    def __init__(self, engine: mt.Engine, seed=0, dist="normal"):
        self.eng = engine
        self.cfg = engine.cfg
        self.rng = np.random.default_rng(seed)
        self.dist = dist
        self.worst = 0.0
        # f32 k and v per position the engine accepted: peaked queries aim at a past key, and
        # history_reference attends them without the engine's planes (record, record_rows, truncate)
        self.history_k, self.history_v = [], []

    def token(self):
        c, rng = self.cfg, self.rng
        L, H, KV, D = c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim
        k = rng.standard_normal((L, KV, D)).astype(np.float32)
        v = rng.standard_normal((L, KV, D)).astype(np.float32)
        q = rng.standard_normal((L, H, D)).astype(np.float32)
        p = self.eng.position
        if self.dist == "large":  # K and V near the f16 range, Q small so scores stay finite and modest
            self._scale_kv(k, v)
            q *= 1e-3
        elif self.dist in ("peaked", "sink") and self.history_k:
            # one key dominates: aim every head at a visible past token (the oldest for "sink")
            target = 0 if self.dist == "sink" else int(rng.integers(0, len(self.history_k)))
            lo = max(0, p + 1 - c.window)  # inside every layer's window
            target = max(target, lo)
            if target < len(self.history_k):  # window 1: only the current token is visible; stay random
                kt = self.history_k[target]
                heads_kv = np.arange(H) // c.heads_per_kv
                q = (3.0 * kt[:, heads_kv, :] + 0.1 * q).astype(np.float32)
        return q, k, v

    def _scale_kv(self, k, v):
        """In place, for "large": K and V near the f16 range (decoded tokens and prefilled rows alike)."""
        k *= 8000.0
        v *= 16000.0
        np.clip(k, -65000, 65000, out=k)
        np.clip(v, -65000, 65000, out=v)

    def step(self, check=True):
        q, k, v = self.token()
        out = self.eng.step(q, k, v)
        self.record(k, v)
        if check:
            self.verify(out, q, k, v)
        return out

    def record(self, k, v):
        """The token the engine just accepted (at history's next position)."""
        self.history_k.append(k)
        self.history_v.append(v)

    def record_rows(self, k, v):
        """Rows the engine just prefilled: [n, n_layers, n_kv_heads, head_dim] each."""
        self.history_k.extend(k)
        self.history_v.extend(v)

    def truncate(self, position):
        """After the engine rewound to ``position``."""
        del self.history_k[position:]
        del self.history_v[position:]

    def history_reference(self, q, k, v):
        """float64 attention of the last step over this session's own record of the tokens: each layer's
        visible positions (an SWA layer's last ``window``, a NoPE layer's all) f16-rounded as the planes
        store them, the current token in f32 where the layer took the interleaved route.  No plane, plane
        state or engine code is involved, so it also catches a bookkeeping bug that the planes, the
        kernels and the engine's own reference would share."""
        c = self.cfg
        assert len(self.history_k) == len(self.history_v) == self.eng.position, (
            f"the session recorded {len(self.history_k)} tokens, the engine is at position {self.eng.position}")
        out = np.empty((c.n_layers, c.n_heads, c.head_dim), np.float64)
        for layer in range(c.n_layers):
            lo = self.first_visible(layer)
            keys = np.stack([t[layer] for t in self.history_k[lo:]]).astype(np.float16).astype(np.float64)
            values = np.stack([t[layer] for t in self.history_v[lo:]]).astype(np.float16).astype(np.float64)
            if self.eng.routes[layer] == ladder.INTERLEAVED:
                keys[-1], values[-1] = k[layer], v[layer]
            out[layer] = attention(q[layer], keys, values, c.attention_scale)
        return out

    def first_visible(self, layer):
        """The first position ``layer`` attended at the last step: an SWA layer's last ``window``, a NoPE
        layer's all."""
        c, p = self.cfg, self.eng.position - 1
        return p + 1 - min(p + 1, c.window) if c.layer_kinds[layer] == SWA else 0

    def attended_max_abs_v(self, layer):
        """max |V| over the rows ``layer`` attended at the last step, f16 as the planes hold them: the scale
        of the llama rung's error (its V accumulator is f16).  Not the session's all-time max over every
        layer, which a large row outside the window, or in another layer, would loosen the bound with."""
        rows = np.stack([t[layer] for t in self.history_v[self.first_visible(layer):]]).astype(np.float16)
        return float(np.abs(rows).max())

    def verify(self, out, q, k, v):
        """A step's output against both references: the engine's, over its planes as the kernels address
        them, and history_reference, over what the session gave it."""
        self.check(out, self.eng.reference(q, k, v), "the engine's reference")
        self.check(out, self.history_reference(q, k, v), "the session's history")

    def check(self, out, ref, against="the engine's reference"):
        """Per layer: own routes to the f32 bound (its "large" variant on large inputs); the llama rung to its
        bound on the scale of the V rows the layer attended."""
        for layer, route in enumerate(self.eng.routes):
            if route in ladder.PINNED_ROUTES:
                err = float(np.abs(out[layer] - ref[layer]).max()) / self.attended_max_abs_v(layer)
                bound = LLAMA_CPU_VTOL
            else:
                err = relative_error(out[layer], ref[layer])
                bound = F32_ROUTE_RTOL_LARGE if self.dist == "large" else F32_ROUTE_RTOL
            self.worst = max(self.worst, err)
            assert err <= bound, (f"position {self.eng.position - 1}, layer {layer}, route {route}: error "
                                  f"{err:.3g} > {bound} against {against}")

    def rows(self, n):
        """n prefill rows of K and V, scaled as this session's distribution scales its tokens."""
        c = self.cfg
        k = self.rng.standard_normal((n, c.n_layers, c.n_kv_heads, c.head_dim)).astype(np.float32)
        v = self.rng.standard_normal((n, c.n_layers, c.n_kv_heads, c.head_dim)).astype(np.float32)
        if self.dist == "large":
            self._scale_kv(k, v)
        return k, v

    def prefill(self, n, also=None):
        """n rows into the engine, and the same rows into engine ``also`` where one is given."""
        k, v = self.rows(n)
        for eng in (self.eng, also) if also is not None else (self.eng,):
            eng.prefill(k, v)
        self.record_rows(k, v)

    def rewind(self, position):
        self.eng.rewind(position)
        self.truncate(position)


def token_stream(cfg, n, seed):
    """n seeded (q, k, v) decode tokens for a geometry: the same stream replayed into several engines."""
    rng = np.random.default_rng(seed)
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return [(rng.standard_normal((L, H, D)).astype(np.float32),
             rng.standard_normal((L, KV, D)).astype(np.float32),
             rng.standard_normal((L, KV, D)).astype(np.float32)) for _ in range(n)]


def own_routes_only(engine):
    return set(engine.routes) <= {ladder.SPLITK, ladder.INTERLEAVED}
