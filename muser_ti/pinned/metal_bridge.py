"""ctypes loader for the pinned Metal bridge (metal_pinned/, macOS only).

The bridge (``libmuser_metal_pinned.dylib``, built by ``make -C metal_pinned bridge``) dispatches
llama.cpp's Metal flash-attention vec kernel (ggml v0.15.3) from a metallib whose sha256 must equal
``metal_pinned/PIN``.  This module mirrors its C ABI (``metal_pinned/mp_bridge.h``) and loads it on
Darwin only.  Importing it never loads anything, so it imports cleanly on Linux; :func:`load` raises
:class:`MetalBridgeError` with the reason off Darwin, when the dylib, metallib or PIN is missing, when
PIN still holds its placeholder, or when the metallib's digest differs.

The plain-C part of the ABI (plans, struct introspection, PIN and SHA-256) is declared separately by
:func:`declare_plan_abi`, so tests on Linux can bind the same declarations to a gcc-built library.

    bridge = metal_bridge.load()                    # Darwin: verified, or MetalBridgeError
    bridge.identity                                 # {'sha256': ..., 'device': ..., 'ggml': 'v0.15.3', ...}
    q = bridge.buffer(32 * 128 * 4)                 # shared-storage MTLBuffer, numpy view via .array()
    bridge.attend([bridge.desc(problem, q=q, k=k, v=v, out=o, k_offset=..., ...)])
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import sys
from typing import Optional, Sequence

ABI_VERSION = 1
PINNED_GGML_TAG = "v0.15.3"
PINNED_GGML_COMMIT = "eced84c86f8b012c752c016f7fe789adea168e1e"
PIN_PLACEHOLDER = "UNSET"

_REPO = pathlib.Path(__file__).resolve().parents[2]
METAL_PINNED_DIR = _REPO / "metal_pinned"
DEFAULT_DYLIB = METAL_PINNED_DIR / "build" / "libmuser_metal_pinned.dylib"
DEFAULT_METALLIB = METAL_PINNED_DIR / "build" / f"ggml-{PINNED_GGML_TAG}.metallib"
DEFAULT_PIN = METAL_PINNED_DIR / "PIN"
ENV_DYLIB = "MUSER_METAL_PINNED_DYLIB"
ENV_METALLIB = "MUSER_METAL_PINNED_METALLIB"
ENV_PIN = "MUSER_METAL_PINNED_PIN"

_ERRLEN = 1024


class MetalBridgeError(RuntimeError):
    """The pinned Metal bridge cannot be used here (not Darwin, missing files, unset/mismatched pin, ...)."""


# --------------------------------------------------------------------------------------------------
# ctypes mirrors of fa_plan.h / mp_bridge.h (layouts checked against the C by tests/test_metal_pinned.py)
# --------------------------------------------------------------------------------------------------

_i32, _u32, _i64, _u64, _f32 = ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_float


class KargsFaVec(ctypes.Structure):
    """ggml_metal_kargs_flash_attn_ext_vec (192 bytes)."""
    _fields_ = [
        ("ne01", _i32), ("ne02", _i32), ("ne03", _i32), ("nb01", _u64), ("nb02", _u64), ("nb03", _u64),
        ("ne11", _i32), ("ne_12_2", _i32), ("ne_12_3", _i32),
        ("ns10", _i32), ("nb11", _u64), ("nb12", _u64), ("nb13", _u64),
        ("ns20", _i32), ("nb21", _u64), ("nb22", _u64), ("nb23", _u64),
        ("ne31", _i32), ("ne32", _i32), ("ne33", _i32), ("nb31", _u64), ("nb32", _u64), ("nb33", _u64),
        ("ne1", _i32), ("ne2", _i32), ("ne3", _i32),
        ("scale", _f32), ("max_bias", _f32), ("m0", _f32), ("m1", _f32), ("n_head_log2", _i32),
        ("logit_softcap", _f32),
    ]


class KargsFaPad(ctypes.Structure):
    """ggml_metal_kargs_flash_attn_ext_pad (104 bytes)."""
    _fields_ = [
        ("ne11", _i32), ("ne_12_2", _i32), ("ne_12_3", _i32),
        ("nb11", _u64), ("nb12", _u64), ("nb13", _u64), ("nb21", _u64), ("nb22", _u64), ("nb23", _u64),
        ("ne31", _i32), ("ne32", _i32), ("ne33", _i32), ("nb31", _u64), ("nb32", _u64), ("nb33", _u64),
    ]


class KargsFaVecReduce(ctypes.Structure):
    """ggml_metal_kargs_flash_attn_ext_vec_reduce (4 bytes)."""
    _fields_ = [("nrows", _i32)]


class FaProblem(ctypes.Structure):
    """mp_fa_problem: one decode token of one layer (see fa_plan.h)."""
    _fields_ = [
        ("n_heads", _i32), ("n_kv_heads", _i32), ("head_dim", _i32), ("visible", _i32),
        ("k_row_stride", _i32), ("v_row_stride", _i32), ("k_head_stride", _i64), ("v_head_stride", _i64),
        ("scale", _f32), ("has_mask", _i32),
    ]


class FaPlan(ctypes.Structure):
    """mp_fa_plan: what the bridge dispatches for a problem."""
    _fields_ = [
        ("vec", KargsFaVec), ("pad", KargsFaPad), ("reduce", KargsFaVecReduce),
        ("nwg", _i32), ("nsg", _i32), ("ncpsg", _i32),
        ("has_mask", _i32), ("has_sinks", _i32), ("has_bias", _i32), ("has_scap", _i32), ("has_kvpad", _i32),
        ("vec_groups", _u32 * 3), ("vec_threads", _u32 * 3),
        ("pad_groups", _u32 * 3), ("pad_threads", _u32 * 3),
        ("reduce_groups", _u32 * 3), ("reduce_threads", _u32 * 3),
        ("vec_smem_bytes", _u64), ("q_bytes", _u64), ("out_bytes", _u64), ("mask_bytes", _u64),
        ("k_extent", _u64), ("v_extent", _u64), ("pad_bytes", _u64), ("pad_bytes_ggml", _u64),
        ("tmp_bytes", _u64), ("tmp_bytes_ggml", _u64),
    ]


class FcValue(ctypes.Structure):
    """mp_fc_value: one function constant (index, type 1=bool 2=int32, value, name)."""
    _fields_ = [("index", _i32), ("type", _i32), ("value", _i32), ("name", ctypes.c_char_p)]


class AttendDesc(ctypes.Structure):
    """mp_attend_desc: buffers (mp_buf* handles) and byte offsets for one dispatch."""
    _fields_ = [
        ("problem", FaProblem),
        ("q", ctypes.c_void_p), ("q_offset", _u64),
        ("k", ctypes.c_void_p), ("k_offset", _u64),
        ("v", ctypes.c_void_p), ("v_offset", _u64),
        ("mask", ctypes.c_void_p), ("mask_offset", _u64),
        ("out", ctypes.c_void_p), ("out_offset", _u64),
    ]


MIRRORS = {"fa_vec": KargsFaVec, "fa_pad": KargsFaPad, "fa_vec_reduce": KargsFaVecReduce,
           "problem": FaProblem, "plan": FaPlan, "fc_value": FcValue, "attend_desc": AttendDesc}


def layout_head_major(capacity: int, head_dim: int = 128) -> tuple[int, int]:
    """(row stride in elements, head stride in bytes) of a head-major (NoPE) plane: ns10 = head_dim."""
    return head_dim, capacity * head_dim * 2


def layout_token_major(n_kv_heads: int, head_dim: int = 128) -> tuple[int, int]:
    """(row stride in elements, head stride in bytes) of a token-major (SWA) ring: ns10 = n_kv_heads*head_dim."""
    return n_kv_heads * head_dim, head_dim * 2


def problem(n_heads: int, n_kv_heads: int, head_dim: int, visible: int, row_stride: int, head_stride: int,
            scale: float, has_mask: bool = False) -> FaProblem:
    """An mp_fa_problem with the same layout for K and V (the project's planes)."""
    return FaProblem(n_heads, n_kv_heads, head_dim, visible, row_stride, row_stride, head_stride, head_stride,
                     scale, 1 if has_mask else 0)


# --------------------------------------------------------------------------------------------------
# ABI declarations
# --------------------------------------------------------------------------------------------------

_cp, _sz, _vp = ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p

PLAN_ABI = {
    "mp_abi_version": ([], ctypes.c_int),
    "mp_ggml_tag": ([], _cp),
    "mp_ggml_commit": ([], _cp),
    "mp_fa_nsg": ([_i32, _i32], _i32),
    "mp_fa_vec_smem_bytes": ([_i32, _i32, _i32, _i32], _u64),
    "mp_fa_make_plan": ([ctypes.POINTER(FaProblem), ctypes.POINTER(FaPlan), _cp, _sz], ctypes.c_int),
    "mp_fa_vec_constants": ([ctypes.POINTER(FaPlan), ctypes.POINTER(FcValue)], ctypes.c_int),
    "mp_fa_pad_constants": ([ctypes.POINTER(FaPlan), ctypes.POINTER(FcValue)], ctypes.c_int),
    "mp_fa_reduce_constants": ([ctypes.POINTER(FaPlan), ctypes.POINTER(FcValue)], ctypes.c_int),
    "mp_fa_pipeline_key": ([_cp, ctypes.POINTER(FcValue), ctypes.c_int, _cp, _sz], ctypes.c_int),
    "mp_struct_sizeof": ([_cp], _i64),
    "mp_struct_offsetof": ([_cp, _cp], _i64),
    "mp_sha256_file": ([_cp, _cp, _cp, _sz], ctypes.c_int),
    "mp_pin_parse": ([_cp, _cp, _cp, _sz], ctypes.c_int),
    "mp_pin_read": ([_cp, _cp, _cp, _sz], ctypes.c_int),
    "mp_pin_check": ([_vp, _sz, _cp, _cp, _cp, _sz], ctypes.c_int),
}

BRIDGE_ABI = {
    "mp_open": ([_cp, _cp, _cp, _sz], _vp),
    "mp_close": ([_vp], None),
    "mp_identity": ([_vp, _cp, _cp, _sz], ctypes.c_int),
    "mp_buffer_new": ([_vp, _sz, _cp, _sz], _vp),
    "mp_buffer_wrap": ([_vp, _vp, _sz, _cp, _sz], _vp),
    "mp_buffer_from_mtl": ([_vp, _vp, _cp, _sz], _vp),
    "mp_buffer_contents": ([_vp], _vp),
    "mp_buffer_length": ([_vp], _sz),
    "mp_buffer_free": ([_vp], None),
    "mp_attend": ([_vp, ctypes.POINTER(AttendDesc), _cp, _sz], ctypes.c_int),
    "mp_attend_batch": ([_vp, ctypes.POINTER(AttendDesc), ctypes.c_int, _cp, _sz], ctypes.c_int),
}


def _declare(lib, table: dict) -> None:
    for name, (argtypes, restype) in table.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as exc:
            raise MetalBridgeError(f"{lib._name}: missing symbol {name} (is it libmuser_metal_pinned of ABI "
                                   f"{ABI_VERSION}?)") from exc
        fn.argtypes = argtypes
        fn.restype = restype


def declare_plan_abi(lib) -> None:
    """Declare the plain-C functions (plans, introspection, PIN, SHA-256) on a loaded CDLL."""
    _declare(lib, PLAN_ABI)


def declare_bridge_abi(lib) -> None:
    """Declare the whole ABI (plain C + Metal) on the loaded dylib."""
    _declare(lib, PLAN_ABI)
    _declare(lib, BRIDGE_ABI)


def make_plan(lib, prob: FaProblem) -> FaPlan:
    """mp_fa_make_plan through any library that exports it; raises MetalBridgeError on a refused problem."""
    plan, err = FaPlan(), ctypes.create_string_buffer(_ERRLEN)
    if lib.mp_fa_make_plan(ctypes.byref(prob), ctypes.byref(plan), err, _ERRLEN) != 0:
        raise MetalBridgeError(err.value.decode())
    return plan


def read_pin(lib, pin_path) -> str:
    """The 64-hex-digit digest in a PIN file, through the C parser; refuses the placeholder."""
    out, err = ctypes.create_string_buffer(65), ctypes.create_string_buffer(_ERRLEN)
    if lib.mp_pin_read(os.fsencode(str(pin_path)), out, err, _ERRLEN) != 0:
        raise MetalBridgeError(err.value.decode())
    return out.value.decode()


# --------------------------------------------------------------------------------------------------
# The bridge
# --------------------------------------------------------------------------------------------------

class MetalBuffer:
    """An MTLBuffer owned by the bridge (shared storage: the CPU sees it at .address)."""

    def __init__(self, bridge: "PinnedMetal", handle: int):
        self._bridge, self.handle = bridge, handle
        self.nbytes = int(bridge._lib.mp_buffer_length(handle))
        self.address = bridge._lib.mp_buffer_contents(handle)

    def array(self, dtype, shape, offset: int = 0):
        """A numpy view of the buffer's memory (valid until free())."""
        import numpy as np
        if not self.address:
            raise MetalBridgeError("buffer is not CPU-visible (private storage)")
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        if offset < 0 or offset + count * dtype.itemsize > self.nbytes:
            raise MetalBridgeError(f"view of {count} x {dtype} at {offset} exceeds the buffer's {self.nbytes} bytes")
        raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(self.address + offset)
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)

    def free(self) -> None:
        if self.handle:
            self._bridge._lib.mp_buffer_free(self.handle)
            self.handle = None


class PinnedMetal:
    """An open, verified bridge: a Metal device, the pinned metallib, and its pipelines."""

    def __init__(self, lib, handle: int, dylib: str, metallib: str, pin: str):
        self._lib, self._ctx = lib, handle
        sha, dev = ctypes.create_string_buffer(65), ctypes.create_string_buffer(256)
        lib.mp_identity(handle, sha, dev, 256)
        self.identity = {
            "sha256": sha.value.decode(), "device": dev.value.decode(), "metallib": metallib, "pin": pin,
            "dylib": dylib, "ggml": lib.mp_ggml_tag().decode(), "ggml_commit": lib.mp_ggml_commit().decode(),
            "abi": lib.mp_abi_version(),
        }

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def describe(self) -> str:
        i = self.identity
        return (f"llama.cpp Metal vec kernel from ggml {i['ggml']} ({i['ggml_commit'][:8]}), metallib {i['metallib']} "
                f"sha256 {i['sha256']} (verified against {i['pin']}), device {i['device']}")

    def plan(self, prob: FaProblem) -> FaPlan:
        return make_plan(self._lib, prob)

    def buffer(self, nbytes: int) -> MetalBuffer:
        err = ctypes.create_string_buffer(_ERRLEN)
        h = self._lib.mp_buffer_new(self._ctx, nbytes, err, _ERRLEN)
        if not h:
            raise MetalBridgeError(err.value.decode())
        return MetalBuffer(self, h)

    def desc(self, prob: FaProblem, q: MetalBuffer, k: MetalBuffer, v: MetalBuffer, out: MetalBuffer,
             mask: Optional[MetalBuffer] = None, q_offset: int = 0, k_offset: int = 0, v_offset: int = 0,
             mask_offset: int = 0, out_offset: int = 0) -> AttendDesc:
        return AttendDesc(prob, q.handle, q_offset, k.handle, k_offset, v.handle, v_offset,
                          mask.handle if mask is not None else None, mask_offset, out.handle, out_offset)

    def attend(self, descs: Sequence[AttendDesc]) -> None:
        """Run the descriptors in order in one command buffer and wait (mp_attend_batch)."""
        n = len(descs)
        if n == 0:
            return
        arr = (AttendDesc * n)(*descs)
        err = ctypes.create_string_buffer(_ERRLEN)
        if self._lib.mp_attend_batch(self._ctx, arr, n, err, _ERRLEN) != 0:
            raise MetalBridgeError(err.value.decode())

    def close(self) -> None:
        if self._ctx:
            self._lib.mp_close(self._ctx)
            self._ctx = None


def _path(arg, env: str, default: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(arg or os.environ.get(env) or default)


def load(dylib=None, metallib=None, pin=None) -> PinnedMetal:
    """Open the pinned bridge (Darwin only).  Paths default to metal_pinned/build/... and metal_pinned/PIN,
    overridable with MUSER_METAL_PINNED_DYLIB / _METALLIB / _PIN.  Raises MetalBridgeError with the reason."""
    if sys.platform != "darwin":
        raise MetalBridgeError(f"the pinned Metal bridge needs macOS with Metal; this is {sys.platform} "
                               "(off macOS the pinned rung is ggml's flash_attn_ext, muser_ti.pinned.ggml)")
    dylib_p = _path(dylib, ENV_DYLIB, DEFAULT_DYLIB)
    metallib_p = _path(metallib, ENV_METALLIB, DEFAULT_METALLIB)
    pin_p = _path(pin, ENV_PIN, DEFAULT_PIN)
    for what, p, how in (("bridge dylib", dylib_p, "make -C metal_pinned bridge"),
                         ("metallib", metallib_p, "make -C metal_pinned metallib"),
                         ("PIN", pin_p, "make -C metal_pinned pin")):
        if not p.is_file():
            raise MetalBridgeError(f"no {what} at {p} (build it with `{how}`; see metal_pinned/README.md)")
    try:
        lib = ctypes.CDLL(str(dylib_p))
    except OSError as exc:
        raise MetalBridgeError(f"cannot load {dylib_p}: {exc}") from exc
    declare_bridge_abi(lib)
    if lib.mp_abi_version() != ABI_VERSION:
        raise MetalBridgeError(f"{dylib_p} has ABI {lib.mp_abi_version()}, this module speaks {ABI_VERSION}")
    pin_hex = read_pin(lib, pin_p)  # refuses the placeholder
    err = ctypes.create_string_buffer(_ERRLEN)
    handle = lib.mp_open(os.fsencode(str(metallib_p)), pin_hex.encode(), err, _ERRLEN)
    if not handle:
        raise MetalBridgeError(err.value.decode())
    return PinnedMetal(lib, handle, str(dylib_p), str(metallib_p), str(pin_p))


def status() -> tuple[bool, str]:
    """(usable, why) without raising: for the ladder's "pinned library loaded" predicate and reports."""
    try:
        with load() as bridge:
            return True, bridge.describe()
    except MetalBridgeError as exc:
        return False, str(exc)
