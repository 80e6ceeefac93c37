"""Host <-> device copies of the per-token arrays (q, k, v in; the attention output out).

Taichi's ``Ndarray.from_numpy`` / ``to_numpy`` each launch a copy kernel over a temporary device copy
of the numpy array and synchronise the device; a step made four of them (docs/PERF.md measures what
that cost).  On CUDA this module copies with the driver's ``cuMemcpyHtoD`` / ``cuMemcpyDtoH``
straight into the ndarray's own allocation: Taichi launches every kernel on the legacy default stream,
on which these synchronous copies are ordered after the kernels before them and before the kernels
after them.  On the CPU an ndarray is host memory and every launch returns when its kernel has run: a copy is a
memmove.  Where neither applies (Vulkan, Metal, CUDA without a context on this thread), it copies with
a Taichi kernel that takes the numpy array as an argument: Taichi stages such an array when it
launches the kernel and, for one the kernel writes, waits and reads it back before the call returns,
so no further synchronisation is needed (``from_numpy``/``to_numpy`` add one, an idle device wait that
cost up to a millisecond on NVIDIA's Vulkan driver, docs/PERF.md).
"""

import ctypes
import ctypes.util

import numpy as np
import taichi as ti

from . import backend
from .kernels.common import cached


class _CudaDriver:
    """The three driver calls used here, bound once; None when libcuda is absent or has no context."""

    def __init__(self, lib):
        self.htod = lib.cuMemcpyHtoD_v2
        self.htod.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        self.dtoh = lib.cuMemcpyDtoH_v2
        self.dtoh.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        self.dtod = lib.cuMemcpyDtoD_v2
        self.dtod.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t]
        self.current = lib.cuCtxGetCurrent
        self.current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]

    @classmethod
    def load(cls) -> "_CudaDriver | None":
        path = ctypes.util.find_library("cuda") or "libcuda.so.1"
        try:
            return cls(ctypes.CDLL(path))
        except (OSError, AttributeError):
            return None

    def has_context(self) -> bool:
        ctx = ctypes.c_void_p()
        return self.current(ctypes.byref(ctx)) == 0 and bool(ctx.value)


def _copy_kernel():
    """dst[...] = src[...] for any shape, either side a numpy array or an ndarray (one kernel per backend)."""

    def build():
        @ti.kernel
        def copy(src: ti.types.ndarray(), dst: ti.types.ndarray()):
            for I in ti.grouped(src):
                dst[I] = src[I]

        return copy

    return cached(("transfer_copy",), build)


HOST_DTYPES = {ti.f32: np.float32, ti.i32: np.int32}


class Transfer:
    """Uploads into and downloads from fixed f32 (or i32) ndarrays, by the fastest path the backend allows."""

    def __init__(self):
        self.arch = backend.active()
        self._driver = _CudaDriver.load() if self.arch == "cuda" else None
        self.waits = 0  # downloads so far: each waits for the device (what a step's host cost is made of)

    @property
    def path(self) -> str:
        """"cuMemcpy" where the driver copies directly, else "taichi" (a Taichi copy kernel)."""
        return "cuMemcpy" if self._driver is not None else "taichi"

    def _direct(self, dev) -> int:
        """The device address to copy to or from, or 0 to fall back (no context current on this thread).
        Asked of Taichi on every copy: a cache keyed by the array object could outlive the array."""
        if self._driver is None or not self._driver.has_context():
            return 0
        return int(ti.lang.impl.get_runtime().prog.get_ndarray_data_ptr_as_int(dev.arr))

    def _host(self, dev) -> int:
        """The CPU's: the address of the ndarray's host memory, or 0 on another backend."""
        if self.arch != "cpu":
            return 0
        return int(ti.lang.impl.get_runtime().prog.get_ndarray_data_ptr_as_int(dev.arr))

    @staticmethod
    def _host_dtype(dev, shape):
        # a raw copy of the wrong size would write past the allocation: refuse before copying
        if tuple(shape) != tuple(dev.shape) or dev.dtype not in HOST_DTYPES:
            raise ValueError(f"transfer: host shape {tuple(shape)} against a device array {tuple(dev.shape)} of "
                             f"{dev.dtype}; expected the same shape, float32 or int32")
        return HOST_DTYPES[dev.dtype]

    def upload(self, dev, a: np.ndarray) -> None:
        """dev[...] = a (converted to C-contiguous dev's dtype), for an array of dev's shape."""
        a = np.ascontiguousarray(a, dtype=self._host_dtype(dev, a.shape))
        host = self._host(dev)
        if host:
            ctypes.memmove(host, a.ctypes.data, a.nbytes)
            return
        addr = self._direct(dev)
        if addr and self._driver.htod(addr, a.ctypes.data, a.nbytes) == 0:
            return
        _copy_kernel()(a, dev)

    def device_copy(self, dst: int, src: int, nbytes: int) -> bool:
        """dst <- src, two device addresses (a torch CUDA tensor's, an ndarray's: ``address``), on the legacy default
        stream that Taichi's kernels and torch's default stream share; False where there is no driver to do it."""
        return bool(self._driver is not None and self._driver.has_context() and self._driver.dtod(dst, src, nbytes) == 0)

    @staticmethod
    def address(dev) -> int:
        """The device address of a Taichi ndarray's allocation (CUDA)."""
        return int(ti.lang.impl.get_runtime().prog.get_ndarray_data_ptr_as_int(dev.arr))

    def download(self, dev, shape: tuple[int, ...]) -> np.ndarray:
        """A new host array (float32 or int32, as dev) holding dev."""
        out = np.empty(shape, self._host_dtype(dev, shape))
        self.waits += 1
        host = self._host(dev)
        if host:
            ctypes.memmove(out.ctypes.data, host, out.nbytes)
            return out
        addr = self._direct(dev)
        if addr and self._driver.dtoh(out.ctypes.data, addr, out.nbytes) == 0:
            return out
        _copy_kernel()(dev, out)  # returns once the host array holds the result
        return out


__all__ = ["Transfer"]
