"""Muser's splitk producer + reducer: the SWA route whenever the pinned vec path is not eligible (§16.5.1).

Token-major ring, addressed through explicit origins; the current token was stored first and is read
back from the f16 plane like every other row (no bypass on this rung).
"""


import os

import taichi as ti

from .common import BLOCK_ROWS, MAX_WORKGROUPS, TOKEN_MAJOR, cached
from .merge import build_reduce
from .producer import build_producer, plan_key

# llama.cpp's Metal flash_attn_ext_vec always launches nwg = 32 and only grows simdgroups (1 -> 4) once
# 2*nwg*nsg*32 < visible.  Ferrite's occupancy-first cap of 96 oversubscribed the 13 NoPE planes: the
# "depth-rent" the chapter names.  Keep short-context nwg = min(blocks, 32) so short sessions do not
# pay empty workgroups.  (On a 132-SM GPU, 32 workgroups x 2 KV heads fill only part of the card at depth;
# docs/PERF.md measures what this cap costs.)
MAX_DECODE_SPLIT_WORKGROUPS = MAX_WORKGROUPS
MAX_SIMDGROUPS = 4


def splitk_geometry(visible: int) -> tuple[int, int]:
    """(n_workgroups, n_simdgroups) for ``visible`` rows: the chapter's rule, pinned by a test."""
    if visible < 1:
        raise ValueError(f"visible must be >= 1, got {visible}")
    blocks = (visible + BLOCK_ROWS - 1) // BLOCK_ROWS
    nwg = min(blocks, MAX_DECODE_SPLIT_WORKGROUPS)
    nsg = 1
    while 2 * nwg * nsg * BLOCK_ROWS < visible and nsg < MAX_SIMDGROUPS:
        nsg *= 2
    return nwg, nsg


# On a GPU the chapter's cap leaves most of the card idle for a single deep layer: one NoPE layer at
# 131,072 keys is 2 KV heads x 32 workgroups = 64 workgroups on a 132-SM H200.  The GPU path keeps the
# chapter's nsg rule and block ownership but sizes nwg so that one launch is one wave of resident
# workgroups: GPU_TARGET_WORKGROUPS // (layers x KV heads) per pair, at most one per run of blocks.
# Measured on the H200 (docs/PERF.md): the chapter's cap costs 3.6x there (3,741 us against 1,025 us for
# that layer with the first kernel).  The floor of 32 per pair that the first GPU kernel kept is gone:
# a 39-layer SWA launch at 2,048 keys made 2,496 workgroups of 64 rows each, 9.5 waves of mostly-empty
# 256-row tiles, where 234 workgroups of ~680 rows fill the card once.
# The tiled producer (producer_gpu.py) holds 2 workgroups per SM (128 threads at 221 registers each; it
# was 256 threads at 128 registers in run 7), so the target is one wave of them: 132 SMs x 2.  Measured
# on the H200 (run 7, 256-thread tiles): one NoPE layer at 131,072 / 32,768 keys took 257 / 101 us at 264
# against 335 / 132 us at 396 and 273 / 140 us at 528 (run 5, 128-thread tiles: 116 against 154 us at
# 32,768).  With the warp-tiled producer (run 27, CUPTI, one process per target): the chapter's cap (target
# 64, nwg 32 a pair) costs 2.45x at 131,072 keys (254 against 104 us) and 1.80x at 32,768 (70 against 39);
# 64 workgroups busy 64 of 132 SMs, which alone would cost 2.06x.  The most, 1,024 a pair, takes 214 us
# there: the producer 143 us and the reducer 71 us (each thread folds its partials one after another).
GPU_TARGET_WORKGROUPS = 264
GPU_MAX_WORKGROUPS = 1024


def gpu_target_workgroups() -> int:
    """The split's workgroup target: GPU_TARGET_WORKGROUPS, or MUSER_GPU_TARGET_WORKGROUPS where set
    (scripts/device_run.sh measures it)."""
    return int(os.environ.get("MUSER_GPU_TARGET_WORKGROUPS", GPU_TARGET_WORKGROUPS))


def gpu_workgroups_per_pair(n_pairs: int, target: int) -> int:
    """The most workgroups a (layer, KV head) pair gets: the target shared out, at least 1 (a partial
    second wave costs a whole one), at most GPU_MAX_WORKGROUPS."""
    return min(max(1, target // max(n_pairs, 1)), GPU_MAX_WORKGROUPS)


def gpu_split_geometry(visible: int, n_pairs: int, target: int | None = None) -> tuple[int, int]:
    """(n_workgroups, n_simdgroups) on a GPU for ``n_pairs`` (layer, KV head) pairs in one launch (the
    target: gpu_target_workgroups() unless given)."""
    if target is None:
        target = gpu_target_workgroups()
    _, nsg = splitk_geometry(visible)
    runs = -(-((visible + BLOCK_ROWS - 1) // BLOCK_ROWS) // nsg)  # runs of nsg blocks to share out
    return max(1, min(runs, gpu_workgroups_per_pair(n_pairs, target))), nsg


def gpu_items_cap(target: int, n_pairs: int) -> int:
    """The most work items (workgroups) a GPU producer launch over at most ``n_pairs`` (layer, KV head) pairs
    can have: gpu_split_geometry keeps pairs x nwg <= max(target, pairs) (tests/test_gpu_plan.py).  The
    producers compile it in as their loop's bound.  Why: Taichi 1.7.4 launches a range-for whose bound is not
    a compile-time constant on its saturating grid, 8,448 blocks of 128 threads on the H200, and computes
    the bound in a one-thread task launched ahead of it.  The producer holds 2 workgroups an SM, so the
    ~8,200 empty blocks queue behind the real ones: their prologue was 5.5 % of the stall samples of one
    NoPE layer's producer at 131,072 keys (ncu).  With the constant bound that producer took 102.0-103.2 us
    against 107.2 + 0.9 for the bound's task, 34.0 against 41.7 + 0.9 at 32,768 keys and 20.8 against
    21.1 + 0.9 at 2,048 (CUPTI, both trees in alternation, docs/PERF.md run 19)."""
    return max(target, n_pairs)


def gpu_split_func(n_pairs: int, target: int, window: int):
    """gpu_split_geometry as a ti.func of the position, for a launch whose pairs and target are fixed
    when it is compiled (the one-dispatch step, step_gpu.py): the same numbers, computed by the threads
    that need them instead of passed in, since every scalar argument costs the host ~1 us a launch.
    Straight-line code (no loop), so it adds no task to the kernel; tests/test_gpu_plan.py checks it
    against gpu_split_geometry."""
    assert MAX_SIMDGROUPS == 4  # the two doublings below
    per_pair = gpu_workgroups_per_pair(n_pairs, target)

    @ti.func
    def split(position):
        visible = position + 1
        if ti.static(window > 0):
            visible = ti.min(position + 1, window)
        blocks = (visible + BLOCK_ROWS - 1) // BLOCK_ROWS
        reach = 2 * ti.min(blocks, MAX_DECODE_SPLIT_WORKGROUPS) * BLOCK_ROWS  # splitk_geometry's rule
        nsg = 1
        if reach < visible:
            nsg = 2
            if 2 * reach < visible:
                nsg = 4
        return ti.max(1, ti.min((blocks + nsg - 1) // nsg, per_pair)), nsg

    return split


def block_owner(block: int, nwg: int, nsg: int) -> tuple[int, int]:
    """(workgroup, simdgroup) owning a block: block = (k*nwg + workgroup)*nsg + simdgroup."""
    return (block // nsg) % nwg, block % nsg


def build_splitk(head_dim: int, heads_per_kv: int, n_kv: int, n_heads: int, gpu: bool, record: bool = False,
                 items_cap: int = 0, layers_cap: int = 0):
    """(producer, reduce_f32, reduce_f16) for the token-major ring; the caps: producer.producer_kernel's
    items_cap and merge.build_reduce's layers_cap (constant loop bounds on a GPU; 0: none)."""
    producer = cached(
        ("splitk", head_dim, heads_per_kv, n_kv, gpu, record, plan_key(head_dim, heads_per_kv, gpu), items_cap),
        lambda: build_producer(head_dim, heads_per_kv, n_kv, gpu, TOKEN_MAJOR, bypass=False, record=record,
                               items_cap=items_cap),
    )
    return (producer, build_reduce(head_dim, n_heads, gpu, ti.f32, layers_cap),
            build_reduce(head_dim, n_heads, gpu, ti.f16, layers_cap))
