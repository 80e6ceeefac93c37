"""llama.cpp's CUDA flash-attention kernel as a benchmark peer: the pinned ggml (v0.15.3), built for CUDA.

Not part of the ladder (the rung reads host planes; this reads device memory it owns) and not needed by
users or CI: ``muser-bench --arch cuda`` times it beside our kernels when ggml-python 0.0.45's package
holds a CUDA build of its vendored ggml (libggml-cuda.so beside libggml.so), which the lab's runner builds
on the GPU machine (scripts/lab/run.sh).  It attends one query of ``n_heads`` heads over ``n_keys`` f16
rows of ``n_kv_heads`` heads, as llama.cpp's graph does: ggml_flash_attn_ext with the F32 precision
llama.cpp sets on every attention node (llama-graph's build_attn_mha), no mask (the key count is a
multiple of 256, llama's padding), so ggml picks the kernel it would for this shape (the tensor-core
kernel at depth, the GQA heads packed as columns).
"""

from __future__ import annotations

import ctypes

import numpy as np

from .ggml import PINNED_GGML_PYTHON_VERSION as PINNED_GGML_PYTHON, load_pinned


def status() -> tuple[bool, str]:
    """(usable, description): is the pinned ggml importable with its CUDA backend and a device?"""
    try:
        g = load_pinned().ggml
    except Exception as exc:  # the pinned library itself is absent or not the pinned version
        return False, f"the pinned ggml is not loaded: {exc}"
    if not getattr(g, "GGML_USE_CUDA", False):
        return False, (f"ggml-python {PINNED_GGML_PYTHON} is not a CUDA build (no ggml_backend_cuda_init in its "
                       "libraries; scripts/lab/run.sh builds one on the GPU machine)")
    if g.ggml_backend_cuda_get_device_count() < 1:
        return False, "the CUDA build of ggml sees no device"
    return True, f"ggml-python {PINNED_GGML_PYTHON} (ggml {load_pinned().ggml_version}) CUDA backend"


class GgmlCudaAttn:
    """One decode attention on ggml's CUDA backend: load(k, v) once, then attend(q) any number of times."""

    def __init__(self, head_dim: int, n_heads: int, n_kv_heads: int, n_keys: int, scale: float):
        g = self._g = load_pinned().ggml
        if n_keys % 256:
            raise ValueError(f"n_keys {n_keys}: llama.cpp pads its attended cells to 256; give a multiple of 256")
        self.shape = (n_heads, head_dim)
        self._backend = g.ggml_backend_cuda_init(0)
        if not self._backend:
            raise RuntimeError("ggml_backend_cuda_init(0) failed")
        params = g.ggml_init_params(mem_size=16 * g.ggml_tensor_overhead() + g.ggml_graph_overhead(),
                                    mem_buffer=None, no_alloc=True)
        self._ctx = g.ggml_init(params)
        D, H, KV = head_dim, n_heads, n_kv_heads
        self._q = g.ggml_new_tensor_4d(self._ctx, g.GGML_TYPE_F32, D, 1, H, 1)  # [D, n_q, H, 1]
        self._k = g.ggml_new_tensor_4d(self._ctx, g.GGML_TYPE_F16, D, n_keys, KV, 1)  # head-major rows
        self._v = g.ggml_new_tensor_4d(self._ctx, g.GGML_TYPE_F16, D, n_keys, KV, 1)
        self._out = g.ggml_flash_attn_ext(self._ctx, self._q, self._k, self._v, None, scale, 0.0, 0.0)
        g.ggml_flash_attn_ext_set_prec(self._out, g.GGML_PREC_F32)
        self._graph = g.ggml_new_graph(self._ctx)
        g.ggml_build_forward_expand(self._graph, self._out)
        self._buffer = g.ggml_backend_alloc_ctx_tensors(self._ctx, self._backend)
        self._host_out = np.empty((H, D), np.float32)  # [DV, H, n_q] in ggml's order is C [H, D]

    def load(self, k: np.ndarray, v: np.ndarray) -> None:
        """K and V as float16 [n_kv_heads, n_keys, head_dim] (a head-major plane's rows)."""
        for t, a in ((self._k, k), (self._v, v)):
            a = np.ascontiguousarray(a, np.float16)
            self._g.ggml_backend_tensor_set(t, a.ctypes.data_as(ctypes.c_void_p), 0, a.nbytes)

    def attend(self, q: np.ndarray) -> np.ndarray:
        """q float32 [n_heads, head_dim] -> the attention output, like q (synchronous)."""
        g = self._g
        q = np.ascontiguousarray(q, np.float32)
        g.ggml_backend_tensor_set(self._q, q.ctypes.data_as(ctypes.c_void_p), 0, q.nbytes)
        self.compute()
        g.ggml_backend_tensor_get(self._out, self._host_out.ctypes.data_as(ctypes.c_void_p), 0, self._host_out.nbytes)
        return self._host_out.copy()

    def compute(self) -> None:
        """The graph alone on the device, to its completion (what a benchmark times)."""
        self._g.ggml_backend_graph_compute(self._backend, self._graph)

    def close(self) -> None:
        g = self._g
        if getattr(self, "_buffer", None):
            g.ggml_backend_buffer_free(self._buffer)
            self._buffer = None
        if getattr(self, "_ctx", None):
            g.ggml_free(self._ctx)
            self._ctx = None
        if getattr(self, "_backend", None):
            g.ggml_backend_free(self._backend)
            self._backend = None

    def __del__(self):
        self.close()


__all__ = ["GgmlCudaAttn", "status"]
