"""The arrays a model holds, as the engine takes them: numpy, torch, mlx and Taichi.

A model's forward hands the engine one layer's q, k and v in whatever its framework keeps them in, and
takes the output back in the same kind.  The engine computes in float32 and stores K/V as f16; what a
caller passes is converted once on the way in and once on the way out, and never where it need not be:

* numpy float32 (C-contiguous) is used in place; float16, float64 and bfloat16 (ml_dtypes, where the caller
  has it) are converted;
* torch: a CPU tensor is viewed through numpy (float32 contiguous: no copy); on arch="cuda" a CUDA tensor is
  passed to the kernels as it is (Taichi takes a contiguous torch CUDA tensor as an ndarray argument), and
  the output is a torch CUDA tensor the kernels write: zero-copy both ways;
* mlx: an mlx array on the CPU is read through the buffer protocol (float32: no copy; other dtypes: one
  conversion in mlx), and the output goes back as one copy into a new mlx array;
* Taichi ndarrays: on a GPU arch passed to the kernels as they are; on the CPU copied to the host.

No framework is imported here unless the caller's array comes from it.
"""

from __future__ import annotations

import numpy as np

from .errors import EngineError

HOST_DTYPES = ("float32", "float16", "float64", "bfloat16")
_NUMPY_FLOATS = frozenset(np.dtype(name) for name in HOST_DTYPES[:3])  # a set lookup: dtype.name costs ~4 us a call


def _host_dtype(dtype) -> bool:
    return dtype in _NUMPY_FLOATS or dtype.name in HOST_DTYPES


def framework_of(x) -> str:
    """"numpy" | "torch" | "mlx" | "taichi", or EngineError for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    module = type(x).__module__ or ""
    if module.startswith("torch"):
        return "torch"
    if module.startswith("mlx"):
        return "mlx"
    if module.startswith("taichi"):
        return "taichi"
    raise EngineError(f"expected a numpy array, a torch tensor, an mlx array or a Taichi ndarray, got {type(x).__name__}")


def to_host(name: str, x) -> np.ndarray:
    """``x`` as a C-contiguous float32 numpy array, copied only where its dtype, place or layout needs it."""
    kind = framework_of(x)
    if kind == "torch":
        t = x.detach()
        if t.is_cuda or t.device.type != "cpu":
            t = t.cpu()
        if not t.is_floating_point():
            raise EngineError(f"{name}: dtype {t.dtype}, expected a floating dtype (float32, float16, bfloat16)")
        x = t.float().contiguous().numpy()
    elif kind == "mlx":
        import mlx.core as mx

        if not mx.issubdtype(x.dtype, mx.floating):
            raise EngineError(f"{name}: dtype {x.dtype}, expected a floating dtype (float32, float16, bfloat16)")
        if x.dtype != mx.float32:
            x = x.astype(mx.float32)
        x = np.asarray(x)  # the buffer protocol: the array's own memory
    elif kind == "taichi":
        x = x.to_numpy()
    if isinstance(x, np.ma.MaskedArray):
        raise EngineError(f"{name}: a masked array (its mask would be ignored)")
    if not _host_dtype(x.dtype):
        raise EngineError(f"{name}: dtype {x.dtype}, expected one of {', '.join(HOST_DTYPES)}")
    return np.ascontiguousarray(x, dtype=np.float32)


def device_resident(x, arch: str) -> bool:
    """Can the kernels read ``x`` where it is: a torch CUDA tensor on arch="cuda", or a Taichi ndarray on a GPU arch."""
    kind = framework_of(x)
    if kind == "torch":
        return arch == "cuda" and x.is_cuda
    return kind == "taichi" and arch != "cpu"


def device_f32(name: str, x):
    """A device-resident array as the kernels read it: float32 and contiguous (torch converts on the device)."""
    if framework_of(x) == "torch":
        if not x.is_floating_point():
            raise EngineError(f"{name}: dtype {x.dtype}, expected a floating dtype")
        return x.detach().float().contiguous()
    import taichi as ti

    if x.dtype != ti.f32:
        raise EngineError(f"{name}: a Taichi ndarray of {x.dtype}, expected float32")
    return x


def device_out(like, shape: tuple[int, ...]):
    """An output array on the device of ``like`` (a device-resident input), for the kernels to write."""
    if framework_of(like) == "torch":
        import torch

        return torch.empty(shape, dtype=torch.float32, device=like.device)
    import taichi as ti

    return ti.ndarray(ti.f32, shape)


def like_input(out: np.ndarray, like):
    """The host result ``out`` in the kind the caller passed (``like``): numpy as it is, a torch tensor on
    ``like``'s device, an mlx array, or a Taichi ndarray."""
    kind = framework_of(like)
    if kind == "numpy":
        return out
    if kind == "torch":
        import torch

        t = torch.from_numpy(out)
        return t if like.device.type == "cpu" else t.to(like.device)
    if kind == "mlx":
        import mlx.core as mx

        return mx.array(out)
    import taichi as ti

    arr = ti.ndarray(ti.f32, out.shape)
    arr.from_numpy(out)
    return arr


class Stager:
    """A caller's arrays copied, converted to float32, into fixed host arrays that compiled kernels read in place
    (layer_launch.py: a layer's staging arrays, imported into Taichi's C-API once).  ``views``: float32 C-contiguous
    arrays [1, ...] (q, k, v, out).  One copy per array, whatever its kind: numpy (any HOST_DTYPES), a CPU torch tensor
    numpy can read through its numpy view, other torch tensors (bfloat16, another device) by torch's copy, which
    converts while it copies, mlx and Taichi through to_host."""

    def __init__(self, views):
        self.views = views
        self._torch = None  # torch views of the same memory, made when a torch tensor first comes

    @staticmethod
    def source(where: str, name: str, x, shape: tuple[int, ...]):
        """``x`` as this call's source for ``name``: an array of ``shape`` ([n, heads, d]) or, for one token, of
        shape[1:]; a shape or dtype it cannot take raises EngineError naming ``where`` and ``name``."""
        kind = framework_of(x)
        if kind == "torch":
            t = x.detach()
            if not t.is_floating_point():
                raise EngineError(f"{where} {name}: dtype {t.dtype}, expected a floating dtype (float32, float16, "
                                  f"bfloat16)")
            try:  # a CPU tensor numpy can read (not bfloat16): its numpy view, which copies in a third of torch's time
                x, kind = t.numpy(), "numpy"
            except (TypeError, RuntimeError):
                got = tuple(t.shape)
        if kind == "numpy":
            if isinstance(x, np.ma.MaskedArray):
                raise EngineError(f"{where} {name}: a masked array (its mask would be ignored)")
            if not _host_dtype(x.dtype):
                raise EngineError(f"{where} {name}: dtype {x.dtype}, expected one of {', '.join(HOST_DTYPES)}")
            t, got = x, x.shape
        elif kind != "torch":
            t = to_host(f"{where} {name}", x)
            got = t.shape
        if len(got) == len(shape) - 1 and shape[0] == 1:  # one token without its axis
            t, got = t[None], (1, *got)
        if got != shape:
            raise EngineError(f"{where} {name}: shape {got}, expected {shape}")
        return t

    def put(self, i: int, src, row: int) -> None:
        """Token ``row`` of a source (``source``) into staging array i."""
        if isinstance(src, np.ndarray):
            np.copyto(self.views[i][0], src[row], casting="unsafe")
            return
        if self._torch is None:
            import torch

            self._torch = [torch.from_numpy(v) for v in self.views]
        self._torch[i][0].copy_(src[row])

    def out(self) -> np.ndarray:
        """The staged output, [heads, d] (a view: copy it before the next launch)."""
        return self.views[3][0]


__all__ = ["Stager", "device_f32", "device_out", "device_resident", "framework_of", "like_input", "to_host"]
