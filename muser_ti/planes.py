"""The KV planes and their explicit origins (the chapter's Ch 15 arithmetic).

Two plane shapes, one addressing rule:

* SWA layers keep a **token-major ring**: one row per token holding every KV head
  (row stride n_kv_heads*head_dim halves, 256 for Glimmer).  Storage ``[layer, row, kv_head, d]``.
* NoPE layers keep a **head-major growing plane**: one row per (KV head, token), row stride head_dim.
  Storage ``[layer, kv_head, row, d]``.  It grows on demand (doubling, never past its cap) and never wraps.

On the device both are packed two halves to a u32 word (kernels/halves.py): the same bytes, a last
dimension of head_dim / 2 words; every host view (Engine.plane_halves) is float16 of the shapes above.

Every plane carries ``len, capacity, origin_logical, origin_physical`` and a logical token maps to
``physical = (origin_physical + logical - origin_logical) % capacity``.  ``origin_logical`` is always
the oldest token the plane still holds.  All layers of one class append on every token and rewind
together, so one :class:`PlaneState` describes every plane of the class; the ladder still evaluates
its predicates per layer against that layer's plane.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .config import NOPE, SWA, Geometry
from .errors import PlaneError

NOPE_INITIAL_ROWS = 64  # first allocation of a growing plane (>= 32, so a normal session is vec-eligible)


def fresh_capacity(cap: int, rows: int) -> int:
    """The allocation a growing plane of at most ``cap`` rows has once it holds ``rows``, grown from its first
    (NOPE_INITIAL_ROWS, doubled as needed): what a snapshot's NoPE plane is loaded into, whatever size the
    file says the saving engine's plane had (a file does not choose how much memory a load takes)."""
    capacity = min(cap, NOPE_INITIAL_ROWS)
    while capacity < rows:
        capacity *= 2
    return min(capacity, cap)


def plane_shape(cfg: Geometry, kind: str, n_layers: int, rows: int) -> tuple[int, int, int, int]:
    """Storage shape of a class's planes: token-major ring for SWA, head-major plane for NoPE."""
    if kind == SWA:
        return (n_layers, rows, cfg.n_kv_heads, cfg.head_dim)
    return (n_layers, cfg.n_kv_heads, rows, cfg.head_dim)




@dataclass(frozen=True)
class PlaneState:
    """Occupancy and origins of a plane; immutable so a rejected step changes nothing."""

    len: int
    capacity: int
    origin_logical: int = 0
    origin_physical: int = 0

    def physical(self, logical: int) -> int:
        return (self.origin_physical + logical - self.origin_logical) % self.capacity

    @property
    def first_held(self) -> int:
        """Oldest logical token held (== origin_logical)."""
        return self.origin_logical

    @property
    def is_wrapped(self) -> bool:
        return self.origin_physical != 0

    @property
    def is_partially_wrapped(self) -> bool:
        """Rows are not one contiguous span: the state the vec route's contiguity clause excludes."""
        return self.origin_physical != 0 and self.len != self.capacity

    def after_append(self, position: int) -> "PlaneState":
        """State once the token at ``position`` (== origin_logical + len) is written."""
        # built directly (dataclasses.replace costs twice as much): this runs for every plane class on every
        # decode step, inside the host's share of a short step
        if self.len < self.capacity:
            return PlaneState(self.len + 1, self.capacity, self.origin_logical, self.origin_physical)
        # Full: the new token takes the oldest token's slot and the origin moves past it.
        return PlaneState(self.len, self.capacity, self.origin_logical + 1, (self.origin_physical + 1) % self.capacity)

    def after_rewind(self, drop: int) -> "PlaneState":
        """State once the newest ``drop`` tokens are forgotten (origins stay: rows do not move)."""
        return replace(self, len=self.len - drop)

    def with_capacity(self, capacity: int) -> "PlaneState":
        """Same tokens in a larger allocation; only legal for an unwrapped plane (rows keep their index)."""
        assert self.origin_physical == 0 and capacity >= self.len
        return replace(self, capacity=capacity)


def window_of(geom: Geometry, kind: str) -> int:
    """Window as the kernels take it: 0 means full context (NoPE)."""
    return geom.window if kind == SWA else 0


def visible_span(geom: Geometry, kind: str, position: int) -> tuple[int, int]:
    """(logical_start, visible) of a layer at absolute position: the chapter's §16.4 lines."""
    visible = geom.visible(kind, position)
    return position + 1 - visible, visible


class PlaneSet:
    """Host-side bookkeeping for all planes of one layer class; the device arrays live in the engine.

    ``cap`` is the most rows the plane may ever hold: the ring size for SWA (fixed), the growth limit
    for NoPE.
    """

    def __init__(self, geom: Geometry, kind: str, layers: tuple[int, ...], cap: int):
        if cap < 1:
            raise PlaneError(f"{kind} plane capacity must be >= 1, got {cap}")
        self.geom = geom
        self.kind = kind
        self.layers = layers
        self.cap = cap
        initial = cap if kind == SWA else min(cap, NOPE_INITIAL_ROWS)
        self.state = PlaneState(len=0, capacity=initial)

    @property
    def window(self) -> int:
        return window_of(self.geom, self.kind)

    # -- checks made before anything is written --------------------------------------------------
    def check_append(self, position: int, state: PlaneState | None = None) -> PlaneState:
        """The state after appending ``position`` to ``state`` (the plane's own by default), or PlaneError if
        the plane cannot hold its window.  A state passed in plans several tokens ahead (Engine.token(n))."""
        st = self.state if state is None else state
        if st.len and st.origin_logical + st.len != position:
            raise PlaneError(f"{self.kind} plane holds tokens up to {st.origin_logical + st.len - 1}, cannot append {position}")
        if self.kind == NOPE and st.len + 1 > self.cap:
            raise PlaneError(
                f"NoPE plane is at its capacity of {self.cap} rows (max_context or the session's capacity); "
                f"cannot append token {position}"
            )
        if self.kind == NOPE and st.len + 1 > st.capacity:
            st = st.with_capacity(self.grown_capacity(st.len + 1, st.capacity))
        new = st.after_append(position)
        logical_start, visible = visible_span(self.geom, self.kind, position)
        if new.origin_logical > logical_start:
            raise self._too_small(new.capacity, visible, position)
        return new

    def _too_small(self, capacity: int, visible: int, position: int) -> PlaneError:
        """A ring too small for the rows its window sees at ``position``: the least capacity that holds them (the
        window's rows so far, not yet the whole window where the session is younger than it)."""
        later = f", and {self.geom.window} (the window) once the session is that long" if visible < self.geom.window else ""
        return PlaneError(f"{self.kind} ring of capacity {capacity} cannot hold the {visible} rows its window sees at "
                          f"position {position} (the current token included; window {self.geom.window}); it needs a "
                          f"capacity >= {visible}{later}")

    def grown_capacity(self, needed: int, capacity: int | None = None) -> int:
        """Amortised doubling, capped: the next allocation of a growing plane (now ``capacity``, the plane's own
        by default)."""
        cap = max(self.state.capacity if capacity is None else capacity, 1)
        while cap < needed:
            cap *= 2
        return min(cap, self.cap)

    def check_rewind(self, position: int, current: int) -> PlaneState:
        """State after dropping tokens >= position, or PlaneError if the plane no longer holds what the
        next token at ``position`` would need to see."""
        drop = current - position
        st = self.state
        logical_start, visible = visible_span(self.geom, self.kind, position)
        if position < st.origin_logical or st.origin_logical > logical_start:
            raise PlaneError(
                f"cannot rewind to {position}: the {self.kind} plane of capacity {st.capacity} no longer holds "
                f"token {logical_start} (oldest held is {st.origin_logical}); a ring only rolls back as far as "
                f"its slack beyond the window ({st.capacity - self.geom.window if self.kind == SWA else 0} rows) allows"
            )
        return st.after_rewind(drop)

    def check_prefill(self, position: int, n_tokens: int) -> PlaneState:
        """State after appending n_tokens starting at position (same checks as n appends)."""
        st = self.state
        if self.kind == NOPE:
            if st.len + n_tokens > self.cap:
                raise PlaneError(
                    f"NoPE plane would exceed its capacity of {self.cap} rows with {n_tokens} more tokens at position {position}"
                )
            if st.len + n_tokens > st.capacity:
                st = st.with_capacity(self.grown_capacity(st.len + n_tokens))
            return replace(st, len=st.len + n_tokens)
        # Ring: the closed form of n appends.
        end = position + n_tokens  # next position after the prefill
        total = st.len + n_tokens
        if total <= st.capacity:
            new = replace(st, len=total)
        else:
            evicted = total - st.capacity
            new = replace(
                st,
                len=st.capacity,
                origin_logical=st.origin_logical + evicted,
                origin_physical=(st.origin_physical + evicted) % st.capacity,
            )
        last = end - 1
        logical_start, visible = visible_span(self.geom, self.kind, last)
        if new.origin_logical > logical_start:
            raise self._too_small(new.capacity, visible, last)
        return new


def ring_rows_to_write(state_before: PlaneState, position: int, n_tokens: int) -> tuple[int, np.ndarray]:
    """For a prefill into a ring: (index of the first token worth writing, its physical rows).

    Only the last ``capacity`` tokens survive, so only they are written: parallel writes of two tokens
    to one slot would race.
    """
    keep = min(n_tokens, state_before.capacity)
    first = n_tokens - keep
    logicals = np.arange(position + first, position + n_tokens, dtype=np.int64)
    # Where each of them lands once the ring has taken all n tokens: the same slot arithmetic as appends.
    base_slot = state_before.physical(position) if state_before.capacity else 0
    rows = (base_slot + (logicals - position)) % state_before.capacity
    return first, rows.astype(np.int32)
