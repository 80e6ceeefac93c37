"""The route ladder (chapter §16.0): which kernel reads the cache, per layer, per token.

The predicates are the chapter's, clause for clause, evaluated on the plane *after* the append:

    llama_vec_rows = (strict_attention || has_llama_flash_attn_vec())
        && plane.len > 0
        && plane.capacity >= 32            // the vec kernel reads KV in 32-row blocks
        && (plane.origin_physical == 0 || plane.len == plane.capacity)   // contiguous span
    llama_swa = llama_vec_rows && plane.len % 32 == 0   // token-major rows cannot be padded

    SWA  -> llama_vec_swa  if llama_swa       else splitk
    NoPE -> llama_vec_nope if llama_vec_rows  else interleaved
"""

from __future__ import annotations

import os
from collections import Counter

from .config import NOPE, SWA
from .errors import RouteError
from .planes import PlaneState

STRICT_ENV = "MUSER_CROSS_VENDOR_QK"
VEC_BLOCK_ROWS = 32  # the pinned vec kernel's KV read granularity (ncpsg = 32)

LLAMA_VEC_SWA = "llama_vec_swa"
SPLITK = "splitk"
LLAMA_VEC_NOPE = "llama_vec_nope"
INTERLEAVED = "interleaved"
ROUTES = (LLAMA_VEC_SWA, SPLITK, LLAMA_VEC_NOPE, INTERLEAVED)
ROUTE_KIND = {LLAMA_VEC_SWA: SWA, SPLITK: SWA, LLAMA_VEC_NOPE: NOPE, INTERLEAVED: NOPE}
PINNED_ROUTES = (LLAMA_VEC_SWA, LLAMA_VEC_NOPE)




def strict_attention() -> bool:
    """The cross-vendor switch: set (to anything) makes the vec clause ignore the library check."""
    return os.environ.get(STRICT_ENV) is not None


def llama_vec_rows(plane: PlaneState, pinned_loaded: bool, strict: bool) -> bool:
    return (
        (strict or pinned_loaded)
        and plane.len > 0
        # The pinned vec kernel rounds KV reads to a 32-row block; a deliberately tiny session
        # with a smaller allocation would be read past its end ("poison the full distribution with NaNs").
        and plane.capacity >= VEC_BLOCK_ROWS
        # Contiguous span: unwrapped, or a full ring (every slot in-window; softmax is permutation-invariant).
        and (plane.origin_physical == 0 or plane.len == plane.capacity)
    )


def llama_swa(plane: PlaneState, pinned_loaded: bool, strict: bool) -> bool:
    # Token-major rows are a full token (nb11 = n_kv*head_dim halves), so llama's pad kernel cannot
    # patch a ragged last block: take the vec path only when it never pads.
    return llama_vec_rows(plane, pinned_loaded, strict) and plane.len % VEC_BLOCK_ROWS == 0


def choose_route(kind: str, plane: PlaneState, pinned_loaded: bool, strict: bool) -> str:
    if kind == SWA:
        return LLAMA_VEC_SWA if llama_swa(plane, pinned_loaded, strict) else SPLITK
    return LLAMA_VEC_NOPE if llama_vec_rows(plane, pinned_loaded, strict) else INTERLEAVED


def route_allowed(route: str, kind: str, plane: PlaneState, pinned_loaded: bool, strict: bool) -> bool:
    """May ``route`` run on a layer of ``kind`` with this plane?  The fallbacks always may on their
    own class (they address any plane state); the vec routes only where their predicate holds."""
    if ROUTE_KIND[route] != kind:
        return False
    if route == LLAMA_VEC_SWA:
        return llama_swa(plane, pinned_loaded, strict)
    if route == LLAMA_VEC_NOPE:
        return llama_vec_rows(plane, pinned_loaded, strict)
    return True


def select(kind: str, plane: PlaneState, pinned_loaded: bool, strict: bool, forced: str | None, layer: int) -> str:
    """The route for one layer this token: the ladder's choice, or a forced route if its predicate holds."""
    if forced is None:
        return choose_route(kind, plane, pinned_loaded, strict)
    if forced not in ROUTES:
        raise RouteError(f"unknown route {forced!r}; routes are {list(ROUTES)}")
    if ROUTE_KIND[forced] != kind:
        raise RouteError(f"route {forced!r} serves {ROUTE_KIND[forced]} layers; layer {layer} is {kind}")
    if not route_allowed(forced, kind, plane, pinned_loaded, strict):
        raise RouteError(
            f"route {forced!r} forced on layer {layer} but its predicate fails: "
            f"{'; '.join(failing_clauses(forced, plane, pinned_loaded, strict))} (plane len={plane.len}, "
            f"capacity={plane.capacity}, origin_physical={plane.origin_physical})"
        )
    return forced


def failing_clauses(route: str, plane: PlaneState, pinned_loaded: bool, strict: bool) -> list[str]:
    """The clauses of a vec route's predicate that fail on ``plane``, each with what would make it hold."""
    out = []
    if not (strict or pinned_loaded):
        out.append(f"the pinned library is not in use (pinned='on' puts it in use where it loads; {STRICT_ENV} set "
                   f"skips this clause)")
    if plane.len == 0:
        out.append("the plane is empty")
    if plane.capacity < VEC_BLOCK_ROWS:
        out.append(f"its capacity {plane.capacity} is under {VEC_BLOCK_ROWS} rows, the kernel's read block")
    if not (plane.origin_physical == 0 or plane.len == plane.capacity):
        out.append("the ring is partially wrapped: its rows are not one span until it is full")
    if route == LLAMA_VEC_SWA and plane.len % VEC_BLOCK_ROWS:
        out.append(f"len {plane.len} is not a multiple of {VEC_BLOCK_ROWS} (the kernel cannot pad a ring's ragged "
                   f"last block)")
    return out


def parse_force(force, layer_kinds: tuple[str, ...]) -> dict[int, str]:
    """Engine(force=...) as {layer: route}: a route name forces every layer of its class; a dict names
    layers one by one.  Unknown routes and layers are refused here; a predicate is checked per step."""
    if force is None:
        return {}
    if isinstance(force, str):
        if force not in ROUTES:
            raise RouteError(f"unknown route {force!r}; routes are {list(ROUTES)}")
        return {i: force for i, kind in enumerate(layer_kinds) if kind == ROUTE_KIND[force]}
    out = {}
    for layer, route in dict(force).items():
        if not (isinstance(layer, int) and 0 <= layer < len(layer_kinds)):
            raise RouteError(f"force: layer {layer!r} is not in [0, {len(layer_kinds)})")
        if route not in ROUTES:
            raise RouteError(f"force: unknown route {route!r} for layer {layer}; routes are {list(ROUTES)}")
        out[layer] = route
    return out


class RouteLog:
    """The routes a session took: each layer's route for the last token (``last``) and layer-steps per route
    over every accepted token (``counts()``, restored with a snapshot).  Kept as steps per route mix (the
    whole model's routes, a tuple): a step adds 1 to one count instead of one per layer, and the per-route
    sums are made when they are read; an unforced step's mix is made once per class routes."""

    def __init__(self, layer_kinds: tuple[str, ...]):
        self.layer_kinds = layer_kinds
        self.last: list[str | None] = [None] * len(layer_kinds)
        self._steps_by_mix: dict[tuple[str, ...], int] = {}
        self._restored: Counter = Counter()
        self._mixes: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._serial = 0  # the commit last counted

    def mix_of(self, chosen: dict[str, str]) -> tuple[str, ...]:
        """Every layer's route when each class takes its ``chosen`` route."""
        key = tuple(chosen.values())
        mix = self._mixes.get(key)
        if mix is None:
            mix = self._mixes[key] = tuple(chosen[kind] for kind in self.layer_kinds)
        return mix

    def record(self, routes: list[str], mix: tuple[str, ...], serial: int) -> None:
        """One accepted step, commit ``serial``: recording it again (a retried commit) counts it once."""
        self.last = routes
        if serial != self._serial:  # one statement: the count and the serial that guards it land together
            self._steps_by_mix, self._serial = {**self._steps_by_mix, mix: self._steps_by_mix.get(mix, 0) + 1}, serial

    def record_many(self, steps: list[tuple[list[str], tuple[str, ...]]], serial: int) -> None:
        """Several accepted tokens in one commit ``serial`` (Engine.token(n)): each (routes, mix) counts once,
        and a retried commit counts none of them again; ``last`` is the last token's routes."""
        self.last = steps[-1][0]
        if serial != self._serial:
            counts = dict(self._steps_by_mix)
            for _, mix in steps:
                counts[mix] = counts.get(mix, 0) + 1
            self._steps_by_mix, self._serial = counts, serial

    def undo(self, mix: tuple[str, ...], last: list[str | None]) -> None:
        """Forget one recorded step (a token the device refused after it was counted)."""
        self._steps_by_mix[mix] -= 1
        self.last = last

    def counts(self) -> Counter:
        counts = Counter(self._restored)
        for mix, steps in self._steps_by_mix.items():
            if steps:
                for route, layers in Counter(mix).items():
                    counts[route] += layers * steps
        return counts

    def restore(self, counts) -> None:
        self._restored = Counter(counts)
        self._steps_by_mix = {}

