"""The split-K producer's GPU path: register-blocked tiles staged through shared memory in chunks.

This is the block tile: the whole workgroup shares each tile and its barriers.  Where the geometry
allows (16 heads per KV head among others) CUDA and Vulkan run the warp tile instead
(producer_warp.py, docs/PERF.md run 14); Metal, Qwen2.5-7B's 7 heads per KV head, multi-head
attention and head_dim 256 at 16 heads keep this one.

What bounds decode attention on a GPU without tensor cores (Taichi has none) is not DRAM but the
instruction issue around the FMAs, and the latency that issue cannot hide: every FMA needs its two
operands in registers, and the only way to share a K/V element among the G sibling query heads is
shared memory (warp shuffles exist on CUDA only).  The kernel is shaped so that FMAs per shared load
stay high and the global loads' latency is hidden behind FMAs:

* scores: each thread owns HB heads x RB rows of the tile, so per dimension it loads HB query and
  RB key values and does HB*RB FMAs (4 x 4 for Glimmer: 8 loads per 16 FMAs; ptxas merges the query
  loads of 4 consecutive dimensions into one 128-bit load);
* values: each thread owns VH heads x VD dims and a slice of the tile's rows (4 x 8: 12 loads per
  32 FMAs); the RS row slices are summed once per workgroup at the end;
* a tile is R rows (128 for Glimmer) so that the softmax bookkeeping (three barriers, two tiny
  reductions) is paid once per 128 rows, not per 32; the running sum of weights stays per thread and
  is reduced once per workgroup;
* K is staged in chunks of DC dimensions ([R][DC+1] f32, padded so the rows a warp reads sit in
  different banks) and V in chunks of VR rows ([VR][D+1]), both through one buffer: 28.3 KiB of
  shared memory for Glimmer, inside Metal's 32 KiB, so every backend runs the same tile;
* the chunks are software-pipelined (PF): a thread's share of chunk c+1 is loaded, kept packed (u32
  words of two halves, halves.py), while chunk c's FMAs run, and unpacked to f32 only when it is
  stored.  ncu showed why (run 8): without it, a quarter of all stall samples sat on the f16 -> f32
  conversion right after each chunk's loads, waiting for global memory with nothing else to do before
  the barrier.  Converting at load time (the first pipelined kernel) put that wait back and gained
  nothing;
* the planes are loaded a word (two halves) per lane: Taichi loads an f16 ndarray 2 bytes at a time
  (``ld.b16``), so the planes are stored as u32 words.  One NoPE layer's producer at 131,072 keys went
  from 145.7 to 138.2 us and 223 to 207 registers (H200, docs/PERF.md run 13).

Registers decide occupancy, and Taichi decides the register cap: it marks every CUDA kernel
``.maxntid T`` and ``.minnctapersm 2``, so ptxas may use 65,536 / (2 T) registers per thread (seen
in the PTX, docs/PERF.md run 7); ``gpu_max_reg`` never reaches the driver in 1.7.4, so T is the only
register knob there is.  At T = 256 the cap is 128 and the kernel spills (136-184 bytes, ptxas -v);
at T = 128 it takes 221 registers (253 before run 9) with no spills, an SM holds 2 workgroups of 4
warps, and with the pipelined chunks that is the faster shape: the chunk loads no longer need other
warps to hide them.

Index arithmetic: every per-thread index (thread id, tile coordinates, chunk cells) is built with
udiv/umod (shifts and masks) instead of Taichi's ``//`` and ``%``, whose floor semantics hid the
index ranges from LLVM.  With Taichi's ops each staged K value cost ``add.s32; mul.wide.s32;
add.s64`` before its shared load (a third of all instructions, run 8); with udiv/umod the offsets
fold into the loads and the score loop is 256 FFMA + 80 shared loads per chunk (SASS, run 9).

Known deficit (H200, docs/PERF.md runs 9, 12 and 13): one NoPE layer at 131,072 keys takes ~138 us of
producer time (~151 us with the reducer) against torch SDPA's 65-66 us in the same processes.  ncu (run
13, this kernel): 70 M warp instructions (2.1 per FMA), 49 % of issue slots busy, 8 warps per SM (207
registers, 2 workgroups).  Fewer instructions have not bought time twice now: run 9 cut 100 -> 76 M
and gained 13 %; run 12's 128-bit shared layouts (K_CHUNK_DIMS, MAX_VALUE_DIMS) cut them to 61 M and
190 registers and gained nothing, because the issue rate fell to 40 %.  With 2 warps per scheduler the
kernel waits on latency: shared-memory results (26 % of stall samples), the plane loads (18 %),
fixed-latency dependencies (15 %; run 12, f16 loads).  More warps cost more than they hide
(GPU_PRODUCER_THREADS).  torch uses tensor cores, which Taichi cannot.

Block ownership is the chapter's (block b belongs to workgroup (b // nsg) % nwg): a workgroup walks
its owned rows in increasing order, R at a time, with one online-softmax update per tile.
"""

import os
from dataclasses import dataclass

import taichi as ti

from .common import BLOCK_ROWS, RUNNING_MAX_INIT, VISIT_OWNER
from .halves import HALVES_PER_WORD, high, low

SHARED_BUDGET_BYTES = {"cuda": 48 * 1024, "vulkan": 48 * 1024, "metal": 32 * 1024}  # without opt-in
GPU_PRODUCER_THREADS = 128  # T: 128 lets ptxas use 255 registers (see above).  One NoPE layer on the H200 at
#                            131,072 / 32,768 keys, device time: 170 / 74 us at T = 128, 198 / 82 at T = 256
#                            (cap 128 registers), 194 / 78 at T = 256 with VH = 2 (run 9).  Before udiv/umod:
#                            194-196 / 79-81 at T = 128, 220 / 86 at T = 256 (run 8); 64 threads ran 371 us at
#                            131,072 (docs/PERF.md).  T = 192 (cap 168 registers, 12 warps per SM, 192-row tiles)
#                            spilled and ran 217 against 187 us (run 12, docs/perf/h200/run12/layouts-and-t192.patch)
K_CHUNK_DIMS = 16  # DC: dimensions of K staged per chunk ([R][DC+1] f32 = 8.5 KiB at R = 128).  K staged transposed
#                    ([DC][R + 4], a thread's 4 score rows in one 128-bit load): no faster (run 12, MAX_VALUE_DIMS)
MAX_SCORE_HEADS = 4  # HB: 8 x 2 tiles at T = 128 ran 173 vs 170 us (run 9); 8 x 1 at T = 256 ran 275 us
#                      at 131,072 keys, against 262 for 4 x 2 (run 7)
MAX_VALUE_DIMS = 8  # VD: value dims per thread, dims dg + DG*j.  Adjacent dims (dg*VD + j) over unpadded V rows,
#                     with weights [row][G + 4], read a value row in three 128-bit loads instead of twelve; with K
#                     transposed too: 61 M instructions against 74 M, and 187-188 against 185-186 us at 131,072
#                     keys (run 12, in one process; either layout alone 182 us); not kept
MAX_VALUE_HEADS = 4  # VH: 4 x 8 = 32 accumulators.  2 x 8 ran 307 us against 257 at T = 256 (run 7); 8 x 8
#                      with a prefetched chunk spilled twice as much at T = 128 (ncu, run 5)
LOAD_GROUP = 16  # LG cap, unpipelined chunks only: words in flight per thread before their stores (halves
#                  before run 13: 8 and 4 ran 10 % and 23 % slower than 16 with 256-row tiles, run 7)
PREFETCH = 1  # PF: chunk c+1 loads (kept packed) while chunk c's FMAs run; see above.  K chunks of 8 / 32 dims
#               with it ran 223 / 204 us at 131,072 keys against 196 for 16 (run 8).  Two chunks in flight
#               (a second stage; V's first chunks loaded under K's last) ran 187 vs 173 us (run 9)
MAX_TILE_ROWS = 128  # R: 256-row tiles ran 202 us at 131,072 keys against 196 (run 8, T = 128), and 64-row
#                      tiles 254 against 220 (T = 256); short windows leave long tiles mostly empty (run 7)


@ti.func
def udiv(x, n: ti.template()):
    """x // n for x >= 0 and a compile-time n.  Taichi's ``//`` and ``%`` are Python's floor ops: a
    divide plus a sign correction that hides the result's range from LLVM, so every shared-memory index
    built from them was sign-extended per access (``add.s32; mul.wide.s32; add.s64`` in the PTX) and no
    constant offset folded into a load.  A shift or a mask keeps the range known, and the offsets fold
    (docs/PERF.md run 9: 100 M -> 76 M warp instructions, 196 -> 170 us at 131,072 keys)."""
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


QUERY_LOADS_IN_FLIGHT = 16  # a thread's query loads issued before their stores to shared memory.  A loop of one
#                            load and one store issued them two at a time, since every store to shared memory
#                            made LLVM reload the ndarray's shape and pointer (a generic pointer may alias
#                            them): 16 dependent round trips per thread, 6 % of the warp tile's stall samples
#                            at 131,072 keys (docs/PERF.md run 21's profile, the span at 0x1800).  Measured
#                            (run 24, CUPTI, warp tile, one NoPE layer's producer, 2 processes each): 20.7 ->
#                            18.0 us at 2,048 keys, 33.3 -> 30.3 at 32,768, 101.3 -> 96.1 at 131,072.  The block
#                            tile takes it too (same bits on lavapipe), not timed on the H200


def query_stager(G: int, D: int, T: int, stride: int):
    """A ti.func copying one KV head's G x D f32 queries, times the attention scale, into shared memory
    (``q_sh[h * stride + d]``), each of T threads loading up to QUERY_LOADS_IN_FLIGHT of them before it
    stores any.

    Why the scale goes in here, not on the score: the tiles took ``exp(score * scale - max)``, a multiply
    feeding a subtract, which a SPIR-V driver may fuse into one FMA or not, module by module (Taichi 1.7.4
    marks no SPIR-V operation NoContraction).  NVIDIA's Vulkan driver did one in the one-dispatch step and
    the other in the lone producer, for the 16-head warp tile: their partials' M agreed and their S differed
    by up to 31 ulps (scripts/step_bits.py; H200 and H100, docs/PERF.md run 29).  A scaled query, rounded
    once into shared memory, leaves a plain subtract there (then 0 ulps at every stage, same run), and
    saves a multiply per score.  Known deficit: the dot products and the value sums are multiply-adds too;
    they compiled alike in both modules there, which nothing in SPIR-V promises."""
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
    """What both GPU tiles do first for a work item: its coordinates, its model layer and plane slot
    (gpu_producer_work says how they are bound) and, with ``fused_store``, workgroup 0's store of the
    current token's row (a thread per packed word)."""

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


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


@dataclass(frozen=True)
class TilePlan:
    """The static shape of the GPU producer for one (G, D) and shared-memory budget."""

    G: int
    D: int
    T: int
    HB: int  # score heads per thread
    HG: int  # head groups (G // HB)
    RG: int  # score row groups (threads along rows)
    RB: int  # score rows per thread
    R: int  # tile rows
    DC: int  # K chunk dims
    VR: int  # V chunk rows
    VH: int  # value heads per thread
    VD: int  # value dims per thread
    DG: int  # value dim groups (D // VD): a thread owns dims dg + DG*j
    HGV: int  # value head groups (G // VH)
    RS: int  # row slices in the value pass
    L2: int  # threads per head in the tile-max reduction
    BUF: int  # floats in the K/V chunk buffer
    LG: int  # chunk words each thread loads before their stores (divides the chunk's words per thread)
    shared_bytes: int
    PF: int = PREFETCH  # 1: each chunk's loads are issued a chunk ahead (software pipelining)


def gpu_tile_plan(G: int, D: int, budget: int, T: int = GPU_PRODUCER_THREADS, HB: int = MAX_SCORE_HEADS,
                  VH: int = MAX_VALUE_HEADS, R: int = MAX_TILE_ROWS, LG: int = LOAD_GROUP,
                  DC: int = K_CHUNK_DIMS, PF: int = PREFETCH) -> "TilePlan":
    """Choose the largest tile that fits ``budget`` bytes of shared memory; pure arithmetic, tested.

    T, HB, VH, R and LG cap the workgroup size, the score heads and value heads per thread, the tile
    rows and the loads in flight; DC sets the K chunk's dimensions; PF = 1 pipelines the chunks.  The
    defaults are the measured choice; MUSER_GPU_TILE overrides them (tile_overrides)."""
    max_hb, max_vh, max_r = HB, VH, R
    if T < 32 or T & (T - 1) or T > 1024:
        raise ValueError(f"workgroup threads T={T}: expected a power of two in [32, 1024]")
    if G > T:
        raise ValueError(f"the GPU producer keeps one head per thread in its reductions: heads per KV head "
                         f"{G} must be <= {T}")
    # score heads per thread: the most (up to the HB cap) that leave a head-group count dividing T, so every
    # thread has a row group (G = 24: 6 heads x 4 groups, not 8 x 3 with 2 threads idle)
    HB = max((d for d in range(1, min(G, max_hb) + 1) if G % d == 0 and G // d <= T),
             key=lambda d: (T % (G // d) == 0, d))
    HG = G // HB
    RG = 1 << (T // HG).bit_length() - 1  # a power of two, so tiles of R = RG x RB rows split into chunks
    VD = _largest_divisor(D, MAX_VALUE_DIMS)
    DG = D // VD
    # value heads per thread: the most up to the VH cap that the workgroup's threads cover; wide groups
    # (more than VH x T / DG heads) need more per thread, at the cost of registers
    fits = [d for d in range(1, G + 1) if G % d == 0 and (G // d) * DG <= T]
    VH = max([d for d in fits if d <= max_vh], default=min(fits))
    HGV = G // VH
    RS = T // (HGV * DG)
    L2 = T // G
    if PF not in (0, 1):
        raise ValueError(f"prefetch PF={PF}: expected 0 or 1")
    if DC < HALVES_PER_WORD or D % DC or DC % HALVES_PER_WORD or DC > T:
        raise ValueError(f"K chunk dims DC={DC}: expected an even divisor of head_dim {D} of at most T={T} "
                         f"(a chunk row is whole packed words)")
    for RB in range(max(1, max_r // RG), 0, -1):  # the largest tile (R = RG x RB rows) that fits
        R = RG * RB
        chunk = R * DC
        if chunk % D or chunk % (HALVES_PER_WORD * T) or R % (chunk // D):  # every thread moves whole words
            continue
        VR = chunk // D
        buf = max(R * (DC + 1), VR * (D + 1), G * D if RS > 1 else 0)
        floats = G * D + buf + G * (R + 1) + G * RG + G * L2 + 2 * G
        shared = 4 * (floats + R)
        if shared <= budget:
            lg = _largest_divisor(chunk // (HALVES_PER_WORD * T), LG)
            return TilePlan(G, D, T, HB, HG, RG, RB, R, DC, VR, VH, VD, DG, HGV, RS, L2, buf, lg, shared, PF)
    raise ValueError(f"no GPU tile for {G} heads per KV head at head_dim {D} fits {budget} bytes of shared memory "
                     f"(the queries alone take {4 * G * D})")


def describe_block_tile(p: TilePlan, arch: str, budget: int) -> str:
    """A block tile in words (producer.describe_plans prints one per backend)."""
    cap = f", at most {min(255, 65536 // (2 * p.T))} registers per thread" if arch == "cuda" else ""
    return (f"{p.T} threads{cap}; {p.R}-row tiles; scores {p.HB} heads x {p.RB} rows and values "
            f"{p.VH} heads x {p.VD} dims per thread; {p.shared_bytes / 1024:.1f} of {budget // 1024} KiB shared; "
            f"{'chunks pipelined (packed halves in flight)' if p.PF else 'chunks not pipelined'}")


# WT..HW: warp tiles (WT picks them; the rest are producer_warp.WARP_TILE_KNOBS)
TILE_KNOBS = ("T", "HB", "VH", "R", "LG", "DC", "PF", "WT", "WU", "XM", "RL", "CA", "WW", "WC", "HW")
SWITCH_KNOBS = ("PF", "WT", "XM")  # 0 or 1


def tile_overrides(text: str | None = None) -> dict[str, int]:
    """MUSER_GPU_TILE="T=256,VH=2" -> {"T": 256, "VH": 2}: the tile caps scripts/tune_gpu.py measures."""
    text = os.environ.get("MUSER_GPU_TILE", "") if text is None else text
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in TILE_KNOBS or not value.isdigit() or int(value) < (key not in SWITCH_KNOBS):
            raise ValueError(f"MUSER_GPU_TILE: {part!r}; expected KNOB=positive integer (0 or 1 for a switch, "
                             f"{list(SWITCH_KNOBS)}), knobs {list(TILE_KNOBS)}")
        out[key] = int(value)
    return out


def gpu_producer_work(plan: TilePlan, bypass: bool, record: bool, at, fused_store: bool, layer_base: int = 0,
                      slot_is_group: bool = False):
    """The GPU producer's per-thread work, a ti.func of a thread and its work item; ``at`` is the
    layout's addressing (producer.addressing).  fused_store: workgroup 0 of each work item writes the
    current token's row into the plane (the interleaved route); the one-dispatch step (step_gpu.py)
    stores in a task of its own instead, behind the token scan's flags.  Group layer g is model layer
    ``layers[layer_base + g]`` and plane slot ``slots[g]``, or g itself where ``slot_is_group`` (a
    group of every layer of the class, in order: the one-dispatch step, which binds no slot table)."""
    p = plan
    G, D, T, C = p.G, p.D, p.T, BLOCK_ROWS
    HB, RG, RB, R, DC, VR = p.HB, p.RG, p.RB, p.R, p.DC, p.VR
    VH, VD, DG, HGV, RS, L2 = p.VH, p.VD, p.DG, p.HGV, p.RS, p.L2
    KS, VS, WS = DC + 1, D + 1, R + 1  # padded strides of the K chunk, V chunk and weight rows
    CHUNK = R * DC  # halves per chunk, K or V
    LOADS = CHUNK // (HALVES_PER_WORD * T)  # packed words (two halves each) each thread moves per chunk
    DCW, DW = DC // HALVES_PER_WORD, D // HALVES_PER_WORD  # words per K chunk row, per V row
    NKC = D // DC  # K chunks per tile (V chunks: as many as the tile has rows for, see n_vc)
    SCORE_THREADS, VALUE_THREADS = p.HG * RG, RS * HGV * DG
    LG, PF = p.LG, p.PF
    prologue = item_prologue(at, DW, T, fused_store, layer_base, slot_is_group)
    stage_queries = query_stager(G, D, T, D)

    @ti.func
    def tile_rows(plane: ti.template(), slot, kvh, o_first, count, wg, nwg, run, logical_start, capacity,
                  origin_logical, origin_physical, rows_sh: ti.template(), visits: ti.template(), g, tid):
        """Flat plane index of each tile row's first element (past ``count``: the last valid row's, in bounds
        and unused).  K and V planes have one shape, so one index serves both."""
        i = tid
        while i < R:
            o = o_first + ti.min(i, count - 1)
            rel = (wg + (o // run) * nwg) * run + o % run
            rows_sh[i] = at.row_offset(plane, slot, kvh,
                                       at.physical_of(logical_start + rel, capacity, origin_logical, origin_physical))
            if ti.static(record):
                if i < count and rel % C == 0:
                    ti.atomic_add(visits[g, rel // C], 1 + VISIT_OWNER * wg)
            i += T

    # Word k of a thread's share of a chunk is e = tid + k*T.  Where T is a multiple of the chunk's row
    # length in words (DCW for K, DW for V) its row is tid // len + k * (T // len) and its column tid % len:
    # one base per thread plus a constant per k, instead of a divide and a modulo per word.
    K_SPLIT, V_SPLIT = T % DCW == 0, T % DW == 0

    @ti.func
    def chunk_cell(e0, k: ti.template(), width: ti.template(), split: ti.template()):
        """(row, word column) of word tid + k*T of a chunk whose rows are ``width`` words (e0 = tid)."""
        row, col = 0, 0
        if ti.static(split):
            row, col = udiv(e0, width) + k * (T // width), umod(e0, width)
        else:
            row, col = udiv(e0 + k * T, width), umod(e0 + k * T, width)
        return row, col

    @ti.func
    def load_chunk(plane: ti.template(), rows_sh: ti.template(), is_k: ti.template(), c, tid,
                   first: ti.template(), n: ti.template()):
        """Words first .. first+n-1 of this thread's share of chunk c (K: dims c*DC.., V: rows c*VR..),
        kept packed: unpacked only when stored, so nothing waits for the loads before then."""
        stage = ti.Vector([0] * n, dt=ti.u32)
        for k in ti.static(range(n)):
            if ti.static(is_k):
                r, col = chunk_cell(tid, first + k, DCW, K_SPLIT)
                stage[k] = at.plane_flat(plane, rows_sh[r] + c * DCW + col)
            else:
                r, col = chunk_cell(tid, first + k, DW, V_SPLIT)
                stage[k] = at.plane_flat(plane, rows_sh[c * VR + r] + col)
        return stage

    @ti.func
    def store_chunk(buf: ti.template(), stage: ti.template(), is_k: ti.template(), tid, first: ti.template(),
                    n: ti.template()):
        for k in ti.static(range(n)):
            base = 0
            if ti.static(is_k):
                r, col = chunk_cell(tid, first + k, DCW, K_SPLIT)
                base = r * KS + HALVES_PER_WORD * col
            else:
                r, col = chunk_cell(tid, first + k, DW, V_SPLIT)
                base = r * VS + HALVES_PER_WORD * col
            buf[base] = low(stage[k])
            buf[base + 1] = high(stage[k])

    @ti.func
    def move_chunk(plane: ti.template(), buf: ti.template(), rows_sh: ti.template(), is_k: ti.template(), c, tid):
        """Chunk c from the plane to shared f32, LOAD_GROUP words in flight per thread before their stores."""
        for grp in ti.static(range(LOADS // LG)):
            store_chunk(buf, load_chunk(plane, rows_sh, is_k, c, tid, grp * LG, LG), is_k, tid, grp * LG, LG)

    @ti.func
    def patch_current(buf: ti.template(), cur: ti.template(), layer, kvh, is_k: ti.template(), c, r_cur, count, tid):
        """The bypass: the current token's chunk row takes the f32 activations.  Called between two
        barriers, and only by a workgroup whose tile holds that row (a uniform condition): a per-element
        test inside move_chunk cost 1.8x on the H200 (844 vs 461 us at 131,072 keys, docs/PERF.md)."""
        if ti.static(bypass):
            if ti.static(is_k):
                if r_cur >= 0 and r_cur < count:
                    ti.simt.block.sync()
                    if tid < DC:
                        buf[r_cur * KS + tid] = cur[layer, kvh, c * DC + tid]
            else:
                if r_cur >= c * VR and r_cur < ti.min(count, c * VR + VR):
                    ti.simt.block.sync()
                    e = tid
                    while e < D:
                        buf[(r_cur - c * VR) * VS + e] = cur[layer, kvh, e]
                        e += T

    @ti.func
    def stage_chunk(plane: ti.template(), cur: ti.template(), buf: ti.template(), rows_sh: ti.template(), ahead,
                    layer, kvh, is_k: ti.template(), c, n_chunks, r_cur, count, tid):
        """Chunk c into buf between two barriers (with PF from ``ahead``, else straight from the plane), the
        bypass row patched in.  Returns what is in flight after it: with PF, chunk c+1's loads, issued here
        so that chunk c's FMAs hide them."""
        ti.simt.block.sync()  # every thread is done reading the previous chunk
        if ti.static(PF):
            store_chunk(buf, ahead, is_k, tid, 0, LOADS)
        else:
            move_chunk(plane, buf, rows_sh, is_k, c, tid)
        patch_current(buf, cur, layer, kvh, is_k, c, r_cur, count, tid)
        ti.simt.block.sync()
        nxt = ahead
        if ti.static(PF):
            if c + 1 < n_chunks:
                nxt = load_chunk(plane, rows_sh, is_k, c + 1, tid, 0, LOADS)
        return nxt

    @ti.func
    def work(tid, item, shared: ti.template(), q: ti.template(), k_cur: ti.template(), v_cur: ti.template(),
             k_plane: ti.template(), v_plane: ti.template(), partials: ti.template(), visits: ti.template(),
             layers: ti.template(), slots: ti.template(), position, window, capacity, origin_logical, origin_physical,
             nwg, nsg, scale):
        """Thread tid of work item ``item`` (a layer, KV head and workgroup), in the workgroup's ``shared``
        arrays (shared_arrays(plan), declared by the caller's loop)."""
        g, kvh, wg, logical_start, visible, layer, slot = prologue(
            tid, item, k_cur, v_cur, k_plane, v_plane, layers, slots, position, window, capacity, origin_logical,
            origin_physical, nwg)
        q_sh, buf, w_sh, part, part2, state, rows_sh = shared
        stage_queries(q, q_sh, layer, kvh * G, tid, scale)
        if tid < G:
            state[tid] = RUNNING_MAX_INIT
            state[G + tid] = 0.0

        # this thread's score tile: heads h0 + i, rows sr + RG*j; value tile: heads vh0 + i,
        # dims dg + DG*j, rows rs, rs + RS, ... of each V chunk
        h0, sr = udiv(tid, RG) * HB, umod(tid, RG)
        rs, vl = udiv(tid, HGV * DG), umod(tid, HGV * DG)
        vh0, dg = udiv(vl, DG) * VH, umod(vl, DG)
        acc = ti.Matrix.zero(ti.f32, VH, VD)
        lsum = ti.Vector([0.0] * HB)

        run, n_own, o_cur = owned_rows(visible, wg, nwg, nsg)
        ti.simt.block.sync()

        o_first = 0
        while o_first < n_own:  # uniform across the workgroup: barriers inside are safe
            count = ti.min(R, n_own - o_first)
            r_cur = o_cur - o_first  # tile row of the current token (bypass), maybe out of range
            tile_rows(k_plane, slot, kvh, o_first, count, wg, nwg, run, logical_start, capacity, origin_logical,
                      origin_physical, rows_sh, visits, g, tid)
            ti.simt.block.sync()

            sc = ti.Matrix.zero(ti.f32, HB, RB)
            ahead = ti.Vector([0] * LOADS, dt=ti.u32)  # PF: this thread's share of the next chunk, in flight
            if ti.static(PF):
                ahead = load_chunk(k_plane, rows_sh, True, 0, tid, 0, LOADS)
            for c in range(NKC):
                ahead = stage_chunk(k_plane, k_cur, buf, rows_sh, ahead, layer, kvh, True, c, NKC, r_cur,
                                    count, tid)
                if tid < SCORE_THREADS:
                    for dd in range(DC):  # not unrolled: ptxas unrolls it.  Unrolled here by 4 it ran 172
                        # against 170 us at 131,072 keys, fully 232 (run 9); K rows padded to 16-byte
                        # alignment (stride 20) for 128-bit reads: 171 (run 9)
                        kd = ti.Vector([buf[(sr + j * RG) * KS + dd] for j in ti.static(range(RB))])
                        for i in ti.static(range(HB)):
                            qd = q_sh[(h0 + i) * D + c * DC + dd]
                            for j in ti.static(range(RB)):
                                sc[i, j] = sc[i, j] + qd * kd[j]

            if ti.static(PF):  # V's first chunk is in flight while the softmax bookkeeping runs
                ahead = load_chunk(v_plane, rows_sh, False, 0, tid, 0, LOADS)
            # the tile's max per head: thread -> part[h][row group] -> part2[h][L2] -> state
            if tid < SCORE_THREADS:
                for i in ti.static(range(HB)):
                    local = RUNNING_MAX_INIT
                    for j in ti.static(range(RB)):
                        if sr + j * RG < count:
                            local = ti.max(local, sc[i, j])  # scores are scaled (query_stager)
                    part[(h0 + i) * RG + sr] = local
            ti.simt.block.sync()
            if tid < G * L2:
                h, sub = udiv(tid, L2), umod(tid, L2)
                local = RUNNING_MAX_INIT
                j = sub
                while j < RG:
                    local = ti.max(local, part[h * RG + j])
                    j += L2
                part2[h * L2 + sub] = local
            ti.simt.block.sync()
            if tid < G:
                tile_max = part2[tid * L2]
                for j in range(1, L2):
                    tile_max = ti.max(tile_max, part2[tid * L2 + j])
                new_max = ti.max(state[tid], tile_max)
                state[G + tid] = ti.exp(state[tid] - new_max)
                state[tid] = new_max
            ti.simt.block.sync()
            # weights (rows past count: 0), the thread's running sums, the accumulators' rescale
            if tid < SCORE_THREADS:
                for i in ti.static(range(HB)):
                    h = h0 + i
                    m, f = state[h], state[G + h]
                    total = lsum[i] * f
                    for j in ti.static(range(RB)):
                        r = sr + j * RG
                        w = 0.0
                        if r < count:
                            w = ti.exp(sc[i, j] - m)
                        w_sh[h * WS + r] = w
                        total += w
                    lsum[i] = total
            if tid < VALUE_THREADS:
                for i in ti.static(range(VH)):
                    f = state[G + vh0 + i]
                    for j in ti.static(range(VD)):
                        acc[i, j] = acc[i, j] * f

            n_vc = (count + VR - 1) // VR  # V chunks past the tile's last row would only add zeros
            for c in range(n_vc):
                ahead = stage_chunk(v_plane, v_cur, buf, rows_sh, ahead, layer, kvh, False, c, n_vc, r_cur,
                                    count, tid)
                if tid < VALUE_THREADS:
                    lr = rs
                    while lr < VR:  # unrolled (VR // RS rows) it ran 2-4 % slower (run 8)
                        vv = ti.Vector([buf[lr * VS + dg + DG * j] for j in ti.static(range(VD))])
                        for i in ti.static(range(VH)):
                            w = w_sh[(vh0 + i) * WS + c * VR + lr]
                            for j in ti.static(range(VD)):
                                acc[i, j] = acc[i, j] + w * vv[j]
                        lr += RS
            ti.simt.block.sync()  # the next tile rewrites rows_sh, buf, w_sh and part
            o_first += R

        # S per head: the threads' running sums, reduced once per workgroup
        if tid < SCORE_THREADS:
            for i in ti.static(range(HB)):
                part[(h0 + i) * RG + sr] = lsum[i]
        ti.simt.block.sync()
        if tid < G * L2:
            h, sub = udiv(tid, L2), umod(tid, L2)
            total = 0.0
            j = sub
            while j < RG:
                total += part[h * RG + j]
                j += L2
            part2[h * L2 + sub] = total
        ti.simt.block.sync()
        if tid < G:
            total = 0.0
            for j in range(L2):
                total += part2[tid * L2 + j]
            partials[g, kvh * G + tid, wg, 0] = state[tid]
            partials[g, kvh * G + tid, wg, 1] = total
        # O per head: the RS row slices summed into slice 0 through buf, one slice at a time
        for s in range(1, RS):
            if rs == s:
                for i in ti.static(range(VH)):
                    for j in ti.static(range(VD)):
                        buf[(vh0 + i) * D + dg + DG * j] = acc[i, j]
            ti.simt.block.sync()
            if rs == 0:
                for i in ti.static(range(VH)):
                    for j in ti.static(range(VD)):
                        acc[i, j] = acc[i, j] + buf[(vh0 + i) * D + dg + DG * j]
            ti.simt.block.sync()
        if rs == 0:
            for i in ti.static(range(VH)):
                for j in ti.static(range(VD)):
                    partials[g, kvh * G + vh0 + i, wg, 2 + dg + DG * j] = acc[i, j]

    return work


def shared_arrays(plan: TilePlan) -> tuple:
    """The producer's shared memory for one workgroup, declared where it is called: in the body of the
    launch's loop, once per task.  A task that runs two producers (step_gpu.py) declares them once for
    both; Taichi 1.7.4 names a shared array after its statement id, which restarts in every task of a
    CUDA kernel, so shared arrays in two tasks of one kernel alias each other (an illegal address on the
    H200 where their sizes differed, docs/PERF.md run 11)."""
    G, D, R, RG, L2 = plan.G, plan.D, plan.R, plan.RG, plan.L2
    return (ti.simt.block.SharedArray((G * D,), ti.f32),  # q_sh: the group's queries
            ti.simt.block.SharedArray((plan.BUF,), ti.f32),  # buf: K chunk [R][KS] | V chunk [VR][VS] | O slices
            ti.simt.block.SharedArray((G * (R + 1),), ti.f32),  # w_sh: weights [h][r]
            ti.simt.block.SharedArray((G * RG,), ti.f32),  # part: per (head, row group): max, then sum
            ti.simt.block.SharedArray((G * L2,), ti.f32),  # part2
            ti.simt.block.SharedArray((2 * G,), ti.f32),  # state: running max M, this tile's factor
            ti.simt.block.SharedArray((R,), ti.i32))  # rows_sh: the tile rows' flat plane indices


__all__ = ["GPU_PRODUCER_THREADS", "SHARED_BUDGET_BYTES", "TilePlan", "describe_block_tile",
           "gpu_producer_work", "gpu_tile_plan", "item_prologue", "owned_rows", "query_stager", "shared_arrays",
           "tile_overrides"]
