"""llama.cpp's CUDA flash-attention kernel as a benchmark peer: the pinned ggml (v0.15.3), built for CUDA.

Not part of the ladder (the rung reads host planes; this reads device memory it owns) and not needed by
users or CI: ``muser-bench --arch cuda`` times it beside our kernels where ``MUSER_GGML_CUDA_DIR`` names a
folder holding a CUDA build of ggml-python 0.0.45's vendored ggml (libggml-base.so, libggml-cuda.so), which
the lab's runner builds on the GPU machine (scripts/lab/run.sh).  It is bound here with ctypes, a few
calls, rather than through ggml-python, whose 0.0.45 bindings ask for CUDA symbols v0.15.3 does not have.

It attends one query of ``n_heads`` heads over ``n_keys`` f16 rows of ``n_kv_heads`` heads, as llama.cpp's
graph does: ggml_flash_attn_ext with a mask (all zeros here: every key visible) and the F32 precision
llama.cpp sets on every attention node (llama-graph's build_attn_mha), over a key count that is a multiple
of 256 (llama's padding), so ggml picks the kernel it would: without a mask ggml v0.15.3 does not pack the
GQA heads as the tensor-core kernel's columns (fattn.cu, use_gqa_opt), and the peer would not be llama.cpp's.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from ..pinned.ggml import PINNED_GGML_VERSION

DIR_ENV = "MUSER_GGML_CUDA_DIR"
GGML_TYPE_F32, GGML_TYPE_F16, GGML_PREC_F32 = 0, 1, 10
_P = ctypes.c_void_p


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


_SIGNATURES = {  # name: (argument types, result type), as ggml v0.15.3's headers declare them
    "ggml_version": ([], ctypes.c_char_p),
    "ggml_tensor_overhead": ([], ctypes.c_size_t),
    "ggml_graph_overhead": ([], ctypes.c_size_t),
    "ggml_init": ([_InitParams], _P),
    "ggml_free": ([_P], None),
    "ggml_new_tensor_4d": ([_P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64], _P),
    "ggml_flash_attn_ext": ([_P, _P, _P, _P, _P, ctypes.c_float, ctypes.c_float, ctypes.c_float], _P),
    "ggml_flash_attn_ext_set_prec": ([_P, ctypes.c_int], None),
    "ggml_new_graph": ([_P], _P),
    "ggml_build_forward_expand": ([_P, _P], None),
    "ggml_backend_alloc_ctx_tensors": ([_P, _P], _P),
    "ggml_backend_buffer_free": ([_P], None),
    "ggml_backend_tensor_set": ([_P, _P, ctypes.c_size_t, ctypes.c_size_t], None),
    "ggml_backend_tensor_get": ([_P, _P, ctypes.c_size_t, ctypes.c_size_t], None),
    "ggml_backend_graph_compute": ([_P, _P], ctypes.c_int),
    "ggml_backend_free": ([_P], None),
    "ggml_backend_cuda_init": ([ctypes.c_int], _P),
    "ggml_backend_cuda_get_device_count": ([], ctypes.c_int),
}
_LIB = None


class _Ggml:
    """The libraries of a CUDA build, loaded once, each function typed (a wrong type crashes ctypes calls)."""

    def __init__(self, folder: Path):
        self._libs = [ctypes.CDLL(str(folder / name), mode=ctypes.RTLD_GLOBAL)
                      for name in ("libggml-base.so", "libggml-cuda.so")]
        for name, (args, result) in _SIGNATURES.items():
            fn = next(getattr(lib, name) for lib in self._libs if hasattr(lib, name))
            fn.argtypes, fn.restype = args, result
            setattr(self, name, fn)


def _load() -> _Ggml:
    global _LIB
    if _LIB is None:
        folder = os.environ.get(DIR_ENV)
        if not folder:
            raise RuntimeError(f"{DIR_ENV} is not set (a folder with a CUDA build of the pinned ggml: scripts/lab/run.sh "
                               "builds one on the GPU machine)")
        _LIB = _Ggml(Path(folder))
    return _LIB


def status() -> tuple[bool, str]:
    """(usable, description): a CUDA build of the pinned ggml, loaded, version-checked, with a device?"""
    try:
        g = _load()
    except (RuntimeError, OSError, StopIteration) as exc:
        return False, f"no CUDA build of the pinned ggml: {exc}"
    version = g.ggml_version().decode()
    if version != PINNED_GGML_VERSION:
        return False, f"the CUDA build in {os.environ[DIR_ENV]} is ggml {version}, not the pinned {PINNED_GGML_VERSION}"
    if g.ggml_backend_cuda_get_device_count() < 1:
        return False, "the CUDA build of ggml sees no device"
    return True, f"ggml {version} (ggml-python 0.0.45's vendored source) CUDA backend, {os.environ[DIR_ENV]}"


class GgmlCudaAttn:
    """One decode attention on ggml's CUDA backend: load(k, v) once, then attend(q) any number of times."""

    def __init__(self, head_dim: int, n_heads: int, n_kv_heads: int, n_keys: int, scale: float):
        if n_keys % 256:
            raise ValueError(f"n_keys {n_keys}: llama.cpp pads its attended cells to 256; give a multiple of 256")
        g = self._g = _load()
        self._backend = self._ctx = self._buffer = None
        self._backend = g.ggml_backend_cuda_init(0)
        if not self._backend:
            raise RuntimeError("ggml_backend_cuda_init(0) failed")
        self._ctx = g.ggml_init(_InitParams(16 * g.ggml_tensor_overhead() + g.ggml_graph_overhead(), None, True))
        D, H, KV = head_dim, n_heads, n_kv_heads
        self._q = g.ggml_new_tensor_4d(self._ctx, GGML_TYPE_F32, D, 1, H, 1)  # [D, n_q, H, 1]
        self._k = g.ggml_new_tensor_4d(self._ctx, GGML_TYPE_F16, D, n_keys, KV, 1)  # head-major rows
        self._v = g.ggml_new_tensor_4d(self._ctx, GGML_TYPE_F16, D, n_keys, KV, 1)
        self._mask = g.ggml_new_tensor_4d(self._ctx, GGML_TYPE_F16, n_keys, 1, 1, 1)  # [n_kv, n_q, 1, 1]
        self._out = g.ggml_flash_attn_ext(self._ctx, self._q, self._k, self._v, self._mask, scale, 0.0, 0.0)
        g.ggml_flash_attn_ext_set_prec(self._out, GGML_PREC_F32)
        self._graph = g.ggml_new_graph(self._ctx)
        g.ggml_build_forward_expand(self._graph, self._out)
        self._buffer = g.ggml_backend_alloc_ctx_tensors(self._ctx, self._backend)
        zeros = np.zeros(n_keys, np.float16)
        g.ggml_backend_tensor_set(self._mask, zeros.ctypes.data, 0, zeros.nbytes)
        self._host_out = np.empty((H, D), np.float32)  # [DV, H, n_q] in ggml's order is C [H, D]

    def load(self, k: np.ndarray, v: np.ndarray) -> None:
        """K and V as float16 [n_kv_heads, n_keys, head_dim] (a head-major plane's rows)."""
        for t, a in ((self._k, k), (self._v, v)):
            a = np.ascontiguousarray(a, np.float16)
            self._g.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.nbytes)

    def attend(self, q: np.ndarray) -> np.ndarray:
        """q float32 [n_heads, head_dim] -> the attention output, like q."""
        q = np.ascontiguousarray(q, np.float32)
        self._g.ggml_backend_tensor_set(self._q, q.ctypes.data, 0, q.nbytes)
        self.compute()
        self._g.ggml_backend_tensor_get(self._out, self._host_out.ctypes.data, 0, self._host_out.nbytes)
        return self._host_out.copy()

    def compute(self) -> None:
        """The graph alone on the device, to its completion (what a benchmark times)."""
        if self._g.ggml_backend_graph_compute(self._backend, self._graph) != 0:
            raise RuntimeError("ggml_backend_graph_compute failed")

    def close(self) -> None:
        g = self._g
        if self._buffer:
            g.ggml_backend_buffer_free(self._buffer)
        if self._ctx:
            g.ggml_free(self._ctx)
        if self._backend:
            g.ggml_backend_free(self._backend)
        self._backend = self._ctx = self._buffer = None

    def __del__(self):
        self.close()


__all__ = ["DIR_ENV", "GgmlCudaAttn", "status"]
