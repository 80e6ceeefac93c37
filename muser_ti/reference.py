"""The float64 reference: attention built from zero (§16.1), online softmax (§16.2), over the same planes.

Every route is checked against :func:`attend`, which reads a plane through the same explicit-origin
addressing as the kernels but does all arithmetic in float64 on the f16 values actually stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .planes import PlaneState

TOKEN_MAJOR = "token_major"  # [row, kv_head, d]  (SWA rings)
HEAD_MAJOR = "head_major"  # [kv_head, row, d]  (NoPE planes)

# The chapter's initial running max: finite, so exp(M_old - M_new) is 0, never inf - inf = NaN.
RUNNING_MAX_INIT = -3.402823466e38


def softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis with the max-subtraction of Figure 16.1 (exact, and mandatory)."""
    s = np.asarray(scores, dtype=np.float64)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float | None = None) -> np.ndarray:
    """softmax_t((Q_h . K_t[kv(h)]) * scale) . V_t[kv(h)] in float64.

    q: [n_heads, d] (or [d] for one head); k: [T, n_kv, d] (or [T, d] for one KV head);
    v: [T, n_kv, dv] (or [T, dv]).  kv(h) = h // (n_heads / n_kv): grouped-query fan-in.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    single = q.ndim == 1
    if single:
        q = q[None]
    if k.ndim == 2:
        k, v = k[:, None, :], v[:, None, :]
    n_heads, d = q.shape
    n_kv = k.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv={n_kv}")
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    kv_of_head = np.arange(n_heads) // (n_heads // n_kv)
    scores = np.einsum("hd,thd->ht", q, k[:, kv_of_head, :]) * scale
    out = np.einsum("ht,thd->hd", softmax(scores), v[:, kv_of_head, :])
    return out[0] if single else out


@dataclass(frozen=True)
class OnlineRow:
    """One row of Figure 16.2's running table."""

    token: int
    score: float
    new_max: float
    corr: float
    sum: float
    acc: np.ndarray


def online_softmax_table(scores, values) -> tuple[list[OnlineRow], np.ndarray]:
    """Fold scores in arrival order with the (M, S, O) update; returns the table and O / S."""
    m, s = -np.inf, 0.0
    o = np.zeros_like(np.asarray(values[0], dtype=np.float64))
    rows = []
    for t, (score, value) in enumerate(zip(scores, values)):
        new_m = max(m, float(score))
        corr = float(np.exp(m - new_m))  # exp(-inf) = 0 on the first row
        w = float(np.exp(score - new_m))
        s = s * corr + w
        o = o * corr + w * np.asarray(value, dtype=np.float64)
        m = new_m
        rows.append(OnlineRow(t, float(score), new_m, corr, s, o.copy()))
    return rows, o / s


def merge_partials(partials) -> np.ndarray:
    """Merge (M, S, O) summaries of disjoint token sets: exp(M_i - global max), one divide at the end."""
    gmax = max(m for m, _, _ in partials)
    total_s = sum(s * np.exp(m - gmax) for m, s, _ in partials)
    total_o = sum(np.asarray(o, np.float64) * np.exp(m - gmax) for m, _, o in partials)
    return total_o / total_s


def visible_logicals(position: int, window: int) -> np.ndarray:
    """Logical tokens a layer at ``position`` attends (window 0 = full context)."""
    visible = min(position + 1, window) if window > 0 else position + 1
    return np.arange(position + 1 - visible, position + 1)


def gather(plane: np.ndarray, state: PlaneState, logicals: np.ndarray, layout: str) -> np.ndarray:
    """Rows of one layer's plane for the given logical tokens, as [T, n_kv, d], by origin addressing."""
    if len(logicals) and (logicals[0] < state.origin_logical or logicals[-1] >= state.origin_logical + state.len):
        raise ValueError(
            f"plane holds logical [{state.origin_logical}, {state.origin_logical + state.len}), "
            f"asked for [{logicals[0]}, {logicals[-1]}]"
        )
    physical = (state.origin_physical + logicals - state.origin_logical) % state.capacity
    if layout == TOKEN_MAJOR:
        return plane[physical]
    if layout == HEAD_MAJOR:
        return np.swapaxes(plane[:, physical], 0, 1)
    raise ValueError(f"unknown layout {layout!r}")


def attend(
    q: np.ndarray,
    k_plane: np.ndarray,
    v_plane: np.ndarray,
    state: PlaneState,
    position: int,
    window: int,
    scale: float,
    layout: str,
    current: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """float64 attention of one layer over its plane as the kernels address it.

    ``current=(k_cur, v_cur)`` replaces the row of ``position`` with the f32 activations, the way the
    interleaved route reads the current token (it never round-trips through the f16 plane).
    """
    logicals = visible_logicals(position, window)
    k = gather(k_plane, state, logicals, layout).astype(np.float64)
    v = gather(v_plane, state, logicals, layout).astype(np.float64)
    if current is not None:
        k[-1] = np.asarray(current[0], np.float64)
        v[-1] = np.asarray(current[1], np.float64)
    return attention(q, k, v, scale)


def over_planes(cfg, cache, routes, q: np.ndarray, k_cur: np.ndarray | None = None,
                v_cur: np.ndarray | None = None) -> np.ndarray:
    """float64 attention of every layer for the token before ``cache.position``, over the cache's own f16
    planes (muser_ti/kv_cache.py), as the kernels address them.  Layers whose route is "interleaved" read
    the current token from k_cur/v_cur (f32), as that route does; all others read it back from the plane."""
    p = cache.position - 1
    layout = {"swa": TOKEN_MAJOR, "nope": HEAD_MAJOR}
    snap = {kind: cache.halves(kind) for kind in cache.planes}
    out = np.empty((cfg.n_layers, cfg.n_heads, cfg.head_dim), np.float64)
    for layer, kind in enumerate(cfg.layer_kinds):
        kp, vp = snap[kind]
        slot = cache.slot[layer]
        current = (k_cur[layer], v_cur[layer]) if routes[layer] == "interleaved" and k_cur is not None else None
        window = cfg.window if kind == "swa" else 0
        out[layer] = attend(q[layer], kp[slot], vp[slot], cache.planes[kind].state, p, window, cfg.attention_scale,
                            layout[kind], current)
    return out


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref|: the figure every accuracy bound in this project is stated in."""
    ref = np.asarray(ref, np.float64)
    denom = max(float(np.abs(ref).max()), np.finfo(np.float64).tiny)
    return float(np.abs(np.asarray(out, np.float64) - ref).max() / denom)
