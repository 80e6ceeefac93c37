"""The GPU producer's block tile: the whole workgroup shares each tile of rows and its barriers.

Metal runs it (the warp tile needs 37 KiB of shared memory for Glimmer, Metal has 32), and so does every
group shape the warp tile does not cover (Qwen2.5-7B's 7 heads per KV head, multi-head attention, head_dim
256 at 16 heads); MUSER_GPU_TILE=block forces it elsewhere.  Its shape, per workgroup of T threads:

* scores: each thread owns HB heads x RB rows of the tile, so per dimension it loads HB query and RB key
  values from shared memory and does HB x RB FMAs;
* values: each thread owns VH heads x VD dims and a slice of the tile's rows; the RS row slices are summed
  once per workgroup at the end;
* a tile is R rows, so the softmax bookkeeping (three barriers, two small reductions) is paid once per R
  rows; the running sum of weights stays per thread and is reduced once per workgroup;
* K is staged in chunks of DC dimensions ([R][DC+1] f32, padded so a warp's rows fall in distinct banks),
  V in chunks of VR rows ([VR][D+1]), both through one buffer that fits Metal's 32 KiB for Glimmer;
* the chunks are software-pipelined: a thread's share of chunk c+1 is loaded, kept packed (u32 words of
  two halves, halves.py), while chunk c's FMAs run, and unpacked only when it is stored.

Registers decide occupancy and Taichi 1.7.4 decides the register cap: it marks every CUDA kernel
``.maxntid T`` and ``.minnctapersm 2``, so ptxas may use 65,536 / (2 T) registers a thread; T = 128 runs
2 workgroups an SM without spills.  Known deficit: issue-bound at depth, about 1.5x the warp tile's time
for one deep NoPE layer (docs/lab/runs.md, kernel history).

Block ownership is the chapter's (block b belongs to workgroup (b // nsg) % nwg): a workgroup walks its
owned rows in increasing order, R at a time, with one online-softmax update per tile.
"""

from dataclasses import dataclass

import taichi as ti

from ..common import BLOCK_ROWS, RUNNING_MAX_INIT, VISIT_OWNER
from ..halves import HALVES_PER_WORD, high, low
from .gpu_common import item_prologue, owned_rows, query_stager, udiv, umod

GPU_PRODUCER_THREADS = 128  # T: ptxas may then use 255 registers; at 256 the cap is 128 and the tile spills
K_CHUNK_DIMS = 16  # DC: dimensions of K staged per chunk ([R][DC+1] f32 = 8.5 KiB at R = 128)
MAX_SCORE_HEADS = 4  # HB: score heads per thread (4 heads x 4 rows: 8 shared loads per 16 FMAs)
MAX_VALUE_DIMS = 8  # VD: value dims per thread, dims dg + DG*j
MAX_VALUE_HEADS = 4  # VH: value heads per thread (4 x 8 = 32 accumulators)
MAX_TILE_ROWS = 128  # R: rows a tile holds; short windows leave long tiles mostly empty


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


@dataclass(frozen=True)
class TilePlan:
    """The static shape of the block tile for one (G, D) and shared-memory budget."""

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
    shared_bytes: int


def gpu_tile_plan(G: int, D: int, budget: int) -> TilePlan:
    """The largest block tile that fits ``budget`` bytes of shared memory; pure arithmetic, tested."""
    T, DC = GPU_PRODUCER_THREADS, K_CHUNK_DIMS
    if G > T:
        raise ValueError(f"the GPU producer keeps one head per thread in its reductions: heads per KV head "
                         f"{G} must be <= {T}")
    # score heads per thread: the most (up to the HB cap) that leave a head-group count dividing T, so every
    # thread has a row group (G = 24: 6 heads x 4 groups, not 8 x 3 with 2 threads idle)
    HB = max((d for d in range(1, min(G, MAX_SCORE_HEADS) + 1) if G % d == 0 and G // d <= T),
             key=lambda d: (T % (G // d) == 0, d))
    HG = G // HB
    RG = 1 << (T // HG).bit_length() - 1  # a power of two, so tiles of R = RG x RB rows split into chunks
    VD = _largest_divisor(D, MAX_VALUE_DIMS)
    DG = D // VD
    # value heads per thread: the most up to the VH cap that the workgroup's threads cover; wide groups
    # (more than VH x T / DG heads) need more per thread, at the cost of registers
    fits = [d for d in range(1, G + 1) if G % d == 0 and (G // d) * DG <= T]
    VH = max([d for d in fits if d <= MAX_VALUE_HEADS], default=min(fits))
    HGV = G // VH
    RS = T // (HGV * DG)
    L2 = T // G
    if D % DC:
        raise ValueError(f"K chunk dims {DC}: head_dim {D} must be a multiple (a chunk row is whole packed words)")
    for RB in range(max(1, MAX_TILE_ROWS // RG), 0, -1):  # the largest tile (R = RG x RB rows) that fits
        R = RG * RB
        chunk = R * DC
        if chunk % D or chunk % (HALVES_PER_WORD * T) or R % (chunk // D):  # every thread moves whole words
            continue
        VR = chunk // D
        buf = max(R * (DC + 1), VR * (D + 1), G * D if RS > 1 else 0)
        floats = G * D + buf + G * (R + 1) + G * RG + G * L2 + 2 * G
        shared = 4 * (floats + R)
        if shared <= budget:
            return TilePlan(G, D, T, HB, HG, RG, RB, R, DC, VR, VH, VD, DG, HGV, RS, L2, buf, shared)
    raise ValueError(f"no GPU tile for {G} heads per KV head at head_dim {D} fits {budget} bytes of shared memory "
                     f"(the queries alone take {4 * G * D})")


def describe_block_tile(p: TilePlan, arch: str, budget: int) -> str:
    """A block tile in words (producer.describe_plans prints one per backend)."""
    cap = f", at most {min(255, 65536 // (2 * p.T))} registers per thread" if arch == "cuda" else ""
    return (f"{p.T} threads{cap}; {p.R}-row tiles; scores {p.HB} heads x {p.RB} rows and values "
            f"{p.VH} heads x {p.VD} dims per thread; {p.shared_bytes / 1024:.1f} of {budget // 1024} KiB shared; "
            f"chunks pipelined (packed halves in flight)")


def gpu_producer_work(plan: TilePlan, bypass: bool, record: bool, at, fused_store: bool, layer_base: int = 0,
                      slot_is_group: bool = False):
    """The GPU producer's per-thread work, a ti.func of a thread and its work item; ``at`` is the
    layout's addressing (producer.addressing).  fused_store: workgroup 0 of each work item writes the
    current token's row into the plane (the interleaved route); the one-dispatch step (one_dispatch.py)
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
    def patch_current(buf: ti.template(), cur: ti.template(), layer, kvh, is_k: ti.template(), c, r_cur, count, tid):
        """The bypass: the current token's chunk row takes the f32 activations.  Called between two
        barriers, and only by a workgroup whose tile holds that row (a uniform condition): a per-element
        test while staging cost 1.8x at depth (docs/PERF.md)."""
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
        """Chunk c (its loads in ``ahead``) into buf between two barriers, the bypass row patched in.  Returns
        chunk c+1's loads, issued here so that chunk c's FMAs hide them."""
        ti.simt.block.sync()  # every thread is done reading the previous chunk
        store_chunk(buf, ahead, is_k, tid, 0, LOADS)
        patch_current(buf, cur, layer, kvh, is_k, c, r_cur, count, tid)
        ti.simt.block.sync()
        nxt = ahead
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
            ahead = load_chunk(k_plane, rows_sh, True, 0, tid, 0, LOADS)  # this thread's share of the next chunk
            for c in range(NKC):
                ahead = stage_chunk(k_plane, k_cur, buf, rows_sh, ahead, layer, kvh, True, c, NKC, r_cur,
                                    count, tid)
                if tid < SCORE_THREADS:
                    for dd in range(DC):  # not unrolled here: ptxas does (unrolling it in the source was slower)
                        kd = ti.Vector([buf[(sr + j * RG) * KS + dd] for j in ti.static(range(RB))])
                        for i in ti.static(range(HB)):
                            qd = q_sh[(h0 + i) * D + c * DC + dd]
                            for j in ti.static(range(RB)):
                                sc[i, j] = sc[i, j] + qd * kd[j]

            ahead = load_chunk(v_plane, rows_sh, False, 0, tid, 0, LOADS)  # in flight under the softmax bookkeeping
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
                    while lr < VR:  # not unrolled: unrolled it was 2-4 % slower
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
    launch's loop, once per task.  A task that runs two producers (one_dispatch.py) declares them once for
    both: Taichi 1.7.4 names a shared array after its statement id, which restarts in every task of a
    CUDA kernel, so shared arrays in two tasks of one kernel alias each other (an illegal address where
    their sizes differed)."""
    G, D, R, RG, L2 = plan.G, plan.D, plan.R, plan.RG, plan.L2
    return (ti.simt.block.SharedArray((G * D,), ti.f32),  # q_sh: the group's queries
            ti.simt.block.SharedArray((plan.BUF,), ti.f32),  # buf: K chunk [R][KS] | V chunk [VR][VS] | O slices
            ti.simt.block.SharedArray((G * (R + 1),), ti.f32),  # w_sh: weights [h][r]
            ti.simt.block.SharedArray((G * RG,), ti.f32),  # part: per (head, row group): max, then sum
            ti.simt.block.SharedArray((G * L2,), ti.f32),  # part2
            ti.simt.block.SharedArray((2 * G,), ti.f32),  # state: running max M, this tile's factor
            ti.simt.block.SharedArray((R,), ti.i32))  # rows_sh: the tile rows' flat plane indices


__all__ = ["GPU_PRODUCER_THREADS", "TilePlan", "describe_block_tile", "gpu_producer_work", "gpu_tile_plan",
           "shared_arrays"]
