"""KV stores: f32 activations into the f16 planes (the chapter's kv_store_f16 / kv_store_batch_f16).

One launch stores the token for every layer of a group, so the launch count per token does not
grow with the number of layers.  The prefill stores write many tokens in one launch; the grow copy
moves a head-major plane into a larger allocation.  A thread writes one word of two halves (the planes
are packed, halves.py): two threads never share a word.
"""


from types import SimpleNamespace

import taichi as ti

from ..config import F16_MAX, F32_MAX
from .common import HEAD_MAJOR, TOKEN_MAJOR, cached, f32_3d, f32_4d, i32_1d, on_gpu
from .halves import HALVES_PER_WORD, pack, packed_plane


def build_stores(head_dim: int, n_kv: int, layout: str):
    D, KV = head_dim, n_kv
    W = D // HALVES_PER_WORD  # words per plane row
    # On the CPU a token's stores are a few thousand words: one thread does them sooner than the worker
    # threads wake (a per-layer token makes one a layer, token.py); the prefill's and the grow copy's stay parallel
    serial = not on_gpu()

    def build():
        @ti.func
        def put(plane: ti.template(), slot, row, kvh, w, lo, hi):
            """Word w of a row: dimensions 2w and 2w + 1."""
            if ti.static(layout == TOKEN_MAJOR):
                plane[slot, row, kvh, w] = pack(lo, hi)
            else:
                plane[slot, kvh, row, w] = pack(lo, hi)

        @ti.kernel
        def store_token(
            k_cur: f32_3d, v_cur: f32_3d, k_plane: packed_plane, v_plane: packed_plane,
            layers: i32_1d, slots: i32_1d, n_group: ti.i32, row: ti.i32,
        ):
            """Write the current token (row ``row``) of every layer in the group."""
            ti.loop_config(serialize=serial)
            for g, kvh, w in ti.ndrange(n_group, KV, W):
                layer, slot = layers[g], slots[g]
                put(k_plane, slot, row, kvh, w, k_cur[layer, kvh, 2 * w], k_cur[layer, kvh, 2 * w + 1])
                put(v_plane, slot, row, kvh, w, v_cur[layer, kvh, 2 * w], v_cur[layer, kvh, 2 * w + 1])

        @ti.kernel
        def store_tokens(
            k: f32_4d, v: f32_4d, k_plane: packed_plane, v_plane: packed_plane,
            layers: i32_1d, slots: i32_1d, n_group: ti.i32, rows: i32_1d, first: ti.i32, n_rows: ti.i32,
        ):
            """Prefill: token ``first + t`` of k/v [n_tokens, layer, kv, d] lands in row ``rows[t]``."""
            for t, g, kvh, w in ti.ndrange(n_rows, n_group, KV, W):
                layer, slot, i = layers[g], slots[g], first + t
                put(k_plane, slot, rows[t], kvh, w, k[i, layer, kvh, 2 * w], k[i, layer, kvh, 2 * w + 1])
                put(v_plane, slot, rows[t], kvh, w, v[i, layer, kvh, 2 * w], v[i, layer, kvh, 2 * w + 1])

        @ti.kernel
        def copy_rows(src: packed_plane, dst: packed_plane, n_slots: ti.i32, n_rows: ti.i32):
            """Move the first n_rows of every (layer, kv head) of a head-major plane into a larger one."""
            for slot, kvh, r, w in ti.ndrange(n_slots, KV, n_rows, W):
                dst[slot, kvh, r, w] = src[slot, kvh, r, w]

        @ti.func
        def word(plane: ti.template(), slot, row, kvh, w):
            value = ti.u32(0)
            if ti.static(layout == TOKEN_MAJOR):
                value = plane[slot, row, kvh, w]
            else:
                value = plane[slot, kvh, row, w]
            return value

        @ti.kernel
        def save_rows(plane: packed_plane, saved: packed_plane, n_slots: ti.i32, first: ti.i32, n_rows: ti.i32,
                      capacity: ti.i32):
            """Rows (first + t) % capacity, t < n_rows, of every layer of the class into saved[t, slot, kv, w]:
            what a per-layer token overwrites, kept so that an abandoned token puts them back (token.py)."""
            ti.loop_config(serialize=serial)
            for t, slot, kvh, w in ti.ndrange(n_rows, n_slots, KV, W):
                saved[t, slot, kvh, w] = word(plane, slot, (first + t) % capacity, kvh, w)

        @ti.kernel
        def restore_rows(saved: packed_plane, plane: packed_plane, n_slots: ti.i32, first: ti.i32, n_rows: ti.i32,
                         capacity: ti.i32):
            ti.loop_config(serialize=serial)
            for t, slot, kvh, w in ti.ndrange(n_rows, n_slots, KV, W):
                row = (first + t) % capacity
                if ti.static(layout == TOKEN_MAJOR):
                    plane[slot, row, kvh, w] = saved[t, slot, kvh, w]
                else:
                    plane[slot, kvh, row, w] = saved[t, slot, kvh, w]

        return SimpleNamespace(store_token=store_token, store_tokens=store_tokens, save_rows=save_rows,
                               restore_rows=restore_rows, copy_rows=copy_rows if layout == HEAD_MAJOR else None)

    return cached(("stores", D, KV, layout, serial), build)


def build_unpack(n_heads: int, n_kv: int, head_dim: int):
    """One token's packed [layer, q heads | k heads | v heads, d] array (a host array: Taichi stages it at
    launch) into the q, k, v arrays the kernels read: where host copies go through Taichi (Vulkan, Metal),
    a step's inputs then cost one launch and no device synchronisation, not three synchronising copies."""
    H, KV, D = n_heads, n_kv, head_dim

    def build():
        @ti.kernel
        def unpack(tokens: f32_3d, q: f32_3d, k_cur: f32_3d, v_cur: f32_3d):
            for layer, r, d in ti.ndrange(tokens.shape[0], H + 2 * KV, D):
                x = tokens[layer, r, d]
                if r < H:
                    q[layer, r, d] = x
                elif r < H + KV:
                    k_cur[layer, r - H, d] = x
                else:
                    v_cur[layer, r - H - KV, d] = x

        return unpack

    return cached(("unpack", H, KV, D), build)


TOKEN_FLAGS = 6  # non-finite q, k, v values; k, v values outside the f16 range (|x| > 65504); q values outside it
NEVER_STAMPED = -1  # flags start at 0 and only rise (atomic_max of stamps >= 1): no flag ever equals it
OPEN_GATE = 2**31 - 1  # a gate base no flag reaches: writes never wait on the scan (a host-checked token)
REFUSAL_RING = 256  # tokens whose flags are kept one by one between two looks at them (deferred checks)
FLAG_CELLS = TOKEN_FLAGS * (1 + REFUSAL_RING)  # the summary, then the ring; a layer table may follow


def build_token_scan(n_heads: int, n_kv: int, head_dim: int):
    """The input checks of a device-resident token (Engine.step_device) in one launch of one loop.

    A flag is set to the scan's ``stamp`` (a count the engine raises every scan) rather than counted
    from zero, so no launch is spent clearing it.  Two records: the summary ``flags[kind]`` holds the
    latest stamp that set it (the host reads ``flags[kind] == stamp`` after a scan), and the ring
    ``flags[TOKEN_FLAGS * (1 + stamp % REFUSAL_RING) + kind]`` holds it per token, so the host can name the
    first refused token of many scanned without a look between them (deferred checks).
    ``not |x| <= F32_MAX`` holds for NaN (every comparison with it is false) and for +-inf."""
    H, KV, D = n_heads, n_kv, head_dim

    def build():
        @ti.func
        def flag(flags: ti.template(), stamp, kind):
            ti.atomic_max(flags[kind], stamp)
            if stamp >= 0:
                ti.atomic_max(flags[TOKEN_FLAGS * (1 + stamp % REFUSAL_RING) + kind], stamp)

        @ti.func
        def check(q: ti.template(), k: ti.template(), v: ti.template(), flags: ti.template(), stamp, layer, r, d):
            """Row r of [q heads | k heads | v heads] of a layer, dimension d."""
            x, kind = 0.0, 0
            if r < H:
                x = q[layer, r, d]
            elif r < H + KV:
                x, kind = k[layer, r - H, d], 1
            else:
                x, kind = v[layer, r - H - KV, d], 2
            a = ti.abs(x)
            if not a <= F32_MAX:
                flag(flags, stamp, kind)
            elif a > F16_MAX:
                flag(flags, stamp, kind + 2 if kind > 0 else 5)

        @ti.kernel
        def scan(q: f32_3d, k: f32_3d, v: f32_3d, flags: ti.types.ndarray(dtype=ti.i32, ndim=1), stamp: ti.i32):
            for layer, r, d in ti.ndrange(q.shape[0], H + 2 * KV, D):
                check(q, k, v, flags, stamp, layer, r, d)

        scan.check = check
        return scan

    return cached(("token_scan", H, KV, D), build)


@ti.func
def token_accepted(flags: ti.template(), base) -> ti.i32:
    """1 unless a scan since stamp ``base`` flagged a token (build_token_scan): the gate of every write the
    one-dispatch step makes (kernels/one_dispatch.py).  base = this token's stamp: its own scan decides;
    base = the first stamp since the host last looked: one refused token closes the gate for every token
    after it until the host looks (deferred checks); base = OPEN_GATE: never closed."""
    ok = 1
    for i in ti.static(range(TOKEN_FLAGS)):
        if flags[i] >= base:
            ok = 0
    return ok
