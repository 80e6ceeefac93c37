"""The split-K producer's GPU path in warp tiles: each warp of a workgroup runs its own online softmax.

Why (docs/PERF.md run 14): the block-tiled producer (producer_gpu.py) spends 0.27 shared-memory
wavefronts per FFMA.  A warp there holds one group of 4 heads and 32 different K rows, so each of its K
reads is 32 distinct addresses (a full 128-byte wavefront for 4 FFMAs per lane), and each V read
serves 4 FFMAs.  At the FFMA rate of an SM (4 warp instructions a cycle) that asks for more than the one
wavefront a cycle that the L1/shared pipe has, and the run-12 variant that only widened those loads to
128 bits kept their wavefronts (and its time), with ncu rating that pipe 74 % busy.

Here a warp's 32 lanes are HGL head groups x RGL row groups (4 x 8 for 16 heads per KV head).  Each
lane owns 4 heads x 4 rows of scores and the same 4 heads x VD dims of the output, so:

* scores: per 4 dimensions a lane reads 4 K rows and 4 query rows as 128-bit loads and does 64 FFMAs;
  a warp's K read is 8 rows x 16 bytes (one wavefront), its query read 4 heads x 16 bytes;
* values: per row a lane reads its 4 weights (stored in the lane's head order, one 128-bit load) and
  VD dims (VD / 4 loads, RGL lanes side by side: one wavefront each) for 4 x VD FFMAs;

which is 0.14 wavefronts per FFMA, and 1.4 instructions per FFMA against 2.1.  The max and the sum of
a head reduce over the RGL lanes that share its head group through the warp's own few floats of
shared memory.

A warp owns a run of RW = 4 x RGL rows of each W x RW-row tile of the workgroup's rows (W = WARPS = 4
warps, knob WW) and keeps its own running max, sum and accumulators, so on CUDA the warps never wait for
each other inside the row loop (``ti.simt.warp.sync``): a barrier convoy of 4 warps per chunk is what the
block tile pays, with 2 workgroups an SM.  The W warps' summaries are merged once, at the end, in a fixed
order.  SPIR-V (Vulkan, Metal) has no warp barrier in Taichi 1.7.4, so there every warp sync is a
workgroup barrier: the same code, with every loop's trip count uniform across the workgroup.

K and V are staged through each warp's buffer in chunks of CHUNK_HALVES halves (K: RW rows x DC dims,
V: VR rows x D), loaded a chunk ahead and kept packed (u32 words, halves.py) until they are stored,
as in the block tile.  Rows past a warp's count are the workgroup's last owned row (in bounds), with
weight 0.

Knob HW=2 (HEAD_WARPS says why) pairs the warps: the two warps of a row set walk the same RW rows, stage
each chunk together into one buffer, and split the G heads, each running its own online softmax for G / 2
of them; the row sets are merged at the end as the warps are at HW=1.

Where it applies (warp_tile_plan): 4 heads per lane (G % 4 == 0), head groups that divide a warp (G in
4, 8, 16, 32), at most 64 accumulators per lane (D x G <= 2048), and the shared memory of the backend:
37.2 KiB for Glimmer, so CUDA and Vulkan (48 KiB) but not Metal (32 KiB), which keeps the block tile.
Every other geometry takes the block tile.  MUSER_GPU_TILE=WT=0 forces the block tile (tune_gpu.py).
"""

from dataclasses import dataclass, field

import taichi as ti

from .. import backend
from .common import BLOCK_ROWS, RUNNING_MAX_INIT, VISIT_OWNER
from .halves import HALVES_PER_WORD, high, low
from .producer_gpu import item_prologue, owned_rows, query_stager, udiv, umod

WARP = 32  # lanes that share a warp sync (CUDA); the SPIR-V path syncs the workgroup instead
WARPS = 4  # per workgroup: 128 threads, the register cap of the block tile (255, see GPU_PRODUCER_THREADS).
#           Knob WW: more warps for more than 2 a scheduler (run 19's profile: ~50 % issue, each warp stalled
#           ~1.8 cycles an instruction).  They cost the registers: with Taichi's .minnctapersm 2, ptxas capped
#           160 and 192 threads alike at 168 registers (not 204 for 160; ten warps put three on some
#           scheduler's 16 K registers) and spilled 208-556 B; the tile also grows (160, 192 rows), so the
#           last of a workgroup's ~1,000 rows at depth fills less of it.  Run 21, CUPTI, one NoPE layer's
#           producer at 131,072 keys: WW=5 with XM 156.9 us, WW=6 (WC=512) with XM 143.2, against 101.3
MAX_WARPS = 8  # WW's range: 8 warps cap ptxas at 128 registers, below the 64 accumulators' working set
HEADS_PER_LANE = 4  # a lane's heads: hg, hg + HGL, ... (one 128-bit load of queries or weights)
ROWS_PER_LANE = 4  # RL: a lane's score rows, rg, rg + RGL, ...  RL = 8 (knob; 64-row warp tiles, 48,896 B shared)
#                   halves the once-a-tile work per row and bought nothing at depth (docs/PERF.md run 20): with
#                   XM, 254 registers and no spills, 131.8 against 129.8 us at 131,072 keys and 62.7 against 62.9
#                   at 32,768 (kernel profiler, one process); 53.9 against 40.6 us at 2,048, where a warp's 32
#                   rows fill half its tile.  Without XM it spilled 240 B at 255 registers: 114.9 against 101.2 us
#                   (CUPTI) at 131,072 keys
MAX_ACCUMULATORS = 64  # 4 heads x VD dims per lane: 4 x 16 for Glimmer.  With the scores and a chunk in
#                       flight ptxas takes 254-255 of the 255 registers (no spills at WU = 1 or 8, 8 bytes at 2
#                       and 4; docs/PERF.md run 14), so 2 workgroups an SM: 8 warps, as the block tile.
#                       Fewer accumulators do not buy occupancy: splitting a KV head's 16 heads over 2
#                       workgroups (32 accumulators) still took 254 registers, ptxas spending the rest of
#                       Taichi's cap on the unroll, and with each row staged twice the producer ran 138.5
#                       against 106.1 us at 131,072 keys (run 17; with the cap forced to 168 it spilled)
CHUNK_HALVES = 1024  # per warp and chunk: 16 words per lane in flight; K chunk RW x DC, V chunk VR x D.
#                     A tile's first V chunk and the next tile's first K chunk are loaded only when their phase
#                     starts (two exposed latencies a tile).  Loading each under the other phase's last chunk
#                     kept the next rows' buffer, a flag and a branch live across the K loop: 255 registers, 136 B
#                     of stack, 8 B spilled, 117.6 against 106 us at 131,072 keys (run 18, patch kept there).
#                     Building the next tile's row table in the value loop instead, its first K chunk loaded under
#                     the last V chunk (knob KP, docs/perf/h200/run19/next-tile-prefetch.patch): 254 registers, no
#                     spills, and no gain, 103.4 against 102.1 us (CUPTI; run 20).  Those latencies are not what
#                     binds the deep layer (RL above says the same)
CHUNK_CHOICES = (256, 512, 1024, 2048)  # knob WC: a chunk's halves; 512 halve a warp's buffer, so 6 warps fit
#                                        48 KiB (and 4 warps would fit Metal's 32 KiB, 29,952 B: not run there)
CHUNKS_AHEAD = 1  # CA: chunks whose loads are in flight while one is computed (knob CA=2: two, 16 more registers,
#                    which XM frees; the V phase's first two loads then go out during the K phase's last two
#                    chunks).  Run 20's hypothesis, that loads in flight bind the deep layer, did not hold (run 21,
#                    CUPTI, one NoPE layer's producer at 131,072 keys): CA=2 110.2 us (255 registers, 100 B
#                    spilled), CA=2 with XM 106.0 us (254, no spills), against 101.3-101.7.  ncu against XM alone:
#                    long-scoreboard stalls 0.52 -> 0.45 a warp instruction, but the chunk loop is not unrolled,
#                    so handing ahead2 to ahead is real MOVs (55.0 -> 57.6 M warp instructions, the top stalled
#                    instruction a MOV) and fixed-latency waits 0.44 -> 0.59
PAD = 4  # floats after each K chunk row and query row: rows a warp reads together fall in distinct banks.
#         A staged word's two halves go out as one STS.64 (ptxas pairs the stores; ncu on one NoPE layer at
#         131,072 keys, docs/PERF.md run 19: 1.05 M STS.64, shared stores 2.9 M wavefronts against 10.6 M for
#         loads, the pipe ~49 % busy).  Staggering lanes 16-31 into 32-bit stores of the high half first, and
#         writing a row's 4 weights side by side, each took registers the cap does not have: 255 and 108 / 228 B
#         spilled, 170.8 / 176.4 against 152.8 us under the profiler (run 19, patch kept there)
FULL_MASK = 0xFFFFFFFF
UNROLL = {"cuda": 8}  # WU, by arch (1 elsewhere): steps of the score loop (4 dims) and of the value loop (a row)
#                      unrolled in the kernel source;
#            8 unrolls both chunks whole, so every shared-memory offset is an immediate and ptxas can hoist a
#            chunk's loads above its FFMAs.  One NoPE layer's producer on the H200 (Taichi's kernel profiler,
#            one process, run 14): 163.7 / 159.3 / 157.0 / 140.2 us at 131,072 keys for WU = 1 / 2 / 4 / 8
#            (85.5 / 82.6 / 86.1 / 74.8 at 32,768), block tile 175.0 (79.3).  The price: ~50 s to compile
#            a producer on CUDA the first time (Taichi's offline cache keeps it), 2.4 s at WU = 1.  Not on
#            SPIR-V: lavapipe (CI) took over 10 minutes to compile the one-dispatch step with WU = 8, and on the
#            H200's Vulkan driver WU = 4 ran one NoPE layer at 131,072 keys in 656 against 200 us (device time
#            from graph replays, docs/PERF.md run 26; no launch bound there, so the driver picks the registers).
#            The other knobs lost there too: WW=1 / WW=2 / HW=2 / the block tile 306 / 256 / 248 / 306 us
SHUFFLE_MAX = {}  # XM, by arch (0 elsewhere): the tile max of a head over its RGL lanes by a butterfly of
#                   log2(RGL) warp shuffles, where shared memory takes a store, a warp sync and a chain of RGL - 1
#                   loads per head.  Max is exact, so the bits are XM=0's (checked on the H200 at 2,048-131,072
#                   keys).  Not on by default: the same time (producer 101.3 / 101.4 against 101.2 / 102.1 us at
#                   131,072 keys, CUPTI, two calls, docs/PERF.md run 20), though it frees 20 registers (234
#                   against 254), which RL = 8 needs to run without spills

HEAD_WARPS = 1  # HW: warps that share a row set and its staged chunks, each with G / HW of the heads (knob HW=2: RGL
#                doubles, so a lane holds 4 heads x VD / 2 dims, 32 accumulators, and a row set is 2 x RW rows).
#                The point is registers without staging twice: run 17 split the heads over 2 workgroups that
#                each staged every row (254 registers all the same, +30 % time); here the HW warps stage a chunk
#                together (LOADS / HW words a lane) and sync the workgroup for it, so 6 warps (cap 168) or 8
#                (cap 128) could run 3 or 4 a scheduler.  Every sync is then a workgroup barrier, as on SPIR-V.
#                Measured (docs/PERF.md run 25): ptxas still fills the cap, 254 registers at 4 warps, and at 6 or
#                8 warps it spills 670-850 B even unrolled x1-x2.  At 4 warps, same occupancy, the deep layer
#                got slower: producer 118-119 against 96 us at 131,072 keys (HW=2,XM=1, CUPTI); ncu on HW=2,
#                118.9 against 97.2 us: 58.3 M against 55.1 M warp instructions, at 47 % issue against 55 %.
#                Only short contexts gain: HW=2,WW=2 (64 threads, one 64-row set) 14.1 against 17.8 us at 2,048
#                keys, but 40 against 31 at 32,768.  So HW = 1
MAX_HEAD_WARPS = 2  # HW's range: a V row's DW words cover HW x 32 staging lanes (64 words at head_dim 128)

WARP_TILE_KNOBS = ("WU", "XM", "RL", "CA", "WW", "WC", "HW")  # MUSER_GPU_TILE's knobs that warp_tile_plan takes


@dataclass(frozen=True)
class WarpTilePlan:
    """The static shape of the warp-tiled producer for one (G, D)."""

    G: int
    D: int
    HGL: int  # head groups per warp (lanes along heads, G / (4 HW) of them)
    RGL: int  # row groups per warp (lanes along rows)
    RW: int  # rows per row set and tile (RGL x RL): a warp's own rows, or its HW warps' shared rows
    DC: int  # K chunk dims
    VR: int  # V chunk rows
    VD: int  # value dims per lane: 4*dv + 4*RGL*jj + e
    BUF: int  # floats in a row set's K/V chunk buffer
    shared_bytes: int
    WU: int = 1
    XM: int = 0  # the tile max across a head group's lanes by warp shuffles (CUDA), not through shared memory
    RL: int = ROWS_PER_LANE  # score rows per lane
    CA: int = 1  # chunks of K/V loads in flight ahead of the one being stored (CHUNKS_AHEAD says why)
    W: int = WARPS  # warps per workgroup
    CH: int = CHUNK_HALVES  # halves per row set and chunk
    HW: int = HEAD_WARPS  # warps per row set, each with G / HW heads
    T: int = field(init=False)  # threads per workgroup, WARP x W
    GW: int = field(init=False)  # heads per warp, G / HW
    WR: int = field(init=False)  # row sets per workgroup, W / HW

    def __post_init__(self):  # derived, so a plan cannot disagree with its warps
        object.__setattr__(self, "T", WARP * self.W)
        object.__setattr__(self, "GW", self.G // self.HW)
        object.__setattr__(self, "WR", self.W // self.HW)


def warp_tile_plan(G: int, D: int, budget: int, WU: int | None = None, arch: str | None = None,
                   XM: int | None = None, RL: int = ROWS_PER_LANE, CA: int = CHUNKS_AHEAD, WW: int = WARPS,
                   WC: int = CHUNK_HALVES, HW: int = HEAD_WARPS) -> WarpTilePlan | None:
    """The warp tile for G heads per KV head at head_dim D within ``budget`` bytes of shared memory, or
    None where it does not apply (the block tile runs there); pure arithmetic, tested.  WU and XM default
    to UNROLL's and SHUFFLE_MAX's for ``arch`` (the active backend's when None); RL: score rows per lane;
    CA: chunks in flight ahead (CHUNKS_AHEAD); WW: warps per workgroup (WARPS); WC: halves per row set and
    chunk (CHUNK_HALVES); HW: warps per row set (HEAD_WARPS)."""
    if not 1 <= WW <= MAX_WARPS:
        raise ValueError(f"warp tile WW={WW}: expected 1 to {MAX_WARPS} warps per workgroup")
    if WC not in CHUNK_CHOICES:
        raise ValueError(f"warp tile WC={WC}: expected one of {CHUNK_CHOICES} halves per row set and chunk")
    if RL not in (4, 8):
        raise ValueError(f"warp tile RL={RL}: expected 4 or 8 score rows per lane")
    if not 1 <= HW <= MAX_HEAD_WARPS or WW % HW:
        raise ValueError(f"warp tile HW={HW}: expected 1 to {MAX_HEAD_WARPS} warps per row set, dividing WW={WW}")
    if CA not in (1, 2):
        raise ValueError(f"warp tile CA={CA}: expected 1 or 2 chunks in flight ahead")
    arch = arch or backend.active()
    if WU is None:
        WU = UNROLL.get(arch, 1)
    if WU < 1:  # each loop unrolls by the largest divisor of its steps up to WU
        raise ValueError(f"warp tile unroll WU={WU}: expected a positive integer")
    if XM is None:
        XM = SHUFFLE_MAX.get(arch, 0)
    if XM not in (0, 1):
        raise ValueError(f"warp tile XM={XM}: expected 0 or 1")
    if XM and arch != "cuda":
        raise ValueError(f"warp tile XM={XM} on {arch}: warp shuffles run on CUDA only in Taichi 1.7.4 "
                         f"(they return 0 on the CPU and do not compile for SPIR-V); expected XM=0 there")
    GW = G // HW  # heads per warp
    if G % HW or GW % HEADS_PER_LANE or WARP % (GW // HEADS_PER_LANE):
        return None
    HGL = GW // HEADS_PER_LANE
    RGL = WARP // HGL
    RW = RGL * RL
    VD = D // RGL
    if HEADS_PER_LANE * VD > MAX_ACCUMULATORS or VD % 4 or D % (4 * RGL):
        return None
    DC, VR = WC // RW, WC // D
    if DC < 4 or DC % 4 or D % DC or VR < 1 or RW % VR:
        return None
    SL, DCW, DW = WARP * HW, DC // HALVES_PER_WORD, D // HALVES_PER_WORD  # a row set's staging lanes
    if WC % (HALVES_PER_WORD * SL) or SL % DCW or DW % SL:  # a lane's chunk cells: static offsets
        return None
    buf = max(RW * (DC + PAD), VR * D)
    WR = WW // HW
    floats = G * (D + PAD) + WR * (buf + RW * G) + WW * (RGL * GW + 2 * GW)
    shared = 4 * (floats + WR * RW)
    if shared > budget:
        return None
    return WarpTilePlan(G, D, HGL, RGL, RW, DC, VR, VD, buf, shared, WU, XM, RL, CA, WW, WC, HW)


def describe_warp_tile(p: WarpTilePlan, budget: int) -> str:
    """A warp tile in words (producer.describe_plans prints one per backend)."""
    rows = (f"each warp its own {p.RW} rows" if p.HW == 1 else
            f"{p.HW} warps ({p.GW} heads each) sharing {p.RW} rows")
    return (f"warp tiles, {p.T} threads, {rows} of a {p.WR * p.RW}-row tile; scores "
            f"{HEADS_PER_LANE} heads x {p.RL} rows and values {HEADS_PER_LANE} heads x {p.VD} dims per "
            f"lane; K chunks of {p.DC} dims, V chunks of {p.VR} rows, loops unrolled x{p.WU}; "
            f"{p.shared_bytes / 1024:.1f} of {budget // 1024} KiB shared")


def warp_shared_arrays(plan: WarpTilePlan) -> tuple:
    """The warp-tiled producer's shared memory for one workgroup (declared where called, as
    producer_gpu.shared_arrays says why)."""
    p = plan
    return (ti.simt.block.SharedArray((p.G * (p.D + PAD),), ti.f32),  # q_sh [h][D + PAD]; at the end, O
            ti.simt.block.SharedArray((p.WR * p.BUF,), ti.f32),  # per row set: K chunk [RW][DC+PAD] | V [VR][D]
            ti.simt.block.SharedArray((p.WR * p.RW * p.G,), ti.f32),  # per row set: weights [row][warp, lane heads]
            ti.simt.block.SharedArray((p.W * p.RGL * p.GW,), ti.f32),  # per warp: [row group][lane head order]
            ti.simt.block.SharedArray((p.W * 2 * p.GW,), ti.f32),  # per warp: M, S (the final merge)
            ti.simt.block.SharedArray((p.WR * p.RW,), ti.i32))  # per row set: its tile rows' flat plane indices


def warp_producer_work(plan: WarpTilePlan, bypass: bool, record: bool, at, fused_store: bool, layer_base: int = 0,
                       slot_is_group: bool = False):
    """The warp-tiled producer's per-thread work: the same ti.func signature, arguments and outputs as
    producer_gpu.gpu_producer_work (whose docstring says what the flags mean)."""
    p = plan
    G, D, C = p.G, p.D, BLOCK_ROWS
    HGL, RGL, RW, DC, VR, VD, BUF = p.HGL, p.RGL, p.RW, p.DC, p.VR, p.VD, p.BUF
    HL, RL, W, HW, GW, WR = HEADS_PER_LANE, p.RL, p.W, p.HW, p.GW, p.WR
    KS, QS = DC + PAD, D + PAD  # strides of a K chunk row and a query row
    DCW, DW = DC // HALVES_PER_WORD, D // HALVES_PER_WORD  # words per K chunk row, per V row
    SL = WARP * HW  # lanes that stage a row set's chunks (its HW warps)
    LOADS = p.CH // (HALVES_PER_WORD * SL)  # words per lane per chunk
    NKC, NVC = D // DC, RW // VR
    TILE = WR * RW
    assert SL % DCW == 0 and DW % SL == 0, (DCW, DW, SL)  # a lane's chunk cells are static offsets
    warp_barrier = backend.active() == "cuda" and HW == 1  # HW > 1: a shared buffer, so a workgroup barrier
    prologue = item_prologue(at, DW, p.T, fused_store, layer_base, slot_is_group)
    stage_queries = query_stager(G, D, p.T, QS)
    SU = max(u for u in range(1, p.WU + 1) if (DC // 4) % u == 0)  # unrolled score steps
    VU = max(u for u in range(1, p.WU + 1) if VR % u == 0)  # unrolled value rows

    @ti.func
    def warp_sync():  # the lanes that share a buffer: a warp, or (HW > 1, SPIR-V) the workgroup
        if ti.static(warp_barrier):
            ti.simt.warp.sync(ti.u32(FULL_MASK))
        else:
            ti.simt.block.sync()

    @ti.func
    def load_chunk(plane: ti.template(), rows_sh: ti.template(), is_k: ti.template(), c, wrow, sl):
        """Staging lane sl's LOADS words of chunk c (K: dims c*DC.., V: rows c*VR..), kept packed."""
        stage = ti.Vector([0] * LOADS, dt=ti.u32)
        for k in ti.static(range(LOADS)):
            if ti.static(is_k):  # word sl + SL k: row sl // DCW + k * (SL // DCW), column sl % DCW
                r = udiv(sl, DCW) + k * (SL // DCW)
                stage[k] = at.plane_flat(plane, rows_sh[wrow + r] + c * DCW + umod(sl, DCW))
            else:  # row k // (DW // SL), column sl + SL * (k % (DW // SL))
                r = k // (DW // SL)
                stage[k] = at.plane_flat(plane, rows_sh[wrow + c * VR + r] + sl + SL * (k % (DW // SL)))
        return stage

    @ti.func
    def store_chunk(buf: ti.template(), stage: ti.template(), is_k: ti.template(), wbuf, sl):
        for k in ti.static(range(LOADS)):
            base = 0
            if ti.static(is_k):
                base = wbuf + (udiv(sl, DCW) + k * (SL // DCW)) * KS + HALVES_PER_WORD * umod(sl, DCW)
            else:
                base = wbuf + (k // (DW // SL)) * D + HALVES_PER_WORD * (sl + SL * (k % (DW // SL)))
            buf[base] = low(stage[k])
            buf[base + 1] = high(stage[k])

    @ti.func
    def store_stage(cur: ti.template(), buf: ti.template(), ahead, layer, kvh, is_k: ti.template(), c, has_cur, r_cur,
                    count, wbuf, sl):
        """Chunk c (its loads in ``ahead``) into the row set's buffer between two warp syncs, the bypass row
        patched in (only in the tile that holds the current token, a workgroup-uniform test, so the SPIR-V
        barriers stay uniform)."""
        warp_sync()  # every lane is done reading the previous chunk
        store_chunk(buf, ahead, is_k, wbuf, sl)
        if ti.static(bypass):
            if has_cur:
                warp_sync()  # the patch overwrites cells other lanes stored
                if ti.static(is_k):
                    if r_cur >= 0 and r_cur < count:
                        dd = sl
                        while dd < DC:
                            buf[wbuf + r_cur * KS + dd] = cur[layer, kvh, c * DC + dd]
                            dd += SL
                else:
                    if r_cur >= c * VR and r_cur < ti.min(count, c * VR + VR):
                        e = sl
                        while e < D:
                            buf[wbuf + (r_cur - c * VR) * D + e] = cur[layer, kvh, e]
                            e += SL
        warp_sync()

    @ti.func
    def stage_chunk(plane: ti.template(), cur: ti.template(), buf: ti.template(), rows_sh: ti.template(), ahead,
                    layer, kvh, is_k: ti.template(), c, n_chunks: ti.template(), has_cur, r_cur, count, wbuf, wrow,
                    sl):
        """store_stage, then chunk c+1's loads, returned: in flight while chunk c's FMAs run."""
        store_stage(cur, buf, ahead, layer, kvh, is_k, c, has_cur, r_cur, count, wbuf, sl)
        nxt = ahead
        if c + 1 < n_chunks:
            nxt = load_chunk(plane, rows_sh, is_k, c + 1, wrow, sl)
        return nxt

    @ti.func
    def load_in_tile(k_plane: ti.template(), v_plane: ti.template(), rows_sh: ti.template(), i, wrow, sl):
        """Chunk i of a tile's sequence, K chunks 0 .. NKC - 1 then V chunks (CA = 2: two chunks ahead, so a
        K chunk's stage loads a V chunk near the phase's end); nothing past the tile's last chunk."""
        stage = ti.Vector([0] * LOADS, dt=ti.u32)
        if i < NKC:
            stage = load_chunk(k_plane, rows_sh, True, i, wrow, sl)
        elif i < NKC + NVC:
            stage = load_chunk(v_plane, rows_sh, False, i - NKC, wrow, sl)
        return stage

    @ti.func
    def work(tid, item, shared: ti.template(), q: ti.template(), k_cur: ti.template(), v_cur: ti.template(),
             k_plane: ti.template(), v_plane: ti.template(), partials: ti.template(), visits: ti.template(),
             layers: ti.template(), slots: ti.template(), position, window, capacity, origin_logical, origin_physical,
             nwg, nsg, scale):
        g, kvh, wg, logical_start, visible, layer, slot = prologue(
            tid, item, k_cur, v_cur, k_plane, v_plane, layers, slots, position, window, capacity, origin_logical,
            origin_physical, nwg)
        q_sh, buf, w_sh, part, state, rows_sh = shared
        w, lane = udiv(tid, WARP), umod(tid, WARP)
        wr, hw = udiv(w, HW), umod(w, HW)  # the warp's row set and its share of the heads, h0 .. h0 + GW
        sl, h0 = hw * WARP + lane, hw * GW  # sl: the lane's place among its row set's staging lanes
        hg, rg = umod(lane, HGL), udiv(lane, HGL)  # heads hg + HGL*i; score rows rg + RGL*j; dims 4*rg + 4*RGL*jj
        wbuf, wrow, wpart, wwt = wr * BUF, wr * RW, w * RGL * GW, wr * RW * G
        stage_queries(q, q_sh, layer, kvh * G, tid, scale)  # scaled: the scores need no multiply
        run, n_own, o_cur = owned_rows(visible, wg, nwg, nsg)
        ti.simt.block.sync()

        m = ti.Vector([RUNNING_MAX_INIT] * HL)  # this lane's heads: running max, its rows' sum of weights
        lsum = ti.Vector([0.0] * HL)
        acc = ti.Matrix.zero(ti.f32, HL, VD)
        o_first = 0
        while o_first < n_own:  # uniform across the workgroup; each row set takes rows base .. base + RW
            base = o_first + wr * RW
            count = ti.max(0, ti.min(RW, n_own - base))
            has_cur = o_cur >= o_first and o_cur < o_first + TILE
            r_cur = o_cur - base
            i = sl
            while i < RW:
                o = ti.min(base + i, n_own - 1)
                rel = (wg + (o // run) * nwg) * run + o % run
                rows_sh[wrow + i] = at.row_offset(k_plane, slot, kvh, at.physical_of(
                    logical_start + rel, capacity, origin_logical, origin_physical))
                if ti.static(record):
                    if base + i < n_own and rel % C == 0:
                        ti.atomic_add(visits[g, rel // C], 1 + VISIT_OWNER * wg)
                i += SL
            warp_sync()

            sc = ti.Matrix.zero(ti.f32, HL, RL)
            ahead = load_chunk(k_plane, rows_sh, True, 0, wrow, sl)
            ahead2 = ti.Vector([0] * LOADS, dt=ti.u32)  # CA = 2: the chunk after ahead's
            if ti.static(p.CA == 2):
                ahead2 = load_in_tile(k_plane, v_plane, rows_sh, 1, wrow, sl)
            for c in range(NKC):
                if ti.static(p.CA == 2):
                    store_stage(k_cur, buf, ahead, layer, kvh, True, c, has_cur, r_cur, count, wbuf, sl)
                    ahead = ahead2
                    ahead2 = load_in_tile(k_plane, v_plane, rows_sh, c + 2, wrow, sl)
                else:
                    ahead = stage_chunk(k_plane, k_cur, buf, rows_sh, ahead, layer, kvh, True, c, NKC, has_cur,
                                        r_cur, count, wbuf, wrow, sl)
                for step in range(DC // (4 * SU)):
                    for u in ti.static(range(SU)):  # dims c*DC + 4*d4 + e, in increasing order in every sum
                        d4 = step * SU + u
                        kf = ti.Matrix([[buf[wbuf + (rg + RGL * j) * KS + 4 * d4 + e] for e in ti.static(range(4))]
                                        for j in ti.static(range(RL))])
                        for hi in ti.static(range(HL)):
                            qf = ti.Vector([q_sh[(h0 + hg + HGL * hi) * QS + c * DC + 4 * d4 + e]
                                            for e in ti.static(range(4))])
                            for j in ti.static(range(RL)):
                                s = sc[hi, j]
                                for e in ti.static(range(4)):
                                    s = s + qf[e] * kf[j, e]
                                sc[hi, j] = s

            if ti.static(p.CA == 1):  # (CA = 2: V chunks 0 and 1 are in flight already)
                ahead = load_chunk(v_plane, rows_sh, False, 0, wrow, sl)  # in flight under the softmax
            # the tile max of each head over the RGL lanes of its head group (lanes hg + HGL*r): by warp
            # shuffles (XM) or through the warp's part
            local = ti.Vector([RUNNING_MAX_INIT] * HL)
            for hi in ti.static(range(HL)):
                for j in ti.static(range(RL)):
                    if rg + RGL * j < count:
                        local[hi] = ti.max(local[hi], sc[hi, j])
            if ti.static(p.XM):
                for k in ti.static(range(RGL.bit_length() - 1)):  # RGL = 32 / HGL, a power of 2
                    for hi in ti.static(range(HL)):
                        local[hi] = ti.max(local[hi], ti.simt.warp.shfl_sync_f32(
                            ti.u32(FULL_MASK), local[hi], lane ^ (HGL << k)))
            else:
                for hi in ti.static(range(HL)):
                    part[wpart + rg * GW + hg * HL + hi] = local[hi]
                warp_sync()
                for hi in ti.static(range(HL)):
                    tile_max = part[wpart + hg * HL + hi]
                    for r in range(1, RGL):
                        tile_max = ti.max(tile_max, part[wpart + r * GW + hg * HL + hi])
                    local[hi] = tile_max
            for hi in ti.static(range(HL)):
                new_max = ti.max(m[hi], local[hi])
                f = ti.exp(m[hi] - new_max)
                m[hi] = new_max
                total = lsum[hi] * f
                for j in ti.static(range(RL)):
                    wt = 0.0
                    if rg + RGL * j < count:
                        wt = ti.exp(sc[hi, j] - new_max)
                    w_sh[wwt + (rg + RGL * j) * G + h0 + hg * HL + hi] = wt
                    total += wt
                lsum[hi] = total
                for x in ti.static(range(VD)):
                    acc[hi, x] = acc[hi, x] * f

            for c in range(NVC):
                if ti.static(p.CA == 2):
                    store_stage(v_cur, buf, ahead, layer, kvh, False, c, has_cur, r_cur, count, wbuf, sl)
                    ahead = ahead2
                    ahead2 = load_in_tile(k_plane, v_plane, rows_sh, NKC + c + 2, wrow, sl)
                else:
                    ahead = stage_chunk(v_plane, v_cur, buf, rows_sh, ahead, layer, kvh, False, c, NVC, has_cur,
                                        r_cur, count, wbuf, wrow, sl)
                for step in range(VR // VU):
                    for u in ti.static(range(VU)):
                        r = step * VU + u
                        wf = ti.Vector([w_sh[wwt + (c * VR + r) * G + h0 + hg * HL + hi]
                                        for hi in ti.static(range(HL))])
                        for jj in ti.static(range(VD // 4)):
                            vf = ti.Vector([buf[wbuf + r * D + 4 * rg + 4 * RGL * jj + e]
                                            for e in ti.static(range(4))])
                            for hi in ti.static(range(HL)):
                                for e in ti.static(range(4)):
                                    acc[hi, 4 * jj + e] = acc[hi, 4 * jj + e] + wf[hi] * vf[e]
            o_first += TILE

        # the warp's sums over its row groups (part is free: every lane passed the last V chunk's syncs)
        for hi in ti.static(range(HL)):
            part[wpart + rg * GW + hg * HL + hi] = lsum[hi]
        warp_sync()
        for hi in ti.static(range(HL)):
            total = 0.0
            for r in range(RGL):
                total += part[wpart + r * GW + hg * HL + hi]
            lsum[hi] = total
        if rg == 0:
            for hi in ti.static(range(HL)):
                state[w * 2 * GW + hg * HL + hi] = m[hi]
                state[w * 2 * GW + GW + hg * HL + hi] = lsum[hi]
        ti.simt.block.sync()  # every warp is past its rows: q_sh is free for the merge of O
        # merge the WR row sets in order (warps wr * HW + hw, one per row set, hold heads h0 ..): M = max M_w,
        # S = sum S_w f_w, O = sum O_w f_w with f_w = exp(M_w - M)
        fw = ti.Vector([0.0] * HL)
        for hi in ti.static(range(HL)):
            gmax = state[hw * 2 * GW + hg * HL + hi]
            for u in ti.static(range(1, WR)):
                gmax = ti.max(gmax, state[(u * HW + hw) * 2 * GW + hg * HL + hi])
            fw[hi] = ti.exp(m[hi] - gmax)
            if wr == 0 and rg == 0:
                total = 0.0
                for u in ti.static(range(WR)):
                    su = (u * HW + hw) * 2 * GW + hg * HL + hi
                    total += state[su + GW] * ti.exp(state[su] - gmax)
                partials[g, kvh * G + h0 + hg + HGL * hi, wg, 0] = gmax
                partials[g, kvh * G + h0 + hg + HGL * hi, wg, 1] = total
        # Known deficit: warp W - 1 writes all of O alone, reloading the ndarray's shape and pointer after every
        # store (~4 % of the stall samples at 131,072 keys, run 21).  Every thread writing O from q_sh instead
        # (the tail half of docs/perf/h200/run23/entry-and-tail.patch) saves ~1 us alone (CUPTI, one NoPE layer's
        # producer, run 24: 19.9 / 32.3 / 100.4 against 20.7 / 33.3 / 101.3 us at 2,048 / 32,768 / 131,072 keys),
        # but beside the query copy above it cost ~6 us at depth (102.4 against 96.1; run 23's profile: ptxas put
        # 22 local loads and stores in the chunk loops instead of 4), so it is not kept
        for u in ti.static(range(WR)):
            if wr == u:
                for hi in ti.static(range(HL)):
                    for jj in ti.static(range(VD // 4)):
                        for e in ti.static(range(4)):
                            d = 4 * rg + 4 * RGL * jj + e
                            val = acc[hi, 4 * jj + e] * fw[hi]
                            if ti.static(u > 0):
                                val = q_sh[(h0 + hg * HL + hi) * D + d] + val
                            if ti.static(u < WR - 1):
                                q_sh[(h0 + hg * HL + hi) * D + d] = val
                            else:
                                partials[g, kvh * G + h0 + hg + HGL * hi, wg, 2 + d] = val
            if ti.static(u < WR - 1):
                ti.simt.block.sync()

    return work


__all__ = ["WARP_TILE_KNOBS", "WarpTilePlan", "describe_warp_tile", "warp_producer_work", "warp_shared_arrays",
           "warp_tile_plan"]
