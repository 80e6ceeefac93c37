"""Shared test drivers: small geometries, token distributions, and a checked decode session."""

import numpy as np

import muser_ti as mt
from muser_ti import ladder
from muser_ti.reference import relative_error
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


class Session:
    """Drives an engine with seeded synthetic tokens and checks every step against the reference."""

    def __init__(self, engine: mt.Engine, seed=0, dist="normal"):
        self.eng = engine
        self.cfg = engine.cfg
        self.rng = np.random.default_rng(seed)
        self.dist = dist
        self.worst = 0.0
        self.history_k = []  # f32 k per position, to aim peaked queries at a past key
        self.max_abs_v = 0.0  # the llama rung's error bound scales with |V| (its accumulator is f16)

    def token(self):
        c, rng = self.cfg, self.rng
        L, H, KV, D = c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim
        k = rng.standard_normal((L, KV, D)).astype(np.float32)
        v = rng.standard_normal((L, KV, D)).astype(np.float32)
        q = rng.standard_normal((L, H, D)).astype(np.float32)
        p = self.eng.position
        if self.dist == "large":  # K and V near the f16 range, Q small so scores stay finite and modest
            k *= 8000.0
            v *= 16000.0
            np.clip(k, -65000, 65000, out=k)
            np.clip(v, -65000, 65000, out=v)
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

    def step(self, check=True):
        q, k, v = self.token()
        out = self.eng.step(q, k, v)
        self.history_k.append(k)
        self.max_abs_v = max(self.max_abs_v, float(np.abs(v).max()))
        if check:
            self.check(out, self.eng.reference(q, k, v))
        return out

    def check(self, out, ref):
        """Per layer: own routes to the f32 bound (its "large" variant on large inputs); the llama rung to its
        bound on the scale of V."""
        for layer, route in enumerate(self.eng.routes):
            if route in ladder.PINNED_ROUTES:
                err = float(np.abs(out[layer] - ref[layer]).max()) / self.max_abs_v
                bound = LLAMA_CPU_VTOL
            else:
                err = relative_error(out[layer], ref[layer])
                bound = F32_ROUTE_RTOL_LARGE if self.dist == "large" else F32_ROUTE_RTOL
            self.worst = max(self.worst, err)
            assert err <= bound, (
                f"position {self.eng.position - 1}, layer {layer}, route {route}: error {err:.3g} > {bound}")

    def prefill(self, n):
        c = self.cfg
        k = self.rng.standard_normal((n, c.n_layers, c.n_kv_heads, c.head_dim)).astype(np.float32)
        v = self.rng.standard_normal((n, c.n_layers, c.n_kv_heads, c.head_dim)).astype(np.float32)
        self.eng.prefill(k, v)
        self.history_k.extend(k)
        self.max_abs_v = max(self.max_abs_v, float(np.abs(v).max()))

    def rewind(self, position):
        self.eng.rewind(position)
        del self.history_k[position:]


def token_stream(cfg, n, seed):
    """n seeded (q, k, v) decode tokens for a geometry: the same stream replayed into several engines."""
    rng = np.random.default_rng(seed)
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return [(rng.standard_normal((L, H, D)).astype(np.float32),
             rng.standard_normal((L, KV, D)).astype(np.float32),
             rng.standard_normal((L, KV, D)).astype(np.float32)) for _ in range(n)]


def own_routes_only(engine):
    return set(engine.routes) <= {ladder.SPLITK, ladder.INTERLEAVED}
