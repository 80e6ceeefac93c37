"""The split-K producer's CPU path: one thread per work item, serial inside.

Q, the block's weights and the output accumulator live in local arrays with the G sibling heads
contiguous (qT[d, h], P[r, h], OT[d, h]), so the static head loops become 8-wide SIMD (LLVM's SLP
vectorizer) with no reduction over d: Taichi runs with fast_math off, so LLVM may not reorder one.
Known deficit: Taichi 1.7.4's CPU JIT fuses no multiply-add (fast_math on or off: it compiles with default
TargetOptions, docs/lab/taichi-cpu-target.md), and Taichi's 32-bit index arithmetic keeps LLVM from seeing a
row's words side by side, so K and V load and convert one half at a time.  In the code that runs on an Ice
Lake Xeon (``scripts/lab/asm_loops.py --jit``) the score loop is 83 instructions per word x 4 rows, 32 of
them ymm multiplies and adds, 8 scalar ``vcvtph2ps`` and 8 broadcasts (the value loop: 84, 32): two FP ports
and the shuffle port bound it near 10-13 FLOP a cycle and core, against 16 for Taichi's mul + add and 64
for the CPU's 512-bit FMA (docs/PERF.md, "CPU").  With
fast_math on, LLVM's loop vectorizer takes the dimension loops instead, with gathers, and every variant
tried ran slower (docs/lab/runs.md, kernel history).  The large local matrices make a cold compile take tens
of seconds per kernel; Taichi's offline cache keeps it after that.
"""

import taichi as ti

from ..common import BLOCK_ROWS, RUNNING_MAX_INIT, VISIT_OWNER
from ..halves import HALVES_PER_WORD, high, low

# exp(x) for x <= 0 (every exp the producer takes: a score less its running max): Cody-Waite range
# reduction x = n ln2 + r, |r| <= ln2 / 2, and Cephes expf's degree-6 polynomial for exp(r), about 1 ulp.
# Branch-free, so LLVM vectorises it across the heads; libm's expf, one call per row and head, cost 12 %
# of a deep layer (docs/PERF.md).
LOG2E = 1.44269504088896341
LN2_HI = 0.693359375  # ln 2 to 9 bits: n * LN2_HI is exact for every n here
LN2_LO = -2.12194440e-4  # ln 2 - LN2_HI
EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
EXP_UNDERFLOW = -87.33654  # below it exp(x) < 2**-126 and is returned as 0 (an absolute error < 1.2e-38)


@ti.func
def exp_nonpositive(x):
    """exp(x) for x <= 0, to about 1 ulp (0 below EXP_UNDERFLOW)."""
    xc = ti.max(x, EXP_UNDERFLOW)
    n = ti.floor(xc * LOG2E + 0.5)
    r = (xc - n * LN2_HI) - n * LN2_LO
    c0, c1, c2, c3, c4, c5 = EXP_POLY
    p = ((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5
    e = p * (r * r) + r + 1.0
    two_n = ti.bit_cast((ti.cast(n, ti.i32) + 127) << 23, ti.f32)  # n >= -126: a normal power of two
    return ti.select(x < EXP_UNDERFLOW, 0.0, e * two_n)


def cpu_item_work(head_dim: int, heads_per_kv: int, n_kv: int, bypass: bool, record: bool, at):
    """The CPU producer's work for one work item, a ti.func (producer_kernel runs it per item)."""
    D, G = head_dim, heads_per_kv
    W = D // HALVES_PER_WORD  # words per plane row
    C = BLOCK_ROWS
    CPU_ROWS = 4  # K/V rows per register block (divides BLOCK_ROWS)

    @ti.func
    def row_pair(plane: ti.template(), offset, w):
        """f32 values of dimensions 2w and 2w + 1 of the plane row at flat word ``offset`` (row_offsets).
        The bypass is not decided here: a per-element branch on ``logical == position`` cost 1.7x on the
        CPU (docs/PERF.md); the current row is patched once per block instead."""
        word = at.plane_flat(plane, offset + w)
        return low(word), high(word)

    @ti.func
    def row_offsets(logical_first, rr, count, plane: ti.template(), slot, kvh, capacity, origin_logical,
                    origin_physical):
        """Flat word offsets of CPU_ROWS block rows from rr * CPU_ROWS (a partial tail repeats the last row),
        once per row: indexing the plane by (slot, kvh, row, w) per word recomputed the whole index per word,
        reloading the shape each time (LLVM cannot tell the local stores from it)."""
        offsets = ti.Vector([0] * CPU_ROWS)
        for j in ti.static(range(CPU_ROWS)):
            logical = logical_first + ti.min(rr * CPU_ROWS + j, count - 1)
            physical = at.physical_of(logical, capacity, origin_logical, origin_physical)
            offsets[j] = at.row_offset(plane, slot, kvh, physical)
        return offsets

    @ti.func
    def next_owned(block, chunk_pos, nwg, nsg):
        """Advance to the workgroup's next owned block: nsg consecutive blocks, then skip nwg*nsg."""
        nb, nc = block + 1, chunk_pos + 1
        if nc == nsg:
            nb = block + 1 + (nwg - 1) * nsg
            nc = 0
        return nb, nc

    @ti.func
    def item_work(item, q: ti.template(), k_cur: ti.template(), v_cur: ti.template(), k_plane: ti.template(),
                  v_plane: ti.template(), partials: ti.template(), visits: ti.template(), layers: ti.template(),
                  slots: ti.template(), position, window, capacity, origin_logical, origin_physical, nwg, nsg, scale):
        """One work item (a layer, KV head and workgroup), serial inside: one CPU thread runs it."""
        g, kvh, wg, logical_start, visible = at.work_item(item, nwg, position, window)
        layer, slot = layers[g], slots[g]
        n_blocks = (visible + C - 1) // C
        if ti.static(bypass):
            if wg == 0:
                row = at.physical_of(position, capacity, origin_logical, origin_physical)
                for w in range(W):
                    at.fused_store(k_cur, v_cur, k_plane, v_plane, layer, slot, kvh, row, w)
        # Everything hot lives in local (stack) arrays, vectorised across the G sibling heads:
        # qT[d, h] and OT[d, h] keep the heads contiguous, so the static head loops below
        # become 8-wide SIMD (no reductions over d, so no fast-math reassociation needed).
        qT = ti.Matrix.zero(ti.f32, D, G)
        OT = ti.Matrix.zero(ti.f32, D, G)
        P = ti.Matrix.zero(ti.f32, C, G)  # scores, then softmax weights, of one block
        m = ti.Vector([RUNNING_MAX_INIT] * G)
        s = ti.Vector([0.0] * G)
        for d in range(D):
            for h in ti.static(range(G)):
                qT[d, h] = q[layer, kvh * G + h, d]
        block = wg * nsg
        chunk_pos = 0
        while block < n_blocks:
            if ti.static(record):
                ti.atomic_add(visits[g, block], 1 + VISIT_OWNER * wg)
            first = block * C
            count = ti.min(C, visible - first)
            # scores: CPU_ROWS rows at a time (a partial tail repeats the last row, unused)
            for rr in range((count + CPU_ROWS - 1) // CPU_ROWS):
                offsets = row_offsets(logical_start + first, rr, count, k_plane, slot, kvh, capacity,
                                      origin_logical, origin_physical)
                acc = ti.Matrix.zero(ti.f32, CPU_ROWS, G)
                for w in range(W):  # dimensions 2w, then 2w + 1: the sum's order is the per-dimension loop's
                    for j in ti.static(range(CPU_ROWS)):
                        k0, k1 = row_pair(k_plane, offsets[j], w)
                        for h in ti.static(range(G)):
                            acc[j, h] = acc[j, h] + qT[2 * w, h] * k0
                            acc[j, h] = acc[j, h] + qT[2 * w + 1, h] * k1
                for j in ti.static(range(CPU_ROWS)):
                    for h in ti.static(range(G)):
                        P[rr * CPU_ROWS + j, h] = acc[j, h] * scale
            # the bypass: the current token's row (if in this block) scores against the f32
            # activations, not the plane slot read above (which wg 0 may be rewriting)
            r_cur = position - (logical_start + first)
            if ti.static(bypass):
                if r_cur < count:
                    cur = ti.Vector([0.0] * G)
                    for d in range(D):
                        kd = k_cur[layer, kvh, d]
                        for h in ti.static(range(G)):
                            cur[h] = cur[h] + qT[d, h] * kd
                    for h in ti.static(range(G)):
                        P[r_cur, h] = cur[h] * scale
            # online softmax per block: block max, rescale, weights
            factor = ti.Vector([0.0] * G)
            for h in ti.static(range(G)):
                block_max = P[0, h]
                for r in range(1, count):
                    block_max = ti.max(block_max, P[r, h])
                new_max = ti.max(m[h], block_max)
                factor[h] = exp_nonpositive(m[h] - new_max)
                m[h] = new_max
                s[h] *= factor[h]
            for r in range(count):
                for h in ti.static(range(G)):
                    w = exp_nonpositive(P[r, h] - m[h])
                    P[r, h] = w
                    s[h] += w
            for d in range(D):
                for h in ti.static(range(G)):
                    OT[d, h] = OT[d, h] * factor[h]
            # V pass: CPU_ROWS rows at a time; rows past count get weight 0
            for rr in range((count + CPU_ROWS - 1) // CPU_ROWS):
                offsets = row_offsets(logical_start + first, rr, count, v_plane, slot, kvh, capacity,
                                      origin_logical, origin_physical)
                wts = ti.Matrix.zero(ti.f32, CPU_ROWS, G)
                for j in ti.static(range(CPU_ROWS)):
                    r = rr * CPU_ROWS + j
                    # bypass: the current row's plane slot gets weight 0 (0 x a finite f16 adds
                    # exactly nothing); its f32 value is added below
                    keep = r < count
                    if ti.static(bypass):
                        keep = keep and r != r_cur
                    if keep:
                        for h in ti.static(range(G)):
                            wts[j, h] = P[r, h]
                for w in range(W):
                    v0 = ti.Vector([0.0] * CPU_ROWS)
                    v1 = ti.Vector([0.0] * CPU_ROWS)
                    for j in ti.static(range(CPU_ROWS)):
                        pair = row_pair(v_plane, offsets[j], w)
                        v0[j] = pair[0]
                        v1[j] = pair[1]
                    for h in ti.static(range(G)):
                        o0, o1 = OT[2 * w, h], OT[2 * w + 1, h]
                        for j in ti.static(range(CPU_ROWS)):
                            o0 = o0 + wts[j, h] * v0[j]
                            o1 = o1 + wts[j, h] * v1[j]
                        OT[2 * w, h] = o0
                        OT[2 * w + 1, h] = o1
            if ti.static(bypass):
                if r_cur < count:
                    for d in range(D):
                        vd = v_cur[layer, kvh, d]
                        for h in ti.static(range(G)):
                            OT[d, h] = OT[d, h] + P[r_cur, h] * vd
            block, chunk_pos = next_owned(block, chunk_pos, nwg, nsg)
        for h in ti.static(range(G)):
            partials[g, kvh * G + h, wg, 0] = m[h]
            partials[g, kvh * G + h, wg, 1] = s[h]
        for d in range(D):
            for h in ti.static(range(G)):
                partials[g, kvh * G + h, wg, 2 + d] = OT[d, h]

    return item_work


__all__ = ["cpu_item_work"]
