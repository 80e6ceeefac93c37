"""Muser's splitk producer + reducer: the SWA route whenever the pinned vec path is not eligible (§16.5.1).

Token-major ring, addressed through explicit origins; the current token was stored first and is read
back from the f16 plane like every other row (no bypass on this rung).  How a launch splits its rows over
workgroups, for every route, is split_geometry.py.
"""


import taichi as ti

from .common import TOKEN_MAJOR, cached
from .reducer import build_reduce
from .producer import build_producer, plan_key


def build_splitk(head_dim: int, heads_per_kv: int, n_kv: int, n_heads: int, gpu: bool, record: bool = False,
                 items_cap: int = 0, layers_cap: int = 0, serial: bool = False):
    """(producer, reduce_f32, reduce_f16) for the token-major ring; the caps: producer.producer_kernel's
    items_cap and reducer.build_reduce's layers_cap (constant loop bounds on a GPU; 0: none); serial (CPU): the
    producer's items on the launching thread (producer.producer_kernel)."""
    producer = cached(
        ("splitk", head_dim, heads_per_kv, n_kv, gpu, record, plan_key(head_dim, heads_per_kv, gpu), items_cap, serial),
        lambda: build_producer(head_dim, heads_per_kv, n_kv, gpu, TOKEN_MAJOR, bypass=False, record=record,
                               items_cap=items_cap, serial=serial),
    )
    return (producer, build_reduce(head_dim, n_heads, gpu, ti.f32, layers_cap),
            build_reduce(head_dim, n_heads, gpu, ti.f16, layers_cap))
