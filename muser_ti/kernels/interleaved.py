"""The ferrite interleaved producer + LSE reducer: the NoPE route without the pinned library (§16.5.3).

Head-major growing plane.  Sibling query heads of one KV head run side by side in one work item
("schedule-only": it changes which head runs beside which, never what any computes).  The store of
the current token is fused into the producer (workgroup 0 writes it), and every workgroup reads the
current token as f32 from k_cur/v_cur, never round-tripped through the f16 plane: the bypass.
The workgroup split follows the same geometry rule as splitk.
"""


import taichi as ti

from .common import HEAD_MAJOR, cached
from .reducer import build_reduce
from .producer import build_producer, plan_key


def build_interleaved(head_dim: int, heads_per_kv: int, n_kv: int, n_heads: int, gpu: bool, record: bool = False,
                      items_cap: int = 0, layers_cap: int = 0, serial: bool = False):
    """(producer, reduce_v2) for the head-major plane; the caps and serial as build_splitk's."""
    producer = cached(
        ("interleaved", head_dim, heads_per_kv, n_kv, gpu, record, plan_key(head_dim, heads_per_kv, gpu), items_cap,
         serial),
        lambda: build_producer(head_dim, heads_per_kv, n_kv, gpu, HEAD_MAJOR, bypass=True, record=record,
                               items_cap=items_cap, serial=serial),
    )
    # reduce_v2: the LSE merge with precise exp, f32 output.
    return producer, build_reduce(head_dim, n_heads, gpu, ti.f32, layers_cap)
