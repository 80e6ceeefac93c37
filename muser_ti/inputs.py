"""Every check of the engine's public arguments and tokens, in one place.

A value that fails is refused with an EngineError naming the argument, the value (and where in an
array) and what is allowed, before anything is written.  The planes hold f16, so K and V must fit its
range, and so must Q (the pinned rung rounds it to f16, and the scores stay finite in f32 for every
accepted scale: config.py); every array must be finite, a real numpy array (a masked array's mask would
be ignored), of a floating dtype; an integer argument is a Python or numpy integer, never a bool.
"""

from __future__ import annotations

import numpy as np

from .config import F16_MAX, MAX_PLANE_ELEMENTS, NOPE, SWA, Geometry, plane_elements
from .errors import EngineError


def token_shapes(cfg: Geometry) -> dict[str, tuple[int, int, int]]:
    """The shapes of one decode token's arrays: q and out [layers, heads, d], k and v [layers, kv heads, d]."""
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return {"q": (L, H, D), "k": (L, KV, D), "v": (L, KV, D), "out": (L, H, D)}


def choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise EngineError(f"{name}={value!r}; expected one of {list(allowed)}")


def integer(name: str, value) -> int:
    """A Python or numpy integer (not a bool), as int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise EngineError(f"{name}={value!r}: expected an integer, got {type(value).__name__}")
    return int(value)


def capacity(cfg: Geometry, value) -> int | None:
    """The per-session capacity: a positive integer whose planes stay under 2**31 elements (checked before any
    allocation: past it Taichi's 32-bit indexing wraps and the process crashes)."""
    if value is None:
        return None
    value = integer("capacity", value)
    if value < 1:
        raise EngineError(f"capacity={value}: expected a positive integer")
    for kind, layers, rows in ((SWA, cfg.swa_layers, value), (NOPE, cfg.nope_layers, min(value, cfg.max_context))):
        elements = plane_elements(cfg, layers, rows)
        if elements >= MAX_PLANE_ELEMENTS:
            most = (MAX_PLANE_ELEMENTS - 1) // plane_elements(cfg, layers, 1)
            raise EngineError(f"capacity={value}: the {kind} plane would hold {elements:,} elements ({len(layers)} layers x "
                              f"{cfg.n_kv_heads} kv heads x {rows} rows x head_dim {cfg.head_dim}), past the 2**31 Taichi "
                              f"indexes; expected at most {most:,} for this geometry")
    return value


def position(name: str, value, hi: int) -> int:
    """An absolute position in [0, hi]: a Python or numpy integer, not a bool."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not 0 <= value <= hi:
        raise EngineError(f"{name} to {value!r}: expected an integer in [0, {hi}] (the current position)")
    return int(value)


def _where(name: str, idx: tuple[int, ...]) -> str:
    axes = ("layer", "head", "d") if name == "q" else ("layer", "kv head", "d")
    if len(idx) == 4:
        axes = ("token",) + axes
    return ", ".join(f"{a} {i}" for a, i in zip(axes, idx))


def host_array(name: str, a, shape: tuple[int, ...]) -> np.ndarray:
    """A finite float array of ``shape``, as C-contiguous float32."""
    if not isinstance(a, np.ndarray) or isinstance(a, np.ma.MaskedArray):
        raise EngineError(f"{name}: expected a numpy array (not a masked one: its mask would be ignored), got "
                          f"{type(a).__name__}")
    if a.shape != shape:
        raise EngineError(f"{name}: shape {a.shape}, expected {shape}")
    if a.dtype not in (np.float32, np.float64, np.float16):
        raise EngineError(f"{name}: dtype {a.dtype}, expected float32")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(a).all():  # one pass on the common path; the bad index only when there is one
        idx = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
        raise EngineError(f"{name}: non-finite value {a[idx]} at {_where(name.split()[-1], idx)}")
    return a


def f16_range(name: str, a: np.ndarray) -> None:
    """K and V are stored as f16 (a value past its range would become inf in the plane); Q is held to the same
    range (the pinned rung rounds it to f16; config.py bounds the scale for it)."""
    if a.size and max(float(a.max()), -float(a.min())) > F16_MAX:
        idx = tuple(int(i) for i in np.argwhere(np.abs(a) > F16_MAX)[0])
        what = "overflows the f16 plane" if name.split()[-1] in ("k", "v") else "is outside the f16 range q is held to"
        raise EngineError(f"{name}: value {a[idx]:.6g} at {_where(name.split()[-1], idx)} {what} (|x| <= {F16_MAX:.0f})")


def prefill_tokens(cfg: Geometry, k, v) -> tuple[np.ndarray, np.ndarray]:
    """Prefill's k and v, float32 [n_tokens, layers, kv heads, d], checked."""
    if not isinstance(k, np.ndarray) or k.ndim != 4:
        raise EngineError(f"prefill k: expected a 4-d numpy array [n_tokens, {cfg.n_layers}, {cfg.n_kv_heads}, "
                          f"{cfg.head_dim}]")
    shape = (k.shape[0], cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    k, v = host_array("prefill k", k, shape), host_array("prefill v", v, shape)
    f16_range("prefill k", k)
    f16_range("prefill v", v)
    return k, v


def step_token(cfg: Geometry, q, k, v) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One decode token's q, k, v, checked (step()'s messages; step_device's refusals name the same)."""
    shapes = token_shapes(cfg)
    q, k, v = (host_array(name, a, shapes[name]) for name, a in (("q", q), ("k", k), ("v", v)))
    for name, a in (("q", q), ("k", k), ("v", v)):
        f16_range(name, a)
    return q, k, v


def device_token(cfg: Geometry, arrays: dict) -> None:
    """step_device's q, k, v, out: Taichi float32 ndarrays of the token's shapes (values are scanned on the
    device: kernels/token_scan.build_token_scan)."""
    import taichi as ti

    shapes = token_shapes(cfg)
    for name, a in arrays.items():
        if not isinstance(a, ti.Ndarray) or tuple(a.shape) != shapes[name] or a.dtype != ti.f32:
            got = f"{a.dtype} ndarray of shape {tuple(a.shape)}" if isinstance(a, ti.Ndarray) else type(a).__name__
            raise EngineError(f"step_device {name}: expected a Taichi float32 ndarray of shape {shapes[name]}, got {got}")


__all__ = ["capacity", "choice", "device_token", "f16_range", "host_array", "integer", "position", "prefill_tokens",
           "step_token", "token_shapes"]
