"""The KV cache: every layer class's planes, on the device and in the host's bookkeeping.

One :class:`KVCache` owns, for each layer class (SWA rings, NoPE growing planes):

* the host bookkeeping (:class:`~muser_ti.planes.PlaneSet`: len, capacity, origins, the most rows it may
  hold) and the device arrays (packed f16 planes, kernels/halves.py), always in step;
* the stores that are not part of a route (prefill, the grow copy of a NoPE plane that doubles);
* the mirror planes the pinned Metal rung reads, and the serving graph's llama cell-order cache, which
  follow every store (muser_ti/pinned/);
* the one capacity rule (:meth:`KVCache.caps`) and the snapshot's view of the cache
  (:meth:`state_dict` / :meth:`load_state_dict`, as mlx-lm's caches keep ``state`` and ``meta_state``).

Every change is planned first (``plan_*``: the new plane states, or a PlaneError, nothing written) and
then committed; the engine orders the device writes between the two.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import taichi as ti

from . import backend
from .config import NOPE, SWA, Geometry
from .errors import EngineError, PlaneError
from .kernels import halves
from .kernels.common import HEAD_MAJOR, TOKEN_MAJOR
from .kernels.stores import build_stores
from .planes import PlaneSet, PlaneState, plane_shape, ring_rows_to_write

LAYOUT_OF = {SWA: TOKEN_MAJOR, NOPE: HEAD_MAJOR}
STATE_FIELDS = ("len", "capacity", "origin_logical", "origin_physical")
PLANE_DTYPE = np.float16


class LayerGroup(NamedTuple):
    """The layers of one launch and their plane slots, on the host and as device arrays."""

    layers: tuple[int, ...]
    slots: tuple[int, ...]
    layers_dev: object
    slots_dev: object


class KVCache:
    """Every class's planes.  ``capacity``: the per-session override of every plane's capacity (the
    Engine's argument); ``mirror_backing``: where mirror planes live (muser_ti/pinned/mirror.py), or None
    for none; ``serving``: keep llama.cpp's cell-order SWA cache for the serving graph."""

    def __init__(self, cfg: Geometry, capacity: int | None = None, mirror_backing=None, serving: bool = False,
                 pool_slot: tuple | None = None):
        self.cfg = cfg
        self._generation = backend.generation()
        caps = self.caps(cfg, capacity)
        self.planes: dict[str, PlaneSet] = {kind: PlaneSet(cfg, kind, getattr(cfg, f"{kind}_layers"), cap)
                                            for kind, cap in caps.items()}
        # a layer's plane slot among its class's layers (host copies: halves, host_views); the device's plane slot
        # is slot_base[kind] + that (a batch's pool holds several caches' planes, plane_pool.py)
        self.slot = {layer: i for ps in self.planes.values() for i, layer in enumerate(ps.layers)}
        self.k: dict[str, object] = {}
        self.v: dict[str, object] = {}
        self.pool, self.slot_base = None, {kind: 0 for kind in self.planes}
        if pool_slot is not None:
            if mirror_backing is not None or serving:
                raise EngineError("a batch's pooled planes carry no mirror planes or serving cells (pinned Metal rung, "
                                  "graph='serving'); use one engine per sequence for those")
            self.pool, index = pool_slot
            self.slot_base = {kind: self.pool.base(kind, index) for kind in self.planes}
            self.pool.members.append(self)
            for kind in self.planes:
                self.pool_moved(kind)
        else:
            for kind, ps in self.planes.items():
                self.k[kind], self.v[kind] = self.alloc(kind, ps.state.capacity)
        self.stores = {kind: build_stores(cfg.head_dim, cfg.n_kv_heads, LAYOUT_OF[kind]) for kind in self.planes}
        self.mirror = None
        if mirror_backing is not None:
            from .pinned.mirror import PlaneMirror

            self.mirror = PlaneMirror(cfg, mirror_backing, {kind: ps.state for kind, ps in self.planes.items()})
        self.serving = None
        if serving and SWA in self.planes:
            from .pinned.llama_rung import ServingCache

            zeros = mirror_backing.zeros if mirror_backing is not None else np.zeros  # Metal: cells the bridge reads
            self.serving = ServingCache(len(self.planes[SWA].layers), cfg.window, cfg.n_ubatch, cfg.n_kv_heads,
                                        cfg.head_dim, zeros)
        self.position = 0  # the next token's absolute position: every plane holds the tokens before it
        self._groups: dict[tuple[int, ...], LayerGroup] = {}
        self._kept: dict[tuple[str, int], tuple] = {}  # kept_rows' arrays, by class and rows

    # ---- the capacity rule ---------------------------------------------------------------------
    @staticmethod
    def caps(cfg: Geometry, capacity: int | None) -> dict[str, int]:
        """The most rows each class's plane may hold: the ring (window + slack) and max_context, or the
        session's ``capacity`` for both (a NoPE plane never past max_context)."""
        out = {}
        if cfg.swa_layers:
            out[SWA] = capacity if capacity is not None else cfg.swa_ring_capacity
        if cfg.nope_layers:
            out[NOPE] = min(capacity, cfg.max_context) if capacity is not None else cfg.max_context
        return out

    @classmethod
    def session_capacity(cls, cfg: Geometry, caps: dict[str, int]):
        """The ``capacity`` argument that gives these caps: None for the geometry's own, an int, or False
        where none does (a forged or inconsistent snapshot)."""
        for candidate in (None, caps.get(NOPE), caps.get(SWA)):
            if (candidate is None or candidate >= 1) and cls.caps(cfg, candidate) == caps:
                return candidate
        return False

    # ---- device arrays -------------------------------------------------------------------------
    def check_alive(self) -> None:
        if backend.generation() != self._generation:
            raise EngineError("Taichi was re-initialised for another arch since this engine was made; its planes are gone")

    def alloc(self, kind: str, capacity: int):
        shape = plane_shape(self.cfg, kind, len(self.planes[kind].layers), capacity)
        return halves.alloc(shape), halves.alloc(shape)

    def pool_moved(self, kind: str) -> None:
        """The pool's arrays of ``kind`` (new, or grown): this cache's planes and capacity follow them."""
        self.k[kind], self.v[kind] = self.pool.k[kind], self.pool.v[kind]
        st = self.planes[kind].state
        if st.capacity != self.pool.capacity[kind]:
            self.planes[kind].state = st.with_capacity(self.pool.capacity[kind])

    def device_slot(self, layer: int) -> int:
        """The plane slot of ``layer`` in the device arrays (its pool's, or its own)."""
        return self.slot_base[self.cfg.layer_kinds[layer]] + self.slot[layer]

    def group(self, layers: tuple[int, ...]) -> LayerGroup:
        """The layer list of one launch (device arrays made once per composition)."""
        grp = self._groups.get(layers)
        if grp is None:
            slots = tuple(self.device_slot(layer) for layer in layers)
            ld, sd = ti.ndarray(ti.i32, (len(layers),)), ti.ndarray(ti.i32, (len(layers),))
            ld.from_numpy(np.asarray(layers, np.int32))
            sd.from_numpy(np.asarray(slots, np.int32))
            grp = self._groups[layers] = LayerGroup(layers, slots, ld, sd)
        return grp

    def token_group(self, layer: int) -> LayerGroup:
        """One layer's launch when its activations come alone ([1, ...]: a per-layer token): activation row 0,
        the layer's plane slot."""
        key = ("token", layer)
        grp = self._groups.get(key)
        if grp is None:
            ld, sd = ti.ndarray(ti.i32, (1,)), ti.ndarray(ti.i32, (1,))
            ld.from_numpy(np.zeros(1, np.int32))
            sd.from_numpy(np.asarray([self.device_slot(layer)], np.int32))
            grp = self._groups[key] = LayerGroup((0,), (self.device_slot(layer),), ld, sd)
        return grp

    def kept_rows(self, kind: str, rows: int) -> tuple:
        """Packed K and V arrays [rows, the class's layers, kv heads, head_dim] for the rows an open token overwrites
        (token.py), made once a size: one token is open at a time, and a new array every token cost ~0.1 ms each on
        the CPU (Taichi's allocation)."""
        got = self._kept.get((kind, rows))
        if got is None:
            shape = (rows, len(self.planes[kind].layers), self.cfg.n_kv_heads, self.cfg.head_dim)
            got = self._kept[kind, rows] = (halves.alloc(shape), halves.alloc(shape))
        return got

    def ensure_capacity(self, kind: str, capacity: int) -> None:
        """A growing plane moves its live rows into a larger allocation (amortised doubling)."""
        ps = self.planes[kind]
        if self.pool is not None:  # the whole pool grows (or already holds it): every slot's capacity follows
            self.pool.grow(kind, capacity)
            return
        if capacity == ps.state.capacity:
            return
        k_new, v_new = self.alloc(kind, capacity)
        copy = self.stores[kind].copy_rows
        copy(self.k[kind], k_new, len(ps.layers), ps.state.len)
        copy(self.v[kind], v_new, len(ps.layers), ps.state.len)
        self.k[kind], self.v[kind] = k_new, v_new
        if self.mirror is not None:
            self.mirror.grow(kind, capacity)
        self.set_state(kind, ps.state.with_capacity(capacity))

    def set_state(self, kind: str, st: PlaneState) -> None:
        """Every plane-state change goes through here, so the mirror's bookkeeping follows the planes.  A pooled
        growing plane keeps the pool's capacity whatever a plan made before a growth said (its origins are 0: the
        capacity only sizes the allocation, plane_pool.py)."""
        if self.pool is not None and st.capacity != self.pool.capacity[kind]:
            st = st.with_capacity(self.pool.capacity[kind])
        self.planes[kind].state = st
        if self.mirror is not None:
            self.mirror.set_state(kind, st)

    # ---- plan (nothing written), then commit ---------------------------------------------------
    def plan_append(self) -> dict[str, PlaneState]:
        """Every class's state once the token at ``position`` is appended (PlaneError if one cannot be)."""
        return {kind: ps.check_append(self.position) for kind, ps in self.planes.items()}

    def plan_prefill(self, n: int) -> dict[str, PlaneState]:
        return {kind: ps.check_prefill(self.position, n) for kind, ps in self.planes.items()}

    def plan_rewind(self, position: int) -> dict[str, PlaneState]:
        states = {kind: ps.check_rewind(position, self.position) for kind, ps in self.planes.items()}
        missing = self.serving.first_missing(position) if self.serving is not None else None
        if missing is not None:
            raise PlaneError(f"cannot rewind to {position}: the serving graph's llama.cpp cells ({self.serving.cells}) no "
                             f"longer hold token {missing}, which the next token attends (they roll back only "
                             f"{self.serving.cells - self.cfg.window} tokens past the window, whatever the ring's slack)")
        return states

    def write_prefill(self, k: np.ndarray, v: np.ndarray, states: dict[str, PlaneState],
                      new_states: dict[str, PlaneState], start: int, to_device) -> None:
        """Store n checked tokens (k, v float32 [n, layers, kv heads, d]) from position ``start`` into planes that
        were in ``states``: the planes (grown first where they must), the mirror and the serving cells;
        ``to_device(a)`` hands a host array to the kernels (zero-copy on the CPU).  Every write is placed from the
        states passed in, never the live ones, so a prefill cut short anywhere (its commit half done included)
        is completed by running this once more; the states are committed after it (commit)."""
        n = k.shape[0]
        for kind, ps in self.planes.items():
            self.ensure_capacity(kind, new_states[kind].capacity)
            before = states[kind]
            if kind == SWA:
                first, rows = ring_rows_to_write(before, start, n)
            else:
                first, rows = 0, np.arange(before.len, before.len + n, dtype=np.int32)
            grp = self.group(ps.layers)
            rows_dev = ti.ndarray(ti.i32, (len(rows),))
            rows_dev.from_numpy(rows)
            self.stores[kind].store_tokens(to_device(k), to_device(v), self.k[kind], self.v[kind], grp.layers_dev,
                                           grp.slots_dev, len(ps.layers), rows_dev, first, len(rows))
            if self.mirror is not None:  # the same rows from the same f32 tokens: O(rows written)
                self.mirror.store(kind, rows, k[first:], v[first:])
        if self.serving is not None:
            keep = min(n, self.serving.cells)
            swa = list(self.planes[SWA].layers)
            for t in range(n - keep, n):
                self.serving.stage(start + t, k[t][swa].astype(np.float16), v[t][swa].astype(np.float16))

    def mirror_token(self, new_states: dict[str, PlaneState], k: np.ndarray, v: np.ndarray, position: int) -> None:
        """The token at ``position`` into the mirror planes, at the row every route stores it in."""
        if self.mirror is not None:
            for kind, st in new_states.items():
                self.mirror.store(kind, [st.physical(position)], k[None], v[None])

    def states(self) -> dict[str, PlaneState]:
        return {kind: ps.state for kind, ps in self.planes.items()}

    def commit(self, states: dict[str, PlaneState], position: int) -> None:
        """Every class's state and the position, set (not stepped): committing twice is committing once.  Also how
        the engine goes back to earlier states (a deferred refusal: tokens the device never wrote)."""
        for kind, st in states.items():
            self.set_state(kind, st)
        self.position = position

    def clear(self) -> None:
        """Empty, on the planes it has (no allocation, no data moves: rows past len are dead): a batch's slot
        reused by the next sequence.  Mirror and serving copies have their own bookkeeping: not cleared here."""
        if self.mirror is not None or self.serving is not None:
            raise EngineError("clear: mirror planes or the serving graph's cells are not cleared in place; build a new "
                              "engine")
        self.commit({kind: PlaneState(len=0, capacity=ps.state.capacity) for kind, ps in self.planes.items()}, 0)

    def rewind(self, position: int, new_states: dict[str, PlaneState]) -> None:
        """Forget tokens >= position: rows past len are dead, so no data moves (planes or mirror)."""
        self.commit(new_states, position)
        if self.serving is not None:
            self.serving.forget_from(position)

    # ---- host views ----------------------------------------------------------------------------
    def _own(self, kind: str, a: np.ndarray) -> np.ndarray:
        """This cache's plane slots of a whole array of its class (a pool's holds other caches' too)."""
        base = self.slot_base[kind]
        return a[base:base + len(self.planes[kind].layers)]

    def halves(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of a class's K and V planes (every layer of the class), float16 [..., head_dim]."""
        return self._own(kind, halves.to_halves(self.k[kind])), self._own(kind, halves.to_halves(self.v[kind]))

    def host_views(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """Zero-copy float16 views of a class's K and V planes (the CPU backend: Taichi's own memory)."""
        return self._own(kind, halves.host_view(self.k[kind])), self._own(kind, halves.host_view(self.v[kind]))

    @staticmethod
    def _pooled_rows(kind: str, rows: np.ndarray, capacity: int) -> np.ndarray:
        """A growing plane's image widened to the pool's capacity (rows past len are dead: zeros)."""
        if rows.shape[2] == capacity:
            return rows
        out = np.zeros((*rows.shape[:2], capacity, rows.shape[3]), PLANE_DTYPE)
        out[:, :, : rows.shape[2]] = rows[:, :, :capacity]
        return out

    def _into_pool(self, kind: str, arr, image: np.ndarray) -> np.ndarray:
        """The pool's whole array with this cache's slots replaced by ``image``: what from_halves writes."""
        whole = halves.to_halves(arr)
        base = self.slot_base[kind]
        whole[base:base + image.shape[0]] = image
        return whole

    # ---- snapshots -----------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, np.ndarray], dict]:
        """(tensors, meta): copies of every plane's rows in the planes' own layouts (a ring whole, a growing
        plane's live rows), the serving cells, and each plane's state and cap; the cache is not changed."""
        self.check_alive()
        tensors, planes = {}, {}
        for kind, ps in self.planes.items():
            st = ps.state
            k, v = self.halves(kind)
            if kind == NOPE:  # growing plane: only the rows tokens own
                k, v = k[:, :, : st.len], v[:, :, : st.len]
            tensors[f"{kind}.k"] = np.ascontiguousarray(k, dtype=PLANE_DTYPE)
            tensors[f"{kind}.v"] = np.ascontiguousarray(v, dtype=PLANE_DTYPE)
            planes[kind] = {**{f: getattr(st, f) for f in STATE_FIELDS}, "cap": ps.cap}
        if self.serving is not None:
            tensors["serving.k"] = np.ascontiguousarray(self.serving.k)
            tensors["serving.v"] = np.ascontiguousarray(self.serving.v)
            tensors["serving.pos"] = np.ascontiguousarray(self.serving.pos, dtype=np.int64)
        return tensors, {"position": self.position, "planes": planes}

    def load_state_dict(self, tensors: dict[str, np.ndarray], meta: dict) -> None:
        """Replace the cache with a state_dict's, validated by the caller against this cache (geometry, caps,
        shapes, values: muser_ti/snapshot.py).  Staged: every image is built and every new device array
        allocated before the first write."""
        self.check_alive()
        staged = {}
        for kind, ps in self.planes.items():
            st = PlaneState(**{f: meta["planes"][kind][f] for f in STATE_FIELDS})
            k, v = tensors[f"{kind}.k"], tensors[f"{kind}.v"]
            if kind == NOPE:
                full_k = np.zeros(plane_shape(self.cfg, kind, k.shape[0], st.capacity), PLANE_DTYPE)
                full_v = np.zeros_like(full_k)
                full_k[:, :, : st.len], full_v[:, :, : st.len] = k, v
                k, v = full_k, full_v
            if self.pool is not None:  # written into this cache's slots of the pool's arrays, as they are
                if kind == NOPE:
                    self.pool.grow(kind, st.capacity)
                    st = st.with_capacity(self.pool.capacity[kind])
                    k, v = self._pooled_rows(kind, k, st.capacity), self._pooled_rows(kind, v, st.capacity)
                dk, dv = self.k[kind], self.v[kind]
                k, v = self._into_pool(kind, dk, k), self._into_pool(kind, dv, v)
            else:
                dk, dv = (self.k[kind], self.v[kind]) if st.capacity == ps.state.capacity else self.alloc(kind,
                                                                                                      st.capacity)
            staged[kind] = (dk, dv, k, v, st)
        for kind, (dk, dv, k, v, st) in staged.items():
            halves.from_halves(dk, k)
            halves.from_halves(dv, v)
            self.k[kind], self.v[kind] = dk, dv
            self.planes[kind].state = st
            if self.mirror is not None:  # the mirror is re-synced in bulk from the file's rows
                self.mirror.load(kind, tensors[f"{kind}.k"], tensors[f"{kind}.v"], st)
        if self.serving is not None:
            self.serving.k[...] = tensors["serving.k"]
            self.serving.v[...] = tensors["serving.v"]
            self.serving.pos[...] = tensors["serving.pos"]
        self.position = meta["position"]


__all__ = ["KVCache", "LAYOUT_OF", "LayerGroup", "PLANE_DTYPE", "STATE_FIELDS"]
