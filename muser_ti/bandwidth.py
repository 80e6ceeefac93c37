"""The bandwidth arithmetic of §16.7, computed from a geometry (never copied from the chapter).

Decode attention streams each visible KV row once per layer per token.  Per layer:

    bytes = visible x n_kv_heads x 2 (K and V) x head_dim x 2 (f16)

``depth`` here is the number of keys a full-context (NoPE) layer attends for the token being
decoded, i.e. position + 1: the current token included, exactly as the engine's ``visible``.
A SWA layer at that depth attends ``min(depth, window)`` rows, so the SWA total is constant only
once the depth reaches the window (the chapter's "constant" holds from D = window on).

The weight stream (``weight_stream_bytes``) is the other per-token read; the *share* reported is
KV bytes / weight bytes (the chapter's convention: 1.83 GB / 16.76 GB = 10.9 %), not KV's share
of the sum.  Integer byte counts throughout, so the crossover depth is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import NOPE, SWA, Geometry


def row_bytes(g: Geometry) -> int:
    """Bytes one token adds to one layer's cache (1,024 B for Glimmer)."""
    return g.kv_bytes_per_row


def visible_rows(g: Geometry, kind: str, depth: int) -> int:
    """Keys a layer of ``kind`` attends at ``depth`` (= position + 1)."""
    return min(depth, g.window) if kind == SWA else depth


def swa_bytes(g: Geometry, depth: int) -> int:
    """KV bytes every SWA layer together reads at ``depth`` (capped by the window)."""
    return len(g.swa_layers) * visible_rows(g, SWA, depth) * row_bytes(g)


def nope_bytes(g: Geometry, depth: int) -> int:
    """KV bytes every NoPE layer together reads at ``depth`` (grows linearly, never capped)."""
    return len(g.nope_layers) * visible_rows(g, NOPE, depth) * row_bytes(g)


def kv_bytes(g: Geometry, depth: int) -> int:
    return swa_bytes(g, depth) + nope_bytes(g, depth)


def attention_flop(g: Geometry, rows: float) -> float:
    """FLOPs of one token's attention over ``rows`` KV rows (summed over the layers): QK and PV, a multiply and
    an add each, for every query head (each K/V element feeds n_heads / n_kv_heads of them): the CPU's floor."""
    return 4.0 * g.n_heads * g.head_dim * rows


@dataclass(frozen=True)
class DepthRow:
    """One line of the §16.7 table."""

    depth: int
    swa_bytes: int
    nope_bytes: int
    kv_bytes: int
    weight_bytes: int
    share: float | None  # kv_bytes / weight_bytes; None where the config gives no weight stream


def at_depth(g: Geometry, depth: int) -> DepthRow:
    if not 1 <= depth <= g.max_context:
        raise ValueError(f"depth {depth} is outside [1, max_context={g.max_context}]")
    s, n = swa_bytes(g, depth), nope_bytes(g, depth)
    w = g.weight_stream_bytes
    return DepthRow(depth, s, n, s + n, w, (s + n) / w if w else None)


@dataclass(frozen=True)
class Crossover:
    """Where KV reads reach the weight stream.

    depth: the smallest depth with kv_bytes >= weight bytes, ignoring max_context (None if KV never
    gets there: no weight stream given, or only SWA layers whose capped total stays below it).
    within_context: whether that depth is <= max_context (the model can actually be there).
    """

    depth: int | None
    within_context: bool
    reason: str


def crossover(g: Geometry) -> Crossover:
    w = g.weight_stream_bytes
    if not w:
        return Crossover(None, False, "weight_stream_bytes is not given (0): no weight stream to compare with")
    n_nope, n_swa, row = len(g.nope_layers), len(g.swa_layers), row_bytes(g)

    def kv(d: int) -> int:  # same arithmetic as kv_bytes, but valid past max_context too
        return n_swa * min(d, g.window) * row + n_nope * d * row

    # kv(d) is non-decreasing, so bisect on [1, hi] where hi certainly crosses if anything does.
    hi = g.window if not n_nope else max(g.window, -(-w // (n_nope * row)))
    if kv(hi) < w:
        return Crossover(None, False, f"never: SWA-only KV saturates at {kv(hi):,} B < {w:,} B of weights")
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        if kv(mid) >= w:
            hi = mid
        else:
            lo = mid + 1
    inside = lo <= g.max_context
    where = "within" if inside else "beyond"
    return Crossover(lo, inside, f"at depth {lo:,}, {where} max_context={g.max_context:,}")


def default_depths(g: Geometry) -> list[int]:
    """A few depths worth tabulating: the chapter's three (where they fit), the window, max_context."""
    picks = {1, g.window, g.max_context} | {d for d in (2048, 32768, 131072) if d <= g.max_context}
    return sorted(d for d in picks if 1 <= d <= g.max_context)


def explain(g: Geometry, depths: list[int] | None = None) -> list[str]:
    """The §16.7 table for ``g`` as plain lines (scripts/decode.py --explain prints them)."""
    row = row_bytes(g)
    lines = [
        f"{g.name}: {len(g.swa_layers)} SWA layers (window {g.window:,}), {len(g.nope_layers)} NoPE layers, "
        f"max_context {g.max_context:,}",
        f"KV bytes per row per layer: {g.n_kv_heads} kv heads x 2 (K,V) x {g.head_dim} x 2 B = {row:,} B",
        f"SWA total at the window: {len(g.swa_layers)} x {g.window:,} x {row:,} = "
        f"{swa_bytes(g, g.window):,} B ({swa_bytes(g, g.window) / 1e6:.1f} MB)",
        f"NoPE total at depth D: {len(g.nope_layers)} x D x {row:,} = {len(g.nope_layers) * row:,} B x D",
        f"weights per token: {g.weight_stream_bytes:,} B ({g.weight_stream_bytes / 1e9:.2f} GB)",
        "",
        f"{'depth':>9}  {'SWA MB':>9}  {'NoPE MB':>10}  {'KV total MB':>12}  {'share of weights':>16}",
    ]
    for d in depths or default_depths(g):
        r = at_depth(g, d)
        share = f"{100 * r.share:.2f} %" if r.share is not None else "n/a"
        lines.append(f"{d:>9,}  {r.swa_bytes / 1e6:>9.2f}  {r.nope_bytes / 1e6:>10.2f}  {r.kv_bytes / 1e6:>12.2f}  {share:>16}")
    c = crossover(g)
    lines.append("")
    if c.depth is None:
        lines.append(f"KV reads overtake weights: {c.reason}")
    elif c.within_context:
        lines.append(f"KV reads overtake weights {c.reason}")
    else:
        lines.append(f"KV reads overtake weights: none within max_context (crossover {c.reason})")
    return lines
