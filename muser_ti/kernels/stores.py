"""KV stores: f32 activations into the f16 planes (the chapter's kv_store_f16 / kv_store_batch_f16).

One launch stores the token for every layer of a group, so the launch count per token does not
grow with the number of layers.  The prefill stores write many tokens in one launch; the grow copy
moves a head-major plane into a larger allocation.  A thread writes one word of two halves (the planes
are packed, halves.py): two threads never share a word.
"""


from types import SimpleNamespace

import taichi as ti

from .common import GROUP_ROW, HEAD_MAJOR, TOKEN_MAJOR, cached, f32_3d, f32_4d, i32_1d, i32_2d, on_gpu
from .halves import HALVES_PER_WORD, pack, packed_plane
from .producer import addressing


def build_stores(head_dim: int, n_kv: int, layout: str):
    D, KV = head_dim, n_kv
    W = D // HALVES_PER_WORD  # words per plane row
    at = addressing(layout, n_kv)  # the producers' row addressing (row_offset), for the kept rows' flat copies
    # On the CPU a token's stores are a few thousand words: one thread does them sooner than the worker
    # threads wake (a per-layer token makes one a layer, token.py; a batch's step its sequences' rows, tens of
    # thousands of words, measured 220 us a launch in parallel); the prefill's and the grow copy's stay parallel
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
        def store_group(
            k_cur: f32_3d, v_cur: f32_3d, k_plane: packed_plane, v_plane: packed_plane,
            layers: i32_1d, slots: i32_1d, n_group: ti.i32, state: i32_2d,
        ):
            """store_token where each group has its own row, ``state[g, GROUP_ROW]`` (a batch's sequences)."""
            ti.loop_config(serialize=serial)
            for g, kvh, w in ti.ndrange(n_group, KV, W):
                layer, slot, row = layers[g], slots[g], state[g, GROUP_ROW]
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

        # row_copies: the CPU's kept rows (a batch step's, serial: a parallel launch wakes the pool for little work)
        # copy a row's words through flat offsets, plane[0, 0, 0, offset + w] (the producer's plane_flat: Taichi
        # linearises an index as ((i*n1 + j)*n2 + k)*n3 + l, so with zeros in front the offset is used as is), not a
        # 4-D index a word with the shapes reloaded each time, which cost ~3x (docs/PERF.md, "Many sequences on the
        # CPU").  The K and V planes (and kept arrays) share their shapes.
        @ti.func
        def saved_row(saved: ti.template(), g, i, kvh):
            return ((g * saved.shape[1] + i) * saved.shape[2] + kvh) * saved.shape[3]

        @ti.func
        def copy_row(dst: ti.template(), d, src: ti.template(), s):
            for w in range(W):
                dst[0, 0, 0, d + w] = src[0, 0, 0, s + w]

        @ti.func
        def put_word(plane: ti.template(), slot, row, kvh, w, value):
            if ti.static(layout == TOKEN_MAJOR):
                plane[slot, row, kvh, w] = value
            else:
                plane[slot, kvh, row, w] = value

        @ti.kernel
        def save_rows(plane: packed_plane, saved: packed_plane, base: ti.i32, n_slots: ti.i32, first: ti.i32,
                      n_rows: ti.i32, capacity: ti.i32):
            """Rows (first + t) % capacity, t < n_rows, of plane slots base .. base + n_slots - 1 (every layer of one
            engine's class: a batch's pool holds several engines' from ``base``, plane_pool.py) into
            saved[t, slot, kv, w]: what a per-layer token overwrites, kept so that an abandoned token puts them back
            (token.py)."""
            ti.loop_config(serialize=serial)
            for t, slot, kvh, w in ti.ndrange(n_rows, n_slots, KV, W):
                saved[t, slot, kvh, w] = word(plane, base + slot, (first + t) % capacity, kvh, w)

        @ti.kernel
        def save_group(k_plane: packed_plane, v_plane: packed_plane, k_saved: packed_plane, v_saved: packed_plane,
                       bases: i32_1d, rows: i32_1d, n_group: ti.i32, n_layers: ti.i32):
            """save_rows for a batch's sequences in one launch: row ``rows[g]`` of plane slots bases[g] ..
            bases[g] + n_layers - 1 into saved[g, layer, kv, w], K and V (one row a sequence: its token's)."""
            if ti.static(serial):  # a row's words by flat offsets (row_copies says why)
                ti.loop_config(serialize=True)
                for g, i, kvh in ti.ndrange(n_group, n_layers, KV):
                    plane_at = at.row_offset(k_plane, bases[g] + i, kvh, rows[g])
                    kept_at = saved_row(k_saved, g, i, kvh)
                    copy_row(k_saved, kept_at, k_plane, plane_at)
                    copy_row(v_saved, kept_at, v_plane, plane_at)
            else:
                for g, i, kvh, w in ti.ndrange(n_group, n_layers, KV, W):
                    k_saved[g, i, kvh, w] = word(k_plane, bases[g] + i, rows[g], kvh, w)
                    v_saved[g, i, kvh, w] = word(v_plane, bases[g] + i, rows[g], kvh, w)

        @ti.kernel
        def restore_group(k_saved: packed_plane, v_saved: packed_plane, k_plane: packed_plane, v_plane: packed_plane,
                          bases: i32_1d, rows: i32_1d, n_group: ti.i32, n_layers: ti.i32):
            if ti.static(serial):  # as save_group's
                ti.loop_config(serialize=True)
                for g, i, kvh in ti.ndrange(n_group, n_layers, KV):
                    plane_at = at.row_offset(k_plane, bases[g] + i, kvh, rows[g])
                    kept_at = saved_row(k_saved, g, i, kvh)
                    copy_row(k_plane, plane_at, k_saved, kept_at)
                    copy_row(v_plane, plane_at, v_saved, kept_at)
            else:
                for g, i, kvh, w in ti.ndrange(n_group, n_layers, KV, W):
                    put_word(k_plane, bases[g] + i, rows[g], kvh, w, k_saved[g, i, kvh, w])
                    put_word(v_plane, bases[g] + i, rows[g], kvh, w, v_saved[g, i, kvh, w])

        @ti.kernel
        def restore_rows(saved: packed_plane, plane: packed_plane, base: ti.i32, n_slots: ti.i32, first: ti.i32,
                         n_rows: ti.i32, capacity: ti.i32):
            ti.loop_config(serialize=serial)
            for t, slot, kvh, w in ti.ndrange(n_rows, n_slots, KV, W):
                row = (first + t) % capacity
                if ti.static(layout == TOKEN_MAJOR):
                    plane[base + slot, row, kvh, w] = saved[t, slot, kvh, w]
                else:
                    plane[base + slot, kvh, row, w] = saved[t, slot, kvh, w]

        return SimpleNamespace(store_token=store_token, store_group=store_group, store_tokens=store_tokens, save_rows=save_rows,
                               restore_rows=restore_rows, save_group=save_group, restore_group=restore_group, copy_rows=copy_rows if layout == HEAD_MAJOR else None)

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
