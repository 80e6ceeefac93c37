"""Pieces every kernel family shares: the arch switch, layouts, constants, the kernel cache."""


from typing import Callable

import taichi as ti

from .. import backend

TOKEN_MAJOR = "token_major"  # SWA ring: [layer, row, kv_head, d]
HEAD_MAJOR = "head_major"  # NoPE plane: [layer, kv_head, row, d]

BLOCK_ROWS = 32  # tokens per block: the pinned kernel's read granularity (ncpsg = 32)
MAX_WORKGROUPS = 32  # see split_geometry.MAX_DECODE_SPLIT_WORKGROUPS for why
WORKGROUP_THREADS = 128  # GPU threads per workgroup on the shared-memory path
VISIT_OWNER = 64  # record mode adds 1 + 64*workgroup per visit: count = v % 64, owner = v // 64 (one visit)
RUNNING_MAX_INIT = -3.402823466e38  # finite: exp(M_old - M_new) is 0 on the first block, never NaN

# The columns of a group kernel's per-group table (producer.group_producer_kernel, reducer.build_reduce's
# per_group, stores' store_group): what differs between the sequences of a batch.  ROW: the current token's
# physical row.
GROUP_POSITION, GROUP_ORIGIN_LOGICAL, GROUP_ORIGIN_PHYSICAL, GROUP_NWG, GROUP_NSG, GROUP_ROW = range(6)
GROUP_COLUMNS = 6

f32_3d = ti.types.ndarray(dtype=ti.f32, ndim=3)
f32_4d = ti.types.ndarray(dtype=ti.f32, ndim=4)
i32_1d = ti.types.ndarray(dtype=ti.i32, ndim=1)
i32_2d = ti.types.ndarray(dtype=ti.i32, ndim=2)


def on_gpu() -> bool:
    """True on the archs that take the shared-memory path (CUDA, Vulkan, Metal)."""
    return backend.active() in backend.GPU_ARCHS


_cache: dict = {}


def cached(key: tuple, build: Callable):
    """Build a kernel set once per (Taichi generation, key): kernels close over static geometry."""
    full = (backend.generation(),) + key
    if full not in _cache:
        _cache[full] = build()
    return _cache[full]
