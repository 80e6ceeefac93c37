"""The split: how many workgroups (and simdgroups each) share a (layer, KV head) pair's visible rows, on every
route and backend (§16.5.1's rule, and the CPU's and GPU's departures from it), and which one owns a block.
"""


import os

import taichi as ti

from .common import BLOCK_ROWS, MAX_WORKGROUPS

# llama.cpp's Metal flash_attn_ext_vec always launches nwg = 32 and only grows simdgroups (1 -> 4) once
# 2*nwg*nsg*32 < visible.  Ferrite's occupancy-first cap of 96 oversubscribed the 13 NoPE planes: the
# "depth-rent" the chapter names.  Keep short-context nwg = min(blocks, 32) so short sessions do not
# pay empty workgroups.  (On a GPU this cap leaves most of the card idle at depth: GPU_TARGET_WORKGROUPS.)
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


# The CPU runs each (layer, KV head, workgroup) item as a task of its own (kernels/producer: CPU_TASK_ITERATIONS),
# so it needs only enough items to keep every core busy, not the chapter's 32 workgroups a pair: each costs a
# Q load, an output write, a task and a reducer merge (Glimmer's step at 2,048 keys: 72.8 ms with 32 a pair,
# 39.1 with one).  The CPU keeps the chapter's nsg and ownership, at most CPU_TARGET_ITEMS // pairs a pair.
CPU_TARGET_ITEMS = 32


def cpu_split_geometry(visible: int, n_pairs: int) -> tuple[int, int]:
    """(n_workgroups, n_simdgroups) on the CPU for ``n_pairs`` (layer, KV head) pairs in one launch."""
    nwg, nsg = splitk_geometry(visible)
    return max(1, min(nwg, -(-CPU_TARGET_ITEMS // max(n_pairs, 1)))), nsg


# Handing a launch's items to more threads costs their wake-up: 60-100 us on the 2-core VM, through Taichi's pool
# or the compiled path's lanes alike (docs/PERF.md, "A model's calls on the CPU, one layer at a time"), about what
# one core takes for ~250 of a work item's rows.  A launch with at most CPU_SERIAL_ROWS rows in all (one layer's at
# short context) runs its items on the launching thread: the same items, the same bits.
CPU_SERIAL_ROWS = 512


def cpu_serial(visible: int, n_pairs: int) -> bool:
    """Whether a CPU producer launch over ``n_pairs`` (layer, KV head) pairs of ``visible`` rows runs serially."""
    return visible * n_pairs <= CPU_SERIAL_ROWS


# On a GPU the chapter's cap leaves most of the card idle for a single deep layer (2 KV heads x 32
# workgroups = 64 workgroups on 132 SMs: 2.45x the time at 131,072 keys).  The GPU path keeps the chapter's
# nsg rule and block ownership but sizes nwg so that one launch is one wave of resident workgroups, 2 an SM
# (the producers' 128 threads at up to 255 registers): GPU_TARGET_WORKGROUPS // (layers x KV heads) per pair,
# at most one per run of blocks (docs/lab/runs.md, kernel history: target workgroups).
GPU_TARGET_WORKGROUPS = 264
GPU_MAX_WORKGROUPS = 1024  # a pair's most: the reducer folds a thread's partials one after another


def gpu_target_workgroups() -> int:
    """The split's workgroup target: GPU_TARGET_WORKGROUPS, or MUSER_GPU_TARGET_WORKGROUPS where set (to
    measure it, or to make each workgroup walk many tiles in a test)."""
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
    producers compile it in as their loop's bound: Taichi 1.7.4 launches a range-for whose bound is not a
    compile-time constant on its saturating grid (8,448 blocks of 128 threads on an H200) and computes the
    bound in a one-thread task ahead of it, and the empty blocks queued behind the real ones (docs/PERF.md
    kernel history: constant loop bounds)."""
    return max(target, n_pairs)


def gpu_split_func(n_pairs: int, target: int, window: int):
    """gpu_split_geometry as a ti.func of the position, for a launch whose pairs and target are fixed
    when it is compiled (the one-dispatch step, one_dispatch.py): the same numbers, computed by the threads
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
