"""llama.cpp's own CPU flash-attention kernel, run in place over a KV plane.

This is the "pinned llama vec" rung off macOS: ``ggml_flash_attn_ext`` from the
pinned ggml-python release (0.0.45, which vendors ggml v0.15.3), computing one
decode token's attention directly over the project's f16 K/V planes.  The planes
are never copied: the ggml K/V tensors are strided views whose ``data`` pointer and
byte strides (``nb[]``) are pointed at the caller's memory on every call.

What ggml computes on the CPU (src/ggml-cpu/ops.cpp, v0.15.3), which is why
results differ from a float64 reference by more than f32 rounding:

* Q is rounded to f16 (K's vec_dot_type) before the Q.K dot products.
* With f16 V the running V accumulator is kept in f16 and rounded after every
  key (``ggml_vec_mad_f16``); S and M are f32.
* At n_rows >= 512 the keys are split into one contiguous chunk per thread and
  the partials merged in f32, so results depend on the thread count.
* Consequence: the running accumulator ``sum_j exp(s_j - max) * v_j`` (per
  element, within one thread's chunk) must stay below 65504 (f16 max) or the
  output becomes inf/nan, and near that size it is only good to ~1%
  (ggml behaviour, not a bug here; pinned bit-exactly by a test).

Mask semantics are ggml's: the f16 mask is *added* to the scaled score, and an
entry of exactly -inf skips the row entirely.

Failure mode to know about: ggml reports bad arguments with GGML_ASSERT, which
aborts the whole process.  Every shape/stride/bounds rule ggml relies on is
therefore checked here in Python before anything reaches ggml.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import pathlib
from typing import NamedTuple, Optional, Tuple

import numpy as np

PINNED_GGML_PYTHON_VERSION = "0.0.45"
PINNED_GGML_VERSION = "0.15.3"   # what ggml-python 0.0.45 vendors (commit eced84c8)

_F16 = 2  # bytes per half
_F32 = 4


class PinnedLibraryError(RuntimeError):
    """The pinned ggml-python is missing, of another version, or unusable."""


# --------------------------------------------------------------------------
# Pinned library identity
# --------------------------------------------------------------------------

class PinnedGgml:
    """The imported, version-checked ggml-python module and its identity."""

    def __init__(self, module, lib_path: str, lib_dir: str, ggml_version: str,
                 ggml_commit: str, cpu_features: dict):
        self.ggml = module
        self.ggml_python_version = module.__version__
        self.ggml_version = ggml_version
        self.ggml_commit = ggml_commit          # "unknown" for the PyPI sdist build
        self.lib_path = lib_path                # libggml.so (front library)
        self.lib_dir = lib_dir
        self.cpu_features = cpu_features        # F16C/AVX2/FMA/... decide precision paths
        self._sha = None

    def sha256(self) -> dict:
        """sha256 of every shared library ggml-python loaded (computed once, lazily)."""
        if self._sha is None:
            out = {}
            for p in sorted(pathlib.Path(self.lib_dir).glob("*ggml*")):
                if p.is_file():
                    out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
            self._sha = out
        return self._sha

    def describe(self) -> str:
        commit = "" if self.ggml_commit in ("", "unknown") else f" {self.ggml_commit}"
        return (f"ggml-python {self.ggml_python_version} "
                f"(ggml v{self.ggml_version}{commit}) at {self.lib_path}")

    def __repr__(self) -> str:
        return f"<PinnedGgml {self.describe()}>"


_PINNED: Optional[PinnedGgml] = None


def load_pinned() -> PinnedGgml:
    """Import ggml-python, check it is exactly the pinned release, report identity.

    Raises PinnedLibraryError with the reason (not installed, wrong version,
    library fails to load, vendored ggml not v0.15.3).
    """
    global _PINNED
    if _PINNED is not None:
        return _PINNED
    try:
        import ggml  # noqa: F401  (the binding loads libggml*.so at import)
    except ImportError as e:
        raise PinnedLibraryError(
            f"ggml-python is not installed (pip install ggml-python=="
            f"{PINNED_GGML_PYTHON_VERSION}): {e}") from e
    except Exception as e:  # the binding raises RuntimeError/FileNotFoundError if the .so fails
        raise PinnedLibraryError(f"ggml-python failed to load its library: {e}") from e

    version = getattr(ggml, "__version__", None)
    if version != PINNED_GGML_PYTHON_VERSION:
        raise PinnedLibraryError(
            f"ggml-python {version} is installed, the pinned rung needs exactly "
            f"{PINNED_GGML_PYTHON_VERSION}")

    # The C library reports its own version; the sdist is built outside git, so
    # ggml_commit() is "unknown" there.  Check the C side too: a mismatched
    # libggml.so next to the right Python wrapper would be a silent lie.
    try:
        c_version = ggml.ggml_version().decode()
    except Exception as e:
        raise PinnedLibraryError(f"ggml_version() unavailable: {e}") from e
    if c_version != PINNED_GGML_VERSION:
        raise PinnedLibraryError(
            f"libggml reports v{c_version}, ggml-python {version} should vendor "
            f"v{PINNED_GGML_VERSION}")
    try:
        commit = ggml.ggml_commit().decode()
    except Exception:
        commit = "unknown"

    lib_dir = pathlib.Path(ggml.__file__).resolve().parent / "lib"
    lib_path = None
    # ggml.ggml.lib is a proxy over the loaded CDLLs; the first is libggml itself.
    for cdll in getattr(getattr(ggml.ggml, "lib", None), "_libraries", []) or []:
        lib_path = getattr(cdll, "_name", None)
        break
    if not lib_path:
        lib_path = str(lib_dir / "libggml.so")

    feats = {}
    for name in ("f16c", "fma", "avx", "avx2", "avx512", "neon", "fp16_va"):
        fn = getattr(ggml, f"ggml_cpu_has_{name}", None)
        if fn is not None:
            try:
                feats[name] = bool(fn())
            except Exception:
                pass

    _PINNED = PinnedGgml(ggml, str(lib_path), str(lib_dir), c_version, commit, feats)
    return _PINNED


def pinned_status() -> Tuple[bool, str]:
    """(ok, message) for the pinned ggml; never raises."""
    try:
        p = load_pinned()
        return True, p.describe()
    except PinnedLibraryError as e:
        return False, str(e)
    except Exception as e:  # pragma: no cover - belt and braces: this must not raise
        return False, f"ggml-python unusable: {type(e).__name__}: {e}"


# --------------------------------------------------------------------------
# Planes
# --------------------------------------------------------------------------

class RawPlane(NamedTuple):
    """A plane given as raw host memory: base address and extent in halves.

    The caller guarantees the memory stays alive and in place while it is used.
    Passing a RawPlane instead of an ndarray also saves reading the array's
    address on every call (~2.3 us per plane through __array_interface__).
    """
    addr: int
    n_elems: int

    @classmethod
    def of(cls, arr: np.ndarray) -> "RawPlane":
        """RawPlane over a C-contiguous float16 array (keep ``arr`` alive yourself)."""
        addr, n = _plane_base(arr, "plane")
        return cls(addr, n)


def taichi_plane(arr) -> RawPlane:
    """RawPlane over a CPU Taichi plane (its own memory, no copy): an f16 ndarray, or
    the engine's packed planes (u32 words of two halves, low half first: the same
    bytes as the f16 row, muser_ti/kernels/halves.py).

    Only valid on the CPU backend: on CUDA the pointer is a device address and
    on Vulkan/Metal Taichi returns 0.
    """
    import taichi as ti
    arch = ti.lang.impl.current_cfg().arch
    if arch not in (ti.x64, ti.arm64):
        raise ValueError(f"taichi_plane needs the CPU backend, Taichi runs on {arch}")
    halves_per_elem = {ti.f16: 1, ti.u32: 2}.get(arr.dtype)
    if halves_per_elem is None:
        raise TypeError(f"taichi plane must be f16 or packed u32 halves, got {arr.dtype}")
    addr = ti.lang.impl.get_runtime().prog.get_ndarray_data_ptr_as_int(arr.arr)
    if not addr:
        raise ValueError("Taichi returned a null data pointer (not a CPU ndarray?)")
    n = halves_per_elem
    for s in arr.shape:
        n *= int(s)
    for s in getattr(arr, "element_shape", ()) or ():
        n *= int(s)
    return RawPlane(int(addr), n)


def _plane_base(plane, what: str) -> Tuple[int, int]:
    """(address, extent in halves) of a plane, refusing anything that would need a copy."""
    if isinstance(plane, np.ndarray):
        if plane.dtype != np.float16:
            raise TypeError(f"{what} plane must be float16, got {plane.dtype}")
        if not plane.flags.c_contiguous:
            raise ValueError(f"{what} plane must be C-contiguous (it is addressed in flat halves)")
        return plane.__array_interface__["data"][0], plane.size
    if isinstance(plane, RawPlane):
        if not plane.addr or plane.addr % _F16 or plane.n_elems < 0:
            raise ValueError(f"{what} RawPlane must have a non-null, 2-byte aligned address")
        return int(plane.addr), int(plane.n_elems)
    raise TypeError(f"{what} plane must be a float16 numpy array or a RawPlane, got {type(plane)}")


def token_major_strides(n_kv_heads: int, head_dim: int) -> Tuple[int, int]:
    """(row_stride, head_stride) in halves for a token-major plane [row][kv_head][d]."""
    return n_kv_heads * head_dim, head_dim


def head_major_strides(head_dim: int, capacity: int) -> Tuple[int, int]:
    """(row_stride, head_stride) in halves for a head-major plane [kv_head][row][d]."""
    return head_dim, capacity * head_dim


# --------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------

class KVView(NamedTuple):
    """One node's K/V view: element (d, row, kv_head) at base + (first_row+row)*row_stride + kv_head*head_stride + d."""
    k_plane: object
    v_plane: object
    first_row: int
    n_rows: int
    row_stride_elems: int
    head_stride_elems: int
    mask: Optional[np.ndarray] = None


class GgmlFlashAttn:
    """Decode queries against strided f16 KV views, via ggml_flash_attn_ext.

    ``n_nodes`` independent attentions (one per layer) live in one ggml graph, so a
    whole route's layers are one ``ggml_graph_compute`` (one dispatch, however many
    layers share the route).  The graph depends only on (head_dim, n_heads,
    n_kv_heads, scale, which nodes have a mask), so it is built once per mask
    pattern and reused; each call only rewrites pointers, n_rows and byte strides
    in the tensor structs.  That is safe because the CPU work buffer size does not
    depend on n_kv (ggml_graph_plan: n_tasks*(DK+2*DV) + n_heads*n_tasks*(2+DV)
    floats, plus a prefill term independent of n_kv), and ggml reads ne/nb/data
    only at compute time.

    Per-call cost measured on the 2-core AMD EPYC dev box (AVX2+F16C, OpenMP
    build), 32 q / 2 kv heads, D=128, 2 threads, machine otherwise idle:
    ggml_graph_compute alone is ~7 us at 1 row and ~32 us at 32 rows; attend()
    adds ~4-5 us of Python on top (address reads, struct writes, q/out copies;
    ~2 us less with RawPlane planes).  Construction ~0.1 ms after the import.
    """

    def __init__(self, head_dim: int, n_heads: int, n_kv_heads: int,
                 scale: Optional[float] = None, n_threads: Optional[int] = None, n_nodes: int = 1):
        self._p = load_pinned()
        g = self._p.ggml
        self._g = g
        if head_dim <= 0 or n_heads <= 0 or n_kv_heads <= 0 or n_nodes <= 0:
            raise ValueError("head_dim, n_heads, n_kv_heads and n_nodes must be positive")
        if n_heads % n_kv_heads:
            # ggml_can_mul_mat would GGML_ASSERT (process abort) on this.
            raise ValueError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
        self.head_dim = int(head_dim)
        self.n_heads = int(n_heads)
        self.n_kv_heads = int(n_kv_heads)
        self.n_nodes = int(n_nodes)
        self.scale = float(1.0 / math.sqrt(head_dim) if scale is None else scale)
        self.n_threads = int(n_threads or os.cpu_count() or 1)

        # no_alloc: tensor structs only; every data pointer is ours to set.
        n = self.n_nodes
        mem = (8 * n + 8) * g.ggml_tensor_overhead() + 2 * g.ggml_graph_overhead_custom(8 * n, False) + 4096
        self._ctx = g.ggml_init(g.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
        if not self._ctx:
            raise PinnedLibraryError("ggml_init failed")

        D, H, Hkv = self.head_dim, self.n_heads, self.n_kv_heads
        # q and the outputs [node, H, D] f32 live here for the instance's lifetime.
        self._qbuf = np.zeros((n, H, D), dtype=np.float32)
        self._obuf = np.zeros((n, H, D), dtype=np.float32)
        self._q, self._k, self._v, self._m = [], [], [], []
        for i in range(n):
            # q [D, n_q=1, H, 1] f32, contiguous: matches a C-contiguous [H, D] array.
            self._q.append(g.ggml_new_tensor_4d(self._ctx, g.GGML_TYPE_F32, D, 1, H, 1))
            # k, v [D, n_kv, Hkv, 1] f16; n_kv (ne[1]) and nb[1..3] are rewritten per call.
            self._k.append(g.ggml_new_tensor_4d(self._ctx, g.GGML_TYPE_F16, D, 1, Hkv, 1))
            self._v.append(g.ggml_new_tensor_4d(self._ctx, g.GGML_TYPE_F16, D, 1, Hkv, 1))
            # mask [n_kv, n_q=1, 1, 1] f16, contiguous (ggml asserts contiguity at build).
            self._m.append(g.ggml_new_tensor_4d(self._ctx, g.GGML_TYPE_F16, 1, 1, 1, 1))
            self._q[i].contents.data = self._qbuf[i].ctypes.data
        self._qc = [t.contents for t in self._q]
        self._kc = [t.contents for t in self._k]
        self._vc = [t.contents for t in self._v]
        self._mc = [t.contents for t in self._m]
        self._kv_shape = [None] * n  # (n_rows, row_stride, head_stride) currently in each node's K/V structs

        self._graphs = {}  # mask pattern (tuple of bools) -> graph
        self._tp = None
        tpp = g.ggml_threadpool_params_default(self.n_threads)
        # A persistent threadpool saves ggml_graph_compute from creating a
        # disposable one per call (with the OpenMP build that is only mallocs,
        # but it is free to avoid).
        self._tp = g.ggml_threadpool_new(ctypes.byref(tpp))
        self._plan = None
        self._work = None
        self._build((False,) * n)

    # -- graph ------------------------------------------------------------

    def _build(self, masks: tuple):
        g = self._g
        gf = g.ggml_new_graph_custom(self._ctx, 8 * self.n_nodes, False)
        for i, has_mask in enumerate(masks):
            res = g.ggml_flash_attn_ext(self._ctx, self._q[i], self._k[i], self._v[i],
                                        self._m[i] if has_mask else None, self.scale, 0.0, 0.0)
            g.ggml_build_forward_expand(gf, res)
            # result [DV, H, n_q=1, 1] f32 contiguous == a C-contiguous [H, D] array
            res.contents.data = self._obuf[i].ctypes.data
        plan = g.ggml_graph_plan(gf, self.n_threads, self._tp)
        if self._plan is None or plan.work_size > self._plan.work_size:
            # work buffer owned by numpy, 64-byte aligned by slicing
            raw = np.empty(plan.work_size + 64, dtype=np.uint8)
            off = (-raw.ctypes.data) % 64
            self._work = raw[off:off + plan.work_size] if plan.work_size else raw
            self._plan = plan
        self._plan.work_data = ctypes.cast(self._work.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
        self._plan_ref = ctypes.byref(self._plan)
        self._compute = g.ggml_graph_compute
        self._graphs[masks] = gf
        return gf

    # -- call -------------------------------------------------------------

    def attend(self, q: np.ndarray, k_plane, v_plane, *, first_row: int, n_rows: int,
               row_stride_elems: int, head_stride_elems: int,
               mask: Optional[np.ndarray] = None, out: Optional[np.ndarray] = None) -> np.ndarray:
        """softmax(scale * q.K^T + mask) . V over rows first_row .. first_row+n_rows-1.

        Element (d, row, kv_head) of K (and V) is read in place at
        ``base + (first_row+row)*row_stride_elems + kv_head*head_stride_elems + d``
        halves, where base is the start of k_plane / v_plane (a C-contiguous
        float16 numpy array, or a RawPlane).  q: [n_heads, head_dim] (float32;
        other float dtypes are cast).  Returns float32 [n_heads, head_dim],
        written into ``out`` if given.  mask: length n_rows, additive float
        (float16 C-contiguous is used in place; -inf skips the row) or bool
        (True = attend).  Not thread-safe: one call at a time per instance.
        """
        if self.n_nodes != 1:
            raise ValueError(f"attend() is for one node; this runner has {self.n_nodes}: use attend_many()")
        H, D = self.n_heads, self.head_dim
        if q.shape != (H, D):
            raise ValueError(f"q must be [{H}, {D}], got {q.shape}")
        if out is not None and (out.shape != (H, D) or out.dtype != np.float32):
            raise ValueError(f"out must be float32 [{H}, {D}], got {out.dtype} {out.shape}")
        view = KVView(k_plane, v_plane, first_row, n_rows, row_stride_elems, head_stride_elems, mask)
        result = self.attend_many(q[None], [view])[0]
        if out is None:
            return result.copy()
        out[...] = result
        return out

    def attend_many(self, q: np.ndarray, views) -> np.ndarray:
        """One graph compute over every node: q [n_nodes, H, D], one KVView per node.

        Returns the internal [n_nodes, H, D] output buffer (valid until the next call).
        """
        H, D = self.n_heads, self.head_dim
        if q.shape != (self.n_nodes, H, D):
            raise ValueError(f"q must be [{self.n_nodes}, {H}, {D}], got {q.shape}")
        if len(views) != self.n_nodes:
            raise ValueError(f"expected {self.n_nodes} views, got {len(views)}")
        masks = tuple(vw.mask is not None for vw in views)
        for i, vw in enumerate(views):
            self._set_view(i, vw)
        gf = self._graphs.get(masks) or self._build(masks)
        # q lives in a buffer owned here: copying it costs ~1 us per 16 KiB, less than
        # reading a caller array's address through __array_interface__ (~2.3 us).
        self._qbuf[...] = q
        status = self._compute(gf, self._plan_ref)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute returned status {status}")
        return self._obuf

    def _set_view(self, i: int, vw: KVView) -> None:
        D, Hkv = self.head_dim, self.n_kv_heads
        n_rows, first_row = int(vw.n_rows), int(vw.first_row)
        rs, hs = int(vw.row_stride_elems), int(vw.head_stride_elems)
        if n_rows < 1 or first_row < 0 or rs < 1 or hs < 1:
            raise ValueError("need n_rows >= 1, first_row >= 0 and positive strides")
        k_addr, k_n = _plane_base(vw.k_plane, "K")
        v_addr, v_n = _plane_base(vw.v_plane, "V")
        # one past the last half the view touches, relative to the plane base
        end = (first_row + n_rows - 1) * rs + (Hkv - 1) * hs + D
        if end > k_n or end > v_n:
            raise ValueError(f"view needs {end} halves but the planes hold K {k_n}, V {v_n}")
        mask = vw.mask
        if mask is not None:
            if mask.dtype == np.bool_:
                mask = np.where(mask, np.float16(0), np.float16(-np.inf))
            elif mask.dtype != np.float16 or not mask.flags.c_contiguous:
                mask = np.ascontiguousarray(mask, dtype=np.float16)
            if mask.shape != (n_rows,):
                raise ValueError(f"mask must have shape ({n_rows},), got {mask.shape}")
            self._mask_keep = getattr(self, "_mask_keep", {})
            self._mask_keep[i] = mask  # alive until the compute has read it
        off = first_row * rs * _F16
        kc, vc = self._kc[i], self._vc[i]
        kc.data = k_addr + off
        vc.data = v_addr + off
        shape = (n_rows, rs, hs)
        if shape != self._kv_shape[i]:
            # ctypes array item writes cost ~0.5 us each: only on change
            nb1, nb2 = rs * _F16, hs * _F16
            for t in (kc, vc):
                t.ne[1] = n_rows
                t.nb[1] = nb1
                t.nb[2] = nb2
                t.nb[3] = nb2 * Hkv    # ne[3] == 1, so any value; keep it monotone
            self._kv_shape[i] = shape
        if mask is not None:
            m = self._mc[i]
            m.data = mask.__array_interface__["data"][0]
            if m.ne[0] != n_rows:
                m.ne[0] = n_rows
                m.nb[1] = m.nb[2] = m.nb[3] = n_rows * _F16

    # -- introspection / lifetime ----------------------------------------

    @property
    def k_data_ptr(self) -> int:
        """Address ggml's K tensor reads from (the plane address + first_row offset)."""
        return int(self._kc[0].data or 0)

    @property
    def v_data_ptr(self) -> int:
        return int(self._vc[0].data or 0)

    def close(self):
        g = getattr(self, "_g", None)
        if g is None:
            return
        if getattr(self, "_tp", None):
            g.ggml_threadpool_free(self._tp)
            self._tp = None
        if getattr(self, "_ctx", None):
            g.ggml_free(self._ctx)
            self._ctx = None
        self._graphs = {}
        self._g = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
