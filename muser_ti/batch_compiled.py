"""A batch's layer launched from compiled code: the group kernels (batch_launch.py) through Taichi's C-API.

Why: through Taichi's Python path a batch's layer (its row scan, store, producer and reducer, run as one compiled
graph, with the inputs copied in and the output copied out) costs about half a millisecond of host time on CUDA,
more than the attention of 32 sequences at 32,768 keys takes on the device.  Here each kernel is one C call
(layer_launch.py does the same for one sequence's layer): the kernels were compiled ahead of time (aot.py) and
loaded into the process's C-API runtime, and each launch passes an argument array kept per layer and kernel,
patched only where a value changed since that layer's last launch.

The launches are the Python path's: ``BatchLauncher.dispatches`` makes the (kernel, arguments) list either path
runs, so the bits are the same (tests/test_batch.py holds the two to each other).  Each argument is set by its
kind: a Taichi ndarray (the pool's planes, the launcher's tables and scratch) imported once by address; a torch
CUDA tensor (the model's q, k, v, and the output the batch returns) imported where it lies, so a step on CUDA
copies nothing (up to ``layer_launch.MAX_IMPORTED`` addresses: then the launcher copies into its own arrays, as
the Python path does); an int as i32, a float as f32.

Ordering on CUDA is layer_launch's: the launches go on the legacy default stream, which Taichi's launcher copies
their arguments on, fenced with events both ways where the caller's current torch stream is another.
"""

from __future__ import annotations

import taichi as ti

from . import aot, backend, capi
from .layer_launch import MAX_IMPORTED, _Imported, _StreamFence, runtime, take_compiled

_UNSET = object()
# "auto" on CUDA: Taichi's Python path, where every CUDA figure of the batch so far ran (one engine's rule too);
# launch="capi" opts in.  This path on CUDA is written and its tests are in test_batch.py, but it has not yet run on
# a GPU (no device was lent when it was written): turn this on only after they pass there and it measures cheaper
AUTO_ON_CUDA = False


class CompiledGroups:
    """A batch launcher's group kernels through Taichi's C-API (CPU, CUDA).  Build with :meth:`create`."""

    def __init__(self, kernels: dict[str, tuple]):
        arch = backend.active()
        self.rt = runtime(arch)
        path, self.compiled_now = aot.module_dir(arch, kernels)
        module = self.rt.load_module(path)
        # by the Python kernel's identity: the launcher's dispatches name kernels as the Python path does
        self._handles = {id(fn): self.rt.kernel(module, name) for name, (fn, _) in kernels.items()}
        self._kernels = [fn for fn, _ in kernels.values()]  # held, so the ids above stay theirs
        self.imported = _Imported(self.rt)
        self._args: dict[tuple, tuple] = {}
        self._launch = capi.library().ti_launch_kernel
        self._fence = _StreamFence() if arch == "cuda" else None

    @classmethod
    def create(cls, kernels: dict[str, tuple], path: str) -> "CompiledGroups | None":
        """The compiled path where ``path`` ("auto" | "capi" | "python") asks for it and the C-API works here; None
        for Taichi's Python path: one engine's rule (layer_launch.take_compiled), "auto" on CUDA as AUTO_ON_CUDA
        says."""
        return take_compiled(path, "a batch's layers", lambda: cls(kernels), AUTO_ON_CUDA)

    def can_import(self) -> bool:
        """Whether a caller's device tensors are still imported where they lie (layer_launch.MAX_IMPORTED)."""
        return self.rt.imported <= MAX_IMPORTED

    def run(self, key, dispatches) -> None:
        """Launch ``dispatches`` ((kernel, args) each) in order; ``key`` names the call site (a layer), whose
        argument arrays are kept and patched where an argument changed."""
        fence = self._fence
        if fence is not None:
            fence.before()
        launch, handle = self._launch, self.rt.handle
        for j, (kernel, args) in enumerate(dispatches):
            entry = self._args.get((key, j, id(kernel)))
            if entry is None:
                entry = self._args[key, j, id(kernel)] = (capi.arguments(len(args)), [_UNSET] * len(args))
            packed, held = entry
            for i, a in enumerate(args):
                h = held[i]
                if h is a:
                    continue
                kind = type(a)
                if kind is int:
                    if type(h) is not int or h != a:
                        capi.set_i32(packed[i], a)
                        held[i] = a
                elif kind is float:
                    if type(h) is not float or h != a:
                        capi.set_f32(packed[i], a)
                        held[i] = a
                elif isinstance(a, ti.Ndarray):
                    capi.set_ndarray(packed[i], *self.imported(a))
                    held[i] = a
                else:  # a torch CUDA tensor, float32 and contiguous: by address, never held (its memory is torch's)
                    where = (a.data_ptr(), tuple(a.shape))
                    if h != where:
                        capi.set_ndarray(packed[i], self.rt.memory(where[0], a.numel() * 4), where[1], "f32")
                        held[i] = where
            launch(handle, self._handles[id(kernel)], len(args), packed)
        if fence is not None:
            fence.after()


__all__ = ["CompiledGroups"]
