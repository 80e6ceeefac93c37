"""Mirror planes: a second copy of the engine's K/V planes in memory the pinned Metal bridge can read.

Why it exists.  On macOS the pinned rung is llama.cpp's Metal vec kernel, dispatched by the bridge in
metal_pinned/ on MTLBuffers.  Taichi 1.7.4 exposes no MTLBuffer (nor a host pointer) for a Metal
ndarray, so the bridge cannot read the engine's planes in place, and copying a plane every token would
cost more than the attention.  Instead the engine keeps a mirror: planes of the same shape and layout
(token-major SWA ring ``[layer, row, kv_head, d]``, row stride n_kv_heads*head_dim halves, 256 for
Glimmer; head-major NoPE plane ``[layer, kv_head, row, d]``, row stride head_dim = 128) in
bridge-owned shared-storage buffers, and writes every token it stores into both, at the same physical
row, f16-rounded the same way.  The vec routes then read the mirror.

How it is kept bit-identical, at O(rows written) per token, never a plane copy:
* every store (step, prefill, on every route and graph) writes the token's f32 rows rounded with numpy's
  ``astype(float16)``, round-to-nearest-even with subnormals, which is what the store kernels'
  ``halves.half_bits`` does on every backend: it rounds in integer arithmetic, not through the
  driver's float conversion (tests/test_halves.py checks its bits against numpy's;
  tests/test_plane_mirror.py the mirror against the planes; neither has run on Metal);
* a rewind moves no data (rows past len are dead in both copies); only the state is updated;
* a NoPE plane that grows (doubles) is reallocated and its live rows copied, as the engine does;
  a snapshot load rewrites the whole mirror from the file's rows.

Memory: with the rung loaded on Metal **every plane is held twice** (Taichi's ndarray for the project's
kernels, the mirror for llama's).  For Glimmer that is another 81.8 MB for the 39 SWA rings, plus the 13
NoPE planes again at 13,312 B per token of depth (54.5 MB at 4,096 tokens, 1.74 GB at 131,072; a growing
plane's allocation is up to twice its live rows, in both copies alike).
The project's own kernels cannot read the mirror either (Taichi cannot bind an MTLBuffer it did not
make), so neither copy can go.

Two backings: :class:`HostBacking` (plain numpy; any machine: this is how the bookkeeping is tested on
Linux, and on the CPU the vec routes read it through ggml exactly as they read the planes) and
:class:`MetalBacking` (shared-storage bridge buffers, macOS).  **The Metal backing and
:class:`BridgeRunner` have never been run: there is no macOS machine here.**  What can be checked off
macOS is: the bookkeeping (host backing), and that the descriptors the Metal path builds are accepted by
the bridge's plain-C planner with every range inside its buffer (:func:`bridge_problems`).
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

import numpy as np

from ..config import NOPE, SWA, Geometry
from ..planes import PlaneState, plane_shape

ALIGN = 64  # bytes: every allocation starts on a 64-byte boundary (the bridge needs 8 for K/V, 16 for Q/out)


class MirrorError(RuntimeError):
    """The mirror's bookkeeping was asked for something inconsistent (a bug in the caller, not bad input)."""


def tail_bytes(cfg: Geometry, kind: str) -> int:
    """Bytes allocated past a plane's end.  On a token-major ring whose attended row count is not a
    multiple of 32 the bridge's pad kernel copies a whole row stride from the last KV head's offset,
    i.e. up to (n_kv_heads - 1) * head_dim halves past the last row (metal_pinned/README.md); one
    token row of slack keeps that read inside the buffer, which the bridge checks."""
    return cfg.n_kv_heads * cfg.head_dim * 2 if kind == SWA else 0


# ---- backings ---------------------------------------------------------------------------------
def _find(allocations: dict, a: np.ndarray, what: str) -> tuple[object, int, int]:
    """(allocation, byte offset of ``a`` in it, its size) among ``{base address: allocation}``."""
    addr = a.__array_interface__["data"][0]
    for base, alloc in allocations.items():
        if base <= addr and addr + a.nbytes <= base + alloc.nbytes:
            return alloc, addr - base, alloc.nbytes
    raise MirrorError(f"array does not lie inside any {what} of this backing")


class HostBacking:
    """Plain numpy memory.  Used to test the mirror off macOS; the CPU vec route can read it via ggml."""

    name = "host"

    def __init__(self):
        self._blocks: dict[int, np.ndarray] = {}  # base address -> the raw block (keeps it alive)

    def zeros(self, shape: tuple[int, ...], dtype, tail: int = 0) -> np.ndarray:
        """A zeroed C-contiguous array of ``shape`` at the start of a block with ``tail`` spare bytes."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        raw = np.zeros(nbytes + tail + ALIGN, np.uint8)
        off = (-raw.ctypes.data) % ALIGN
        block = raw[off:off + nbytes + tail]
        self._blocks[block.ctypes.data] = block
        return block[:nbytes].view(dtype).reshape(shape)

    def locate(self, a: np.ndarray) -> tuple[object, int, int]:
        """(block, byte offset of ``a`` in it, block size in bytes) for an array inside one allocation."""
        return _find(self._blocks, a, "allocation")

    def free(self, a: np.ndarray) -> None:
        block, _, _ = self.locate(a)
        del self._blocks[block.ctypes.data]

    def close(self) -> None:
        self._blocks.clear()

    def runner(self, cfg: Geometry):
        return None  # the engine's ggml runner reads host memory directly


class MetalBacking:
    """Shared-storage MTLBuffers owned by the pinned bridge; numpy views write them from the host.

    Never run (no macOS here).  The views handed out are valid until :meth:`free` / :meth:`close`; the
    engine drops its references before it frees (plane growth, snapshot load).
    """

    name = "metal"

    def __init__(self, bridge):
        self.bridge = bridge
        self._buffers: dict[int, object] = {}  # contents address -> MetalBuffer
        self._finalizer = weakref.finalize(self, MetalBacking._release, bridge, self._buffers)

    def zeros(self, shape: tuple[int, ...], dtype, tail: int = 0) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        buf = self.bridge.buffer(nbytes + tail)  # mp_buffer_new: shared storage, zero-filled
        self._buffers[buf.address] = buf
        return buf.array(dtype, shape)

    def locate(self, a: np.ndarray) -> tuple[object, int, int]:
        return _find(self._buffers, a, "bridge buffer")

    def free(self, a: np.ndarray) -> None:
        buf, _, _ = self.locate(a)
        del self._buffers[buf.address]
        buf.free()

    @staticmethod
    def _release(bridge, buffers: dict) -> None:
        for buf in buffers.values():  # buffers must be freed before their context is closed (mp_bridge.h)
            buf.free()
        buffers.clear()
        bridge.close()

    def close(self) -> None:
        self._finalizer()

    def runner(self, cfg: Geometry) -> "BridgeRunner":
        return BridgeRunner(self, cfg)


MIRRORS = (None, "host")


def backing_for(arch: str, pinned_loaded: bool, mirror: str | None):
    """Where an engine's mirror planes live: bridge buffers on Metal with the rung loaded (always: the bridge
    cannot read Taichi's Metal planes), numpy for mirror="host" (to test the bookkeeping off macOS), else
    None (no mirror).  Memory: a mirror holds every plane a second time (the module's docstring says how
    much for Glimmer); on Metal it cannot be avoided, since Taichi cannot bind the bridge's buffers."""
    from ..errors import EngineError, PinnedUnavailable

    if arch == "metal" and pinned_loaded:
        if mirror == "host":
            raise EngineError("mirror='host': on Metal the pinned rung reads bridge buffers, so the engine keeps its "
                              "mirror there; pass mirror=None")
        from . import metal_bridge

        try:
            return MetalBacking(metal_bridge.load())
        except metal_bridge.MetalBridgeError as exc:
            raise PinnedUnavailable(f"the pinned Metal bridge verified but did not open: {exc}") from None
    return HostBacking() if mirror == "host" else None


# ---- the mirror -------------------------------------------------------------------------------
class PlaneMirror:
    """The mirror of every plane class of an engine: ``k[kind]``, ``v[kind]`` (f16, the engine's shapes) and
    ``state[kind]`` (the engine's PlaneState for that class, kept in step by the engine)."""

    def __init__(self, cfg: Geometry, backing, states: dict[str, PlaneState]):
        self.cfg = cfg
        self.backing = backing
        self.layers = {SWA: list(cfg.swa_layers), NOPE: list(cfg.nope_layers)}
        self.k: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}
        self.state: dict[str, PlaneState] = {}
        for kind, st in states.items():
            self.k[kind], self.v[kind] = self._alloc(kind, st.capacity)
            self.state[kind] = st

    @property
    def name(self) -> str:
        return self.backing.name

    def nbytes(self) -> int:
        """Bytes the mirror holds (what the rung costs on top of the engine's own planes)."""
        return sum(self.k[kind].nbytes + self.v[kind].nbytes for kind in self.k)

    def _alloc(self, kind: str, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        shape = plane_shape(self.cfg, kind, len(self.layers[kind]), capacity)
        tail = tail_bytes(self.cfg, kind)
        return self.backing.zeros(shape, np.float16, tail), self.backing.zeros(shape, np.float16, tail)

    def _replace(self, kind: str, k: np.ndarray, v: np.ndarray) -> None:
        old = self.k[kind], self.v[kind]
        self.k[kind], self.v[kind] = k, v
        for a in old:
            self.backing.free(a)

    def store(self, kind: str, rows, k: np.ndarray, v: np.ndarray) -> None:
        """Write tokens into physical ``rows``: k, v float32 [len(rows), n_layers (all), n_kv_heads, head_dim],
        the arrays the engine's store kernels read.  Costs O(rows written)."""
        rows = np.asarray(rows, dtype=np.intp)
        if k.shape[0] != len(rows) or v.shape != k.shape or k.dtype != np.float32 or v.dtype != np.float32:
            raise MirrorError(f"store: {len(rows)} rows but k {k.dtype}{k.shape}, v {v.dtype}{v.shape} "
                              "(expected float32 [rows, n_layers, n_kv_heads, head_dim])")
        cap = self.state[kind].capacity
        if len(rows) and (rows.min() < 0 or rows.max() >= cap):
            raise MirrorError(f"store: rows {rows.min()}..{rows.max()} outside the {kind} mirror's {cap} rows")
        sel = self.layers[kind]
        # numpy's f32 -> f16 is round-to-nearest-even, as the store kernels' halves.half_bits
        kh = k[:, sel].astype(np.float16)
        vh = v[:, sel].astype(np.float16)
        if kind == SWA:  # [layer, row, kv, d] <- [row, layer, kv, d]
            self.k[kind][:, rows] = kh.transpose(1, 0, 2, 3)
            self.v[kind][:, rows] = vh.transpose(1, 0, 2, 3)
        else:  # [layer, kv, row, d] <- [row, layer, kv, d]
            self.k[kind][:, :, rows] = kh.transpose(1, 2, 0, 3)
            self.v[kind][:, :, rows] = vh.transpose(1, 2, 0, 3)

    def set_state(self, kind: str, st: PlaneState) -> None:
        """The engine's new state for a class (append, prefill, rewind: no data moves)."""
        if st.capacity != self.state[kind].capacity:
            raise MirrorError(f"{kind} mirror holds {self.state[kind].capacity} rows, the new state has capacity "
                              f"{st.capacity}: a capacity change must go through grow()")
        self.state[kind] = st

    def grow(self, kind: str, capacity: int) -> None:
        """A growing (head-major, never wrapped) plane moved to ``capacity`` rows: copy its live rows."""
        st = self.state[kind]
        if kind != NOPE or st.origin_physical != 0 or capacity < st.len:
            raise MirrorError(f"grow({kind}, {capacity}) of a plane in state {st}: only an unwrapped NoPE plane grows")
        k, v = self._alloc(kind, capacity)
        k[:, :, : st.len] = self.k[kind][:, :, : st.len]
        v[:, :, : st.len] = self.v[kind][:, :, : st.len]
        self._replace(kind, k, v)
        self.state[kind] = st.with_capacity(capacity)

    def load(self, kind: str, k: np.ndarray, v: np.ndarray, st: PlaneState) -> None:
        """Re-sync a class in bulk from host rows (a snapshot): SWA k/v [n, capacity, KV, D], NoPE k/v
        [n, KV, len, D] (the live rows; the rest is zero, as in the engine's plane)."""
        if st.capacity != self.state[kind].capacity:
            mk, mv = self._alloc(kind, st.capacity)
            self._replace(kind, mk, mv)
        mk, mv = self.k[kind], self.v[kind]
        if kind == SWA:
            mk[...], mv[...] = k, v
        else:
            mk[...], mv[...] = 0, 0
            mk[:, :, : st.len], mv[:, :, : st.len] = k, v
        self.state[kind] = st

    def close(self) -> None:
        self.backing.close()


# ---- the Metal dispatch -----------------------------------------------------------------------
def bridge_problems(views: Sequence, locate: Callable, n_heads: int, n_kv_heads: int, head_dim: int,
                    scale: float) -> list[tuple[object, tuple[object, int], tuple[object, int]]]:
    """The bridge's (mp_fa_problem, (k buffer, k byte offset), (v buffer, v byte offset)) for each
    ggml_flash_attn.KVView the engine builds over the mirror: the same strides in the bridge's units
    (ns10 = row stride in halves: 256 token-major / 128 head-major for Glimmer; head stride in bytes),
    offsets pointing at the first attended row.  ``locate`` maps a plane view to (buffer, offset, size)."""
    from . import metal_bridge

    out = []
    for vw in views:
        prob = metal_bridge.problem(n_heads, n_kv_heads, head_dim, int(vw.n_rows), int(vw.row_stride_elems),
                                    int(vw.head_stride_elems) * 2, scale, has_mask=vw.mask is not None)
        first = int(vw.first_row) * int(vw.row_stride_elems) * 2
        kbuf, koff, _ = locate(vw.k_plane)
        vbuf, voff, _ = locate(vw.v_plane)
        out.append((prob, (kbuf, koff + first), (vbuf, voff + first)))
    return out


class BridgeRunner:
    """The vec routes on Metal: every layer of a route in one bridge command buffer over the mirror.

    Never run (no macOS here).  Q, the outputs and the masks go through scratch bridge buffers that
    live as long as the runner (Q/out: n_layers x n_heads x head_dim f32; masks grown on demand).
    """

    def __init__(self, backing: MetalBacking, cfg: Geometry):
        self.backing, self.cfg = backing, cfg
        L, H, D = cfg.n_layers, cfg.n_heads, cfg.head_dim
        self._q = backing.zeros((L, H, D), np.float32)
        self._out = backing.zeros((L, H, D), np.float32)
        self._mask_rows = 0
        self._mask = None

    def _masks(self, rows: int) -> np.ndarray:
        """[n_layers, rows] f16 scratch, rows rounded up to 32 (each layer's mask 64-byte aligned)."""
        rows = -(-rows // 32) * 32
        if rows > self._mask_rows:
            old, self._mask = self._mask, self.backing.zeros((self.cfg.n_layers, rows), np.float16)
            if old is not None:
                self.backing.free(old)
            self._mask_rows = rows
        return self._mask

    def attend_many(self, q: np.ndarray, views: Sequence) -> np.ndarray:
        """q [n, n_heads, head_dim] f32, one KVView (over mirror buffers) per layer -> [n, n_heads, head_dim]."""
        g, bridge = self.cfg, self.backing.bridge
        n = len(views)
        self._q[:n] = q
        masks = self._masks(max(int(vw.n_rows) for vw in views)) if any(vw.mask is not None for vw in views) else None
        descs = []
        qbuf, qoff, _ = self.backing.locate(self._q)
        obuf, ooff, _ = self.backing.locate(self._out)
        row_bytes = g.n_heads * g.head_dim * 4
        probs = bridge_problems(views, self.backing.locate, g.n_heads, g.n_kv_heads, g.head_dim, g.attention_scale)
        for i, (vw, (prob, (kb, ko), (vb, vo))) in enumerate(zip(views, probs)):
            mbuf = moff = None
            if vw.mask is not None:
                masks[i, : vw.n_rows] = vw.mask
                mbuf, moff, _ = self.backing.locate(masks[i])
            descs.append(bridge.desc(prob, q=qbuf, k=kb, v=vb, out=obuf, mask=mbuf, q_offset=qoff + i * row_bytes,
                                     k_offset=ko, v_offset=vo, mask_offset=moff or 0,
                                     out_offset=ooff + i * row_bytes))
        bridge.attend(descs)  # one command buffer, waits: the outputs are ready on return
        return self._out[:n]
