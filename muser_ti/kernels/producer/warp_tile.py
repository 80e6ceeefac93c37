"""The GPU producer's warp tile: each warp of a workgroup runs its own online softmax over its own rows.

Why: in the block tile (block_tile.py) a warp holds one group of 4 heads and 32 different K rows, so each
of its K reads is 32 distinct addresses, a full shared-memory wavefront for 4 FMAs a lane; at an SM's FMA
rate that asks more of the shared-memory pipe than it has.  Here a warp's 32 lanes are HGL head groups x
RGL row groups (4 x 8 for 16 heads per KV head), and each lane owns 4 heads x 4 rows of scores and the
same 4 heads x VD dims of the output:

* scores: per 4 dimensions a lane reads 4 K rows and 4 query rows as 128-bit loads and does 64 FMAs; a
  warp's K read is 8 rows x 16 bytes (one wavefront);
* values: per row a lane reads its 4 weights (one 128-bit load) and VD dims (VD / 4 loads, RGL lanes side
  by side: one wavefront each) for 4 x VD FMAs;

which halves the shared-memory wavefronts and the instructions per FMA.  The max and the sum of a head
reduce over the RGL lanes that share its head group through the warp's own few floats of shared memory.

A warp owns a run of RW = 4 x RGL rows of each WARPS x RW-row tile of the workgroup's rows and keeps its
own running max, sum and accumulators, so on CUDA the warps never wait for each other inside the row loop
(``ti.simt.warp.sync``); their summaries are merged once, at the end, in a fixed order.  SPIR-V (Vulkan,
Metal) has no warp barrier in Taichi 1.7.4, so there every warp sync is a workgroup barrier: the same
code, with every loop's trip count uniform across the workgroup.

K and V are staged through each warp's buffer in chunks of CHUNK_HALVES halves (K: RW rows x DC dims,
V: VR rows x D), loaded a chunk ahead and kept packed (u32 words, halves.py) until they are stored.
Rows past a warp's count are the workgroup's last owned row (in bounds), with weight 0.

Where it applies (warp_tile_plan): 4 heads per lane (G % 4 == 0), head groups that divide a warp (G in
4, 8, 16, 32), at most 64 accumulators per lane (D x G <= 2048), and the backend's shared memory: 37.2 KiB
for Glimmer, so CUDA and Vulkan (48 KiB) but not Metal (32 KiB).  Every other geometry runs the block tile.
Known deficit: issue-bound at depth (254 registers, 2 warps a scheduler, ~50-60 % issue); the variants
that tried to hide more or do less are in docs/lab/runs.md's kernel history.
"""

from dataclasses import dataclass, field

import taichi as ti

from ... import backend
from ..common import BLOCK_ROWS, RUNNING_MAX_INIT, VISIT_OWNER
from ..halves import HALVES_PER_WORD, high, low
from .gpu_common import item_prologue, owned_rows, query_stager, udiv, umod

WARP = 32  # lanes that share a warp sync (CUDA); the SPIR-V path syncs the workgroup instead
WARPS = 4  # per workgroup: 128 threads, so ptxas may use 255 registers (Taichi's .minnctapersm 2)
HEADS_PER_LANE = 4  # a lane's heads: hg, hg + HGL, ... (one 128-bit load of queries or weights)
ROWS_PER_LANE = 4  # a lane's score rows, rg, rg + RGL, ...
MAX_ACCUMULATORS = 64  # 4 heads x VD dims per lane: 4 x 16 for Glimmer, which with the scores and a chunk in
#                       flight fills the 255 registers: 2 workgroups an SM, as the block tile
CHUNK_HALVES = 1024  # per warp and chunk: 16 words a lane in flight; K chunk RW x DC, V chunk VR x D
PAD = 4  # floats after each K chunk row and query row: rows a warp reads together fall in distinct banks
FULL_MASK = 0xFFFFFFFF
UNROLL = {"cuda": 8}  # steps of the score loop (4 dims) and of the value loop (a row) unrolled in the source, by
#                      arch (1 elsewhere): 8 unrolls both chunks whole, so every shared offset is an immediate.
#                      Its price: ~50 s to compile a producer on CUDA the first time (MUSER_GPU_UNROLL=1: 2 s);
#                      on SPIR-V unrolling was slower and lavapipe took minutes to compile it (docs/PERF.md)


@dataclass(frozen=True)
class WarpTilePlan:
    """The static shape of the warp tile for one (G, D)."""

    G: int
    D: int
    HGL: int  # head groups per warp (lanes along heads, G / 4 of them)
    RGL: int  # row groups per warp (lanes along rows)
    RW: int  # rows per warp and tile (RGL x ROWS_PER_LANE)
    DC: int  # K chunk dims
    VR: int  # V chunk rows
    VD: int  # value dims per lane: 4*dv + 4*RGL*jj + e
    BUF: int  # floats in a warp's K/V chunk buffer
    shared_bytes: int
    WU: int = 1  # the unroll (UNROLL)
    T: int = field(init=False, default=WARP * WARPS)  # threads per workgroup


def warp_tile_plan(G: int, D: int, budget: int, WU: int | None = None, arch: str | None = None) -> WarpTilePlan | None:
    """The warp tile for G heads per KV head at head_dim D within ``budget`` bytes of shared memory, or
    None where it does not apply (the block tile runs there); pure arithmetic, tested.  WU defaults to
    UNROLL's for ``arch`` (the active backend's when None)."""
    WU = UNROLL.get(arch or backend.active(), 1) if WU is None else WU
    if WU < 1:  # each loop unrolls by the largest divisor of its steps up to WU
        raise ValueError(f"warp tile unroll {WU}: expected a positive integer")
    if G % HEADS_PER_LANE or WARP % (G // HEADS_PER_LANE):
        return None
    HGL = G // HEADS_PER_LANE
    RGL = WARP // HGL
    RW = RGL * ROWS_PER_LANE
    VD = D // RGL
    if HEADS_PER_LANE * VD > MAX_ACCUMULATORS or VD % 4 or D % (4 * RGL):
        return None
    DC, VR = CHUNK_HALVES // RW, CHUNK_HALVES // D
    if DC < 4 or DC % 4 or D % DC or VR < 1 or RW % VR:
        return None
    DCW, DW = DC // HALVES_PER_WORD, D // HALVES_PER_WORD
    if CHUNK_HALVES % (HALVES_PER_WORD * WARP) or WARP % DCW or DW % WARP:  # a lane's chunk cells: static offsets
        return None
    buf = max(RW * (DC + PAD), VR * D)
    floats = G * (D + PAD) + WARPS * (buf + RW * G) + WARPS * (RGL * G + 2 * G)
    shared = 4 * (floats + WARPS * RW)
    if shared > budget:
        return None
    return WarpTilePlan(G, D, HGL, RGL, RW, DC, VR, VD, buf, shared, WU)


def describe_warp_tile(p: WarpTilePlan, budget: int) -> str:
    """A warp tile in words (producer.describe_plans prints one per backend)."""
    return (f"warp tiles, {p.T} threads, each warp its own {p.RW} rows of a {WARPS * p.RW}-row tile; scores "
            f"{HEADS_PER_LANE} heads x {ROWS_PER_LANE} rows and values {HEADS_PER_LANE} heads x {p.VD} dims per "
            f"lane; K chunks of {p.DC} dims, V chunks of {p.VR} rows, loops unrolled x{p.WU}; "
            f"{p.shared_bytes / 1024:.1f} of {budget // 1024} KiB shared")


def warp_shared_arrays(plan: WarpTilePlan) -> tuple:
    """The warp tile's shared memory for one workgroup (declared where called, as block_tile.shared_arrays
    says why)."""
    p = plan
    return (ti.simt.block.SharedArray((p.G * (p.D + PAD),), ti.f32),  # q_sh [h][D + PAD]; at the end, O
            ti.simt.block.SharedArray((WARPS * p.BUF,), ti.f32),  # per warp: K chunk [RW][DC+PAD] | V [VR][D]
            ti.simt.block.SharedArray((WARPS * p.RW * p.G,), ti.f32),  # per warp: weights [row][lane heads]
            ti.simt.block.SharedArray((WARPS * p.RGL * p.G,), ti.f32),  # per warp: [row group][lane head order]
            ti.simt.block.SharedArray((WARPS * 2 * p.G,), ti.f32),  # per warp: M, S (the final merge)
            ti.simt.block.SharedArray((WARPS * p.RW,), ti.i32))  # per warp: its tile rows' flat plane indices


def warp_producer_work(plan: WarpTilePlan, bypass: bool, record: bool, at, fused_store: bool, layer_base: int = 0,
                       slot_is_group: bool = False):
    """The warp tile's per-thread work: the same ti.func signature, arguments and outputs as
    block_tile.gpu_producer_work (whose docstring says what the flags mean)."""
    p = plan
    G, D, C = p.G, p.D, BLOCK_ROWS
    HGL, RGL, RW, DC, VR, VD, BUF = p.HGL, p.RGL, p.RW, p.DC, p.VR, p.VD, p.BUF
    HL, RL, W = HEADS_PER_LANE, ROWS_PER_LANE, WARPS
    KS, QS = DC + PAD, D + PAD  # strides of a K chunk row and a query row
    DCW, DW = DC // HALVES_PER_WORD, D // HALVES_PER_WORD  # words per K chunk row, per V row
    LOADS = CHUNK_HALVES // (HALVES_PER_WORD * WARP)  # words per lane per chunk
    NKC, NVC = D // DC, RW // VR
    TILE = W * RW
    assert WARP % DCW == 0 and DW % WARP == 0, (DCW, DW)  # a lane's chunk cells are static offsets
    warp_barrier = backend.active() == "cuda"
    prologue = item_prologue(at, DW, p.T, fused_store, layer_base, slot_is_group)
    stage_queries = query_stager(G, D, p.T, QS)
    SU = max(u for u in range(1, p.WU + 1) if (DC // 4) % u == 0)  # unrolled score steps
    VU = max(u for u in range(1, p.WU + 1) if VR % u == 0)  # unrolled value rows

    @ti.func
    def warp_sync():  # the lanes that share a buffer: a warp (CUDA), or the workgroup (SPIR-V)
        if ti.static(warp_barrier):
            ti.simt.warp.sync(ti.u32(FULL_MASK))
        else:
            ti.simt.block.sync()

    @ti.func
    def load_chunk(plane: ti.template(), rows_sh: ti.template(), is_k: ti.template(), c, wrow, lane):
        """The lane's LOADS words of chunk c (K: dims c*DC.., V: rows c*VR..), kept packed."""
        stage = ti.Vector([0] * LOADS, dt=ti.u32)
        for k in ti.static(range(LOADS)):
            if ti.static(is_k):  # word lane + WARP k: row lane // DCW + k * (WARP // DCW), column lane % DCW
                r = udiv(lane, DCW) + k * (WARP // DCW)
                stage[k] = at.plane_flat(plane, rows_sh[wrow + r] + c * DCW + umod(lane, DCW))
            else:  # row k // (DW // WARP), column lane + WARP * (k % (DW // WARP))
                r = k // (DW // WARP)
                stage[k] = at.plane_flat(plane, rows_sh[wrow + c * VR + r] + lane + WARP * (k % (DW // WARP)))
        return stage

    @ti.func
    def store_chunk(buf: ti.template(), stage: ti.template(), is_k: ti.template(), wbuf, lane):
        for k in ti.static(range(LOADS)):
            base = 0
            if ti.static(is_k):
                base = wbuf + (udiv(lane, DCW) + k * (WARP // DCW)) * KS + HALVES_PER_WORD * umod(lane, DCW)
            else:
                base = wbuf + (k // (DW // WARP)) * D + HALVES_PER_WORD * (lane + WARP * (k % (DW // WARP)))
            buf[base] = low(stage[k])
            buf[base + 1] = high(stage[k])

    @ti.func
    def stage_chunk(plane: ti.template(), cur: ti.template(), buf: ti.template(), rows_sh: ti.template(), ahead,
                    layer, kvh, is_k: ti.template(), c, n_chunks: ti.template(), has_cur, r_cur, count, wbuf, wrow,
                    lane):
        """Chunk c (its loads in ``ahead``) into the warp's buffer between two warp syncs, the bypass row
        patched in (only in the tile that holds the current token, a workgroup-uniform test, so the SPIR-V
        barriers stay uniform); returns chunk c+1's loads, in flight while chunk c's FMAs run."""
        warp_sync()  # every lane is done reading the previous chunk
        store_chunk(buf, ahead, is_k, wbuf, lane)
        if ti.static(bypass):
            if has_cur:
                warp_sync()  # the patch overwrites cells other lanes stored
                if ti.static(is_k):
                    if r_cur >= 0 and r_cur < count:
                        dd = lane
                        while dd < DC:
                            buf[wbuf + r_cur * KS + dd] = cur[layer, kvh, c * DC + dd]
                            dd += WARP
                else:
                    if r_cur >= c * VR and r_cur < ti.min(count, c * VR + VR):
                        e = lane
                        while e < D:
                            buf[wbuf + (r_cur - c * VR) * D + e] = cur[layer, kvh, e]
                            e += WARP
        warp_sync()
        nxt = ahead
        if c + 1 < n_chunks:
            nxt = load_chunk(plane, rows_sh, is_k, c + 1, wrow, lane)
        return nxt

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
        hg, rg = umod(lane, HGL), udiv(lane, HGL)  # heads hg + HGL*i; score rows rg + RGL*j; dims 4*rg + 4*RGL*jj
        wbuf, wrow, wpart, wwt = w * BUF, w * RW, w * RGL * G, w * RW * G
        stage_queries(q, q_sh, layer, kvh * G, tid, scale)  # scaled: the scores need no multiply
        run, n_own, o_cur = owned_rows(visible, wg, nwg, nsg)
        ti.simt.block.sync()

        m = ti.Vector([RUNNING_MAX_INIT] * HL)  # this lane's heads: running max, its rows' sum of weights
        lsum = ti.Vector([0.0] * HL)
        acc = ti.Matrix.zero(ti.f32, HL, VD)
        o_first = 0
        while o_first < n_own:  # uniform across the workgroup; each warp takes rows base .. base + RW
            base = o_first + w * RW
            count = ti.max(0, ti.min(RW, n_own - base))
            has_cur = o_cur >= o_first and o_cur < o_first + TILE
            r_cur = o_cur - base
            i = lane
            while i < RW:
                o = ti.min(base + i, n_own - 1)
                rel = (wg + (o // run) * nwg) * run + o % run
                rows_sh[wrow + i] = at.row_offset(k_plane, slot, kvh, at.physical_of(
                    logical_start + rel, capacity, origin_logical, origin_physical))
                if ti.static(record):
                    if base + i < n_own and rel % C == 0:
                        ti.atomic_add(visits[g, rel // C], 1 + VISIT_OWNER * wg)
                i += WARP
            warp_sync()

            sc = ti.Matrix.zero(ti.f32, HL, RL)
            ahead = load_chunk(k_plane, rows_sh, True, 0, wrow, lane)
            for c in range(NKC):
                ahead = stage_chunk(k_plane, k_cur, buf, rows_sh, ahead, layer, kvh, True, c, NKC, has_cur, r_cur,
                                    count, wbuf, wrow, lane)
                for step in range(DC // (4 * SU)):
                    for u in ti.static(range(SU)):  # dims c*DC + 4*d4 + e, in increasing order in every sum
                        d4 = step * SU + u
                        kf = ti.Matrix([[buf[wbuf + (rg + RGL * j) * KS + 4 * d4 + e] for e in ti.static(range(4))]
                                        for j in ti.static(range(RL))])
                        for hi in ti.static(range(HL)):
                            qf = ti.Vector([q_sh[(hg + HGL * hi) * QS + c * DC + 4 * d4 + e]
                                            for e in ti.static(range(4))])
                            for j in ti.static(range(RL)):
                                s = sc[hi, j]
                                for e in ti.static(range(4)):
                                    s = s + qf[e] * kf[j, e]
                                sc[hi, j] = s

            ahead = load_chunk(v_plane, rows_sh, False, 0, wrow, lane)  # in flight under the softmax
            # the tile max of each head over the RGL lanes of its head group (lanes hg + HGL*r), through part
            local = ti.Vector([RUNNING_MAX_INIT] * HL)
            for hi in ti.static(range(HL)):
                for j in ti.static(range(RL)):
                    if rg + RGL * j < count:
                        local[hi] = ti.max(local[hi], sc[hi, j])
            for hi in ti.static(range(HL)):
                part[wpart + rg * G + hg * HL + hi] = local[hi]
            warp_sync()
            for hi in ti.static(range(HL)):
                tile_max = part[wpart + hg * HL + hi]
                for r in range(1, RGL):
                    tile_max = ti.max(tile_max, part[wpart + r * G + hg * HL + hi])
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
                    w_sh[wwt + (rg + RGL * j) * G + hg * HL + hi] = wt
                    total += wt
                lsum[hi] = total
                for x in ti.static(range(VD)):
                    acc[hi, x] = acc[hi, x] * f

            for c in range(NVC):
                ahead = stage_chunk(v_plane, v_cur, buf, rows_sh, ahead, layer, kvh, False, c, NVC, has_cur, r_cur,
                                    count, wbuf, wrow, lane)
                for step in range(VR // VU):
                    for u in ti.static(range(VU)):
                        r = step * VU + u
                        wf = ti.Vector([w_sh[wwt + (c * VR + r) * G + hg * HL + hi] for hi in ti.static(range(HL))])
                        for jj in ti.static(range(VD // 4)):
                            vf = ti.Vector([buf[wbuf + r * D + 4 * rg + 4 * RGL * jj + e]
                                            for e in ti.static(range(4))])
                            for hi in ti.static(range(HL)):
                                for e in ti.static(range(4)):
                                    acc[hi, 4 * jj + e] = acc[hi, 4 * jj + e] + wf[hi] * vf[e]
            o_first += TILE

        # the warp's sums over its row groups (part is free: every lane passed the last V chunk's syncs)
        for hi in ti.static(range(HL)):
            part[wpart + rg * G + hg * HL + hi] = lsum[hi]
        warp_sync()
        for hi in ti.static(range(HL)):
            total = 0.0
            for r in range(RGL):
                total += part[wpart + r * G + hg * HL + hi]
            lsum[hi] = total
        if rg == 0:
            for hi in ti.static(range(HL)):
                state[w * 2 * G + hg * HL + hi] = m[hi]
                state[w * 2 * G + G + hg * HL + hi] = lsum[hi]
        ti.simt.block.sync()  # every warp is past its rows: q_sh is free for the merge of O
        # merge the W warps in order: M = max M_w, S = sum S_w f_w, O = sum O_w f_w with f_w = exp(M_w - M)
        fw = ti.Vector([0.0] * HL)
        for hi in ti.static(range(HL)):
            gmax = state[hg * HL + hi]
            for u in ti.static(range(1, W)):
                gmax = ti.max(gmax, state[u * 2 * G + hg * HL + hi])
            fw[hi] = ti.exp(m[hi] - gmax)
            if w == 0 and rg == 0:
                total = 0.0
                for u in ti.static(range(W)):
                    su = u * 2 * G + hg * HL + hi
                    total += state[su + G] * ti.exp(state[su] - gmax)
                partials[g, kvh * G + hg + HGL * hi, wg, 0] = gmax
                partials[g, kvh * G + hg + HGL * hi, wg, 1] = total
        # Known deficit: warp W - 1 writes all of O alone, reloading the ndarray's pointer after every store
        # (~4 % of the stall samples at depth); writing O from every thread cost more than it saved (PERF.md)
        for u in ti.static(range(W)):
            if w == u:
                for hi in ti.static(range(HL)):
                    for jj in ti.static(range(VD // 4)):
                        for e in ti.static(range(4)):
                            d = 4 * rg + 4 * RGL * jj + e
                            val = acc[hi, 4 * jj + e] * fw[hi]
                            if ti.static(u > 0):
                                val = q_sh[(hg * HL + hi) * D + d] + val
                            if ti.static(u < W - 1):
                                q_sh[(hg * HL + hi) * D + d] = val
                            else:
                                partials[g, kvh * G + hg + HGL * hi, wg, 2 + d] = val
            if ti.static(u < W - 1):
                ti.simt.block.sync()

    return work


__all__ = ["UNROLL", "WARPS", "WarpTilePlan", "describe_warp_tile", "warp_producer_work", "warp_shared_arrays",
           "warp_tile_plan"]
