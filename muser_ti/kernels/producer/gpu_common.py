"""What both GPU tiles of the producer share: index helpers, the query stager, the rows a workgroup
owns, a work item's prologue, the shared-memory budgets, and the tile choice a user may override.

Why the GPU producer is shaped as it is (docs/PERF.md "Where each miss comes from"): decode attention
without tensor cores (Taichi has none) is bound by the instruction issue around the FMAs, not by DRAM.
A K/V element can only be shared among a KV head's sibling query heads through shared memory, so both
tiles stage K and V through it in chunks and keep FMAs per shared load high.
"""

import os

import taichi as ti

from ..common import BLOCK_ROWS

SHARED_BUDGET_BYTES = {"cuda": 48 * 1024, "vulkan": 48 * 1024, "metal": 32 * 1024}  # without opt-in
TILE_ENV = "MUSER_GPU_TILE"  # "warp" or "block": force a tile (the default picks the warp tile where it fits)
UNROLL_ENV = "MUSER_GPU_UNROLL"  # the warp tile's unroll (default: 8 on CUDA, 1 elsewhere); 1 compiles fast
TILES = ("warp", "block")


def tile_choice(text: str | None = None) -> dict:
    """The tile a user forced: MUSER_GPU_TILE ("warp" | "block" | unset) and MUSER_GPU_UNROLL (a positive
    integer | unset), as {"tile": ..., "unroll": ...} with only what is set.  Anything else is refused."""
    tile = os.environ.get(TILE_ENV, "") if text is None else text
    out = {}
    if tile:
        if tile not in TILES:
            raise ValueError(f"{TILE_ENV}={tile!r}; expected one of {list(TILES)} or unset (the default tile)")
        out["tile"] = tile
    unroll = os.environ.get(UNROLL_ENV, "")
    if unroll:
        if not unroll.isdigit() or int(unroll) < 1:
            raise ValueError(f"{UNROLL_ENV}={unroll!r}; expected a positive integer or unset (8 on CUDA, 1 elsewhere)")
        out["unroll"] = int(unroll)
    return out


@ti.func
def udiv(x, n: ti.template()):
    """x // n for x >= 0 and a compile-time n.  Taichi's ``//`` and ``%`` are Python's floor ops, whose sign
    correction hid every shared-memory index's range from LLVM (a sign extension per access, no constant
    offset folded); a shift or a mask keeps it known (docs/lab/runs.md, kernel history: udiv/umod)."""
    if ti.static(n & (n - 1) == 0):
        return x >> ti.static(n.bit_length() - 1)
    else:
        return ti.raw_div(x, n)


@ti.func
def umod(x, n: ti.template()):
    """x % n for x >= 0 and a compile-time n (see udiv)."""
    if ti.static(n & (n - 1) == 0):
        return x & ti.static(n - 1)
    else:
        return ti.raw_mod(x, n)


QUERY_LOADS_IN_FLIGHT = 16  # a thread's query loads issued before their stores to shared memory: one load and one
#                            store a trip made LLVM reload the ndarray's pointer after every store (docs/PERF.md)


def query_stager(G: int, D: int, T: int, stride: int):
    """A ti.func copying one KV head's G x D f32 queries, times the attention scale, into shared memory
    (``q_sh[h * stride + d]``), each of T threads loading up to QUERY_LOADS_IN_FLIGHT of them before it
    stores any.

    The scale goes in here, not on the score: ``exp(score * scale - max)`` is a multiply feeding a subtract,
    which a SPIR-V driver may fuse into one FMA in one module and not in another (Taichi marks no SPIR-V
    operation NoContraction), and NVIDIA's Vulkan driver did, so the one-dispatch step's bits left the graph
    route's.  A query scaled once into shared memory leaves a plain subtract.  Known deficit: the dot
    products and value sums are multiply-adds too; nothing in SPIR-V promises they compile alike."""
    n = G * D
    trips = -(-n // T)

    @ti.func
    def stage(q: ti.template(), q_sh: ti.template(), layer, head0, tid, scale):
        for b0 in ti.static(range(0, trips, QUERY_LOADS_IN_FLIGHT)):
            nb = ti.static(min(QUERY_LOADS_IN_FLIGHT, trips - b0))
            vals = ti.Vector([0.0] * nb)
            for k in ti.static(range(nb)):  # clamped: the last trip's spare threads re-read element n - 1
                e = ti.min(tid + T * (b0 + k), n - 1)
                vals[k] = q[layer, head0 + udiv(e, D), umod(e, D)] * scale
            for k in ti.static(range(nb)):
                e = tid + T * (b0 + k)
                if ti.static(T * (b0 + k + 1) <= n):
                    q_sh[udiv(e, D) * stride + umod(e, D)] = vals[k]
                elif e < n:
                    q_sh[udiv(e, D) * stride + umod(e, D)] = vals[k]

    return stage


@ti.func
def owned_rows(visible, wg, nwg, nsg):
    """(run, n_own, o_cur) of workgroup wg: it owns runs wg, wg + nwg, ... of ``run = nsg`` blocks of the
    visible rows, n_own rows in all, walked in increasing order; o_cur is the current token's index in
    that order (the window's last row), or -1 where another workgroup owns it."""
    run = nsg * BLOCK_ROWS
    n_runs = (visible + run - 1) // run
    my_runs = 0
    if wg < n_runs:
        my_runs = (n_runs - 1 - wg) // nwg + 1
    n_own = my_runs * run
    if my_runs > 0 and (n_runs - 1) % nwg == wg:
        n_own -= n_runs * run - visible  # the last run is partial
    last_run = (visible - 1) // run
    o_cur = -1
    if last_run % nwg == wg:
        o_cur = (last_run // nwg) * run + (visible - 1) % run
    return run, n_own, o_cur


def item_prologue(at, words_per_row: int, threads: int, fused_store: bool, layer_base: int, slot_is_group: bool):
    """What both GPU tiles do first for a work item: its coordinates, its model layer and plane slot (group
    layer g is model layer ``layers[layer_base + g]`` and plane slot ``slots[g]``, or g itself where
    ``slot_is_group``: the one-dispatch step, which binds no slot table) and, with ``fused_store``,
    workgroup 0's store of the current token's row (a thread per packed word)."""

    @ti.func
    def prologue(tid, item, k_cur: ti.template(), v_cur: ti.template(), k_plane: ti.template(),
                 v_plane: ti.template(), layers: ti.template(), slots: ti.template(), position, window, capacity,
                 origin_logical, origin_physical, nwg):
        g, kvh, wg, logical_start, visible = at.work_item(item, nwg, position, window)
        layer, slot = layers[layer_base + g], g
        if ti.static(not slot_is_group):
            slot = slots[g]
        if ti.static(fused_store):
            if wg == 0:
                row = at.physical_of(position, capacity, origin_logical, origin_physical)
                e = tid
                while e < words_per_row:
                    at.fused_store(k_cur, v_cur, k_plane, v_plane, layer, slot, kvh, row, e)
                    e += threads
        return g, kvh, wg, logical_start, visible, layer, slot

    return prologue


__all__ = ["SHARED_BUDGET_BYTES", "TILES", "TILE_ENV", "UNROLL_ENV", "item_prologue", "owned_rows", "query_stager",
           "tile_choice", "udiv", "umod"]
