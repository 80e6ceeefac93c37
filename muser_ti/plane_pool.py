"""A batch's planes in one pool: every sequence slot's planes of a layer class in one K array and one V array.

A kernel that attends several sequences in one launch reads them from one array, so a batch's slots share their
planes' allocations: class ``kind``'s plane slot ``s * n + i`` (n: the class's layer count) is sequence slot s's
i-th layer of the class.  Each slot's :class:`~muser_ti.kv_cache.KVCache` keeps its own bookkeeping (len, origins)
and addresses the pool from its ``slot_base``; every kernel already takes a plane-slot table, so one engine's
kernels run on a pooled cache unchanged.

Sizes: a ring (SWA) is window + slack rows in every slot, fixed.  A growing (NoPE) plane has one capacity for the
whole pool, the most any slot needs: ``Batch(context=N)`` allocates N rows a slot up front (the pool never grows),
and without ``context`` the pool grows by doubling when a sequence needs more, every slot's rows moved in one copy.
A NoPE plane's origins are always 0, so its capacity only says where rows live, never which row a token is in:
every slot's plane state follows the pool's capacity (``KVCache.set_state``), whatever capacity a plan made
before a growth said.

Why slots and not pages: the ladder's kernels address a plane as contiguous rows (llama.cpp's vec rung included);
FlashInfer's and vLLM's pages let a sequence take memory as it grows and share prefixes, at the cost of a page
table in every kernel.  Here a short sequence beside a long one holds the long one's NoPE capacity.
"""

from __future__ import annotations

from .config import Geometry
from .kernels import halves
from .kernels.stores import build_stores
from .kv_cache import LAYOUT_OF
from .planes import plane_shape


class PlanePool:
    """The planes of ``slots`` sequence slots on ``cfg``; ``caps``: each class's initial capacity in rows."""

    def __init__(self, cfg: Geometry, slots: int, caps: dict[str, int]):
        self.cfg, self.slots = cfg, slots
        self.n_layers = {kind: len(getattr(cfg, f"{kind}_layers")) for kind in caps}
        self.capacity = dict(caps)
        self.k, self.v = {}, {}
        for kind, cap in caps.items():
            self.k[kind], self.v[kind] = self._alloc(kind, cap)
        self.members: list = []  # the slots' caches, told when an array moves (grow)

    def _alloc(self, kind: str, capacity: int):
        shape = plane_shape(self.cfg, kind, self.slots * self.n_layers[kind], capacity)
        return halves.alloc(shape), halves.alloc(shape)

    def base(self, kind: str, slot: int) -> int:
        """The first plane slot of sequence slot ``slot``'s layers of class ``kind``."""
        return slot * self.n_layers[kind]

    def grow(self, kind: str, capacity: int) -> None:
        """Every slot's growing plane into ``capacity`` rows (no smaller: a no-op): one copy of every slot's rows,
        then every member cache points at the new arrays with its state's capacity the pool's."""
        old = self.capacity[kind]
        if capacity <= old:
            return
        k_new, v_new = self._alloc(kind, capacity)
        copy = build_stores(self.cfg.head_dim, self.cfg.n_kv_heads, LAYOUT_OF[kind]).copy_rows
        n_slots = self.slots * self.n_layers[kind]
        copy(self.k[kind], k_new, n_slots, old)
        copy(self.v[kind], v_new, n_slots, old)
        self.k[kind], self.v[kind] = k_new, v_new
        self.capacity[kind] = capacity
        for cache in self.members:
            cache.pool_moved(kind)

    def nbytes(self) -> int:
        """Bytes the pool's K and V arrays hold."""
        return sum(2 * int(a.shape[0]) * int(a.shape[1]) * int(a.shape[2]) * int(a.shape[3]) * 4
                   for a in self.k.values())


__all__ = ["PlanePool"]
