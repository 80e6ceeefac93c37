"""A batch's layer launched from compiled code: the group kernels (batch_launch.py) through Taichi's C-API.

Why: through Taichi's Python path a batch's layer (its row scan, store, producer and reducer, run as one compiled
graph, with the inputs copied in and the output copied out) costs about half a millisecond of host time on CUDA,
more than the attention of 32 sequences at 32,768 keys takes on the device.  Here each kernel is one C call
(layer_launch.py does the same for one sequence's layer): the kernels were compiled ahead of time (aot.py) and
loaded into the process's C-API runtime, and each launch passes an argument array kept per layer and kernel,
patched only where a value changed since that layer's last launch (layer_launch.ArgumentArrays).

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

from . import aot, backend, capi
from .layer_launch import (MAX_IMPORTED, ArgumentArrays, _Imported, _StreamFence, deal, producer_lanes, runtime,
                           take_compiled)

# "auto" on CUDA: Taichi's Python path; launch="capi" opts in: on an H100 the same bits, cheaper at 1-8 sequences but
# dearer at 32 (docs/PERF.md, "A model's token and many sequences on CUDA")
AUTO_ON_CUDA = False


class CompiledGroups:
    """A batch launcher's group kernels through Taichi's C-API (CPU, CUDA).  Build with :meth:`create`."""

    def __init__(self, kernels: dict[str, tuple], spread: dict | None = None):
        arch = backend.active()
        self.rt = runtime(arch)
        path, self.compiled_now = aot.module_dir(arch, kernels)
        module = self.rt.load_module(path)
        # by the Python kernel's identity: the launcher's dispatches name kernels as the Python path does
        self._handles = {id(fn): self.rt.kernel(module, name) for name, (fn, _) in kernels.items()}
        self._kernels = [fn for fn, _ in kernels.values()]  # held, so the ids above stay theirs
        self.imported = _Imported(self.rt)
        self._packed = ArgumentArrays()
        self._launch = capi.library().ti_launch_kernel
        self._fence = _StreamFence() if arch == "cuda" else None
        # kernels whose items go to this thread and the lanes (the CPU's producers: layer_launch.ProducerLanes; the
        # module holds their serial variants only): id(parallel kernel) -> (this runtime's serial kernel, each
        # lane's, the launch's items from its arguments)
        self.lanes = producer_lanes(arch) if arch == "cpu" and spread else None
        lanes = self.lanes.lanes if self.lanes is not None else []
        lane_modules = [lane.rt.load_module(path) for lane in lanes]
        self._spread = {fn_id: (self.rt.kernel(module, serial), [lane.rt.kernel(m, serial)
                                                                 for lane, m in zip(lanes, lane_modules)], items_of)
                        for fn_id, (serial, items_of) in (spread or {}).items()}

    @classmethod
    def create(cls, kernels: dict[str, tuple], path: str, spread: dict | None = None) -> "CompiledGroups | None":
        """The compiled path where ``path`` ("auto" | "capi" | "python") asks for it and the C-API works here; None
        for Taichi's Python path: one engine's rule (layer_launch.take_compiled), "auto" on CUDA as AUTO_ON_CUDA
        says.  ``spread``: id(parallel kernel) -> (the name of its serial variant, which takes two more arguments,
        first and stride; its items as a function of its arguments), for the CPU's lanes."""
        return take_compiled(path, "a batch's layers", lambda: cls(kernels, spread), AUTO_ON_CUDA)

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
            spread = self._spread.get(id(kernel))
            if spread is not None:
                self._run_spread(key, j, spread, args)
                continue
            packed = self._packed((key, j, id(kernel)), args, len(args), self.imported, self.rt)
            launch(handle, self._handles[id(kernel)], len(args), packed)
        if fence is not None:
            fence.after()

    def _run_spread(self, key, j: int, spread: tuple, args) -> None:
        """A producer's items dealt round-robin to this thread and the lanes, each running the serial kernel on
        items i, i + threads, ... (the same work per item as the parallel kernel: the same bits)."""
        kernel, lane_kernels, items_of = spread
        lanes = self.lanes.lanes if self.lanes is not None else []
        threads = max(1, min(items_of(args), 1 + len(lanes)))
        n = len(args) + 2

        def packed_for(i: int, imported, rt):  # thread i's arguments, in its runtime: items i, i + threads, ...
            packed = self._packed((key, j, kernel, i), args, n, imported, rt)
            capi.set_i32(packed[n - 2], i)
            capi.set_i32(packed[n - 1], threads)
            return packed

        deal(self.lanes, threads,
             lambda i, lane: lane.start(lane_kernels[i - 1], packed_for(i, lane.imported, lane.rt)),
             lambda: self._launch(self.rt.handle, kernel, n, packed_for(0, self.imported, self.rt)))


__all__ = ["CompiledGroups"]
