"""One layer of a per-layer token (token.py) launched from compiled code: Taichi's C-API.

A model calls the engine once a layer, 52 times a token for Glimmer.  Through Taichi's Python launch path each
of a layer's kernels costs tens of microseconds of host time; here a layer is one kernel (kernels/layer_kernel.py:
the token scan, the store, the producer and the merge folded into one launch), compiled ahead of time (aot.py),
loaded into a C-API runtime (capi.py), and launched with one C call on an argument array built once per layer and
patched in place: the token's position, the plane's origins, the split.

Memory: the planes and the engine's scratch are the Python runtime's arrays, imported once by address (the
CPU's host memory; on CUDA, device memory of the primary context both runtimes share).  The caller's arrays:
on the CPU they are copied (converted where their dtype is not float32) into the layer's staging arrays, a few
kilobytes, imported once: importing each new array would grow the C-API's table of allocations for ever, since
Taichi 1.7.4 cannot free an imported CPU allocation.  On CUDA a float32 contiguous tensor is imported where it
lies (a framework's caching allocator hands out the same few addresses token after token) up to
``MAX_IMPORTED`` addresses, then copied into the staging arrays on the device.

The CPU: at short context every part of the layer on the calling thread, one launch
(split_geometry.cpu_serial); deeper, three: the scan and store, then the producer's work items dealt round-robin
to the calling thread and ProducerLanes (threads of the engine's own, each with a C-API runtime of its own, since
Taichi's thread pool wakes its workers late on a small VM), then the merge; without lanes (one core) one launch.
Each item is the same code every way: the same bits.

Checks: the scan runs first, and the layer's writes (the plane's row, ``out``) wait on its flags: a flagged layer
writes nothing.  On the CPU the host reads the flags' summary after the launch and names the value; on CUDA it
reads them once, when the token commits (token.py), and a flagged layer abandons the token.

Ordering on CUDA: Taichi 1.7.4's launcher copies each launch's arguments with an asynchronous copy on the
legacy default stream.  The kernels therefore go on that stream too (``ti_set_cuda_stream(0)``); where the
caller's current stream is another, the launches are fenced with events both ways (the caller's stream's work
before them, theirs before the caller's next), so the engine orders with the model's own kernels without a
host synchronisation.  CUDA-graph capture is refused (:func:`refuse_capture` says why).

Same bits as the Python path: the folded kernel runs the ti.funcs of the Python path's four kernels (compiled by
the same LLVM) on the same split geometry (launch.Launcher.split_geometry); tests/test_layer_launch.py holds the two
paths to each other.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
import weakref

import numpy as np
import taichi as ti

from . import aot, arrays, backend, capi, ladder
from .config import NOPE, SWA
from .errors import EngineError
from .kernels.layer_kernel import (LAYER_ALL, LAYER_ARGS, LAYER_PRODUCE, LAYER_REDUCE, LAYER_SCAN, LAYER_STORE,
                                   ROUTE_LAYOUTS, build_layer_kernels)
from .kernels.producer import plan_key
from .kernels.token_scan import TOKEN_FLAGS
from .kv_cache import LAYOUT_OF
from .launch import host_view
from .planes import visible_span, window_of

LAUNCH_PATHS = ("auto", "capi", "python")
MAX_IMPORTED = 4096  # distinct caller addresses imported on CUDA before copies take over (capi.Runtime says why)
# A layer's producer has n_kv_heads x nwg work items at the split step() gives it: 2 to 4 for Glimmer (2 KV heads,
# at most 2 workgroups a pair at 13 layers a launch), so more threads than 4 would find nothing to do.
MAX_PRODUCER_THREADS = 4
# the folded layer kernel's arguments by index (kernels/layer_kernel.py's signature)
(_Q, _K, _V, _OUT, _FLAGS, _STAMP, _PARTS, _K_PLANE, _V_PLANE, _PARTIALS, _VISITS, _LAYERS, _SLOTS, _POSITION, _WINDOW,
 _CAPACITY, _ORIGIN_LOGICAL, _ORIGIN_PHYSICAL, _NWG, _NSG, _SCALE, _FIRST, _STRIDE) = range(LAYER_ARGS)
_IO = (_Q, _K, _V, _OUT)
_SCALAR_RUNS = ((_STAMP, _PARTS + 1), (_POSITION, _STRIDE + 1))  # the scalars, as runs of consecutive arguments


class ScanRefused(Exception):
    """The CPU's scan flagged a layer's arrays: raised before any of the layer's writes (Token names the value)."""


class CaptureRefused(EngineError):
    """A per-layer token launched while a CUDA graph is being captured."""


CAPTURE_REASON = (
    "the engine's per-layer attention cannot be captured in a CUDA graph: Taichi 1.7.4's kernel launcher "
    "allocates, fills and frees a device argument buffer around every launch, outside the capture, and the "
    "captured kernel keeps that freed buffer's address, so a replay would read whatever last reused it; run "
    "the engine's layers eagerly (outside torch.cuda.graph / torch.compile's CUDA graphs)")


def _address(arr) -> int:
    return int(ti.lang.impl.get_runtime().prog.get_ndarray_data_ptr_as_int(arr.arr))


_NP_OF = {ti.f32: (np.float32, "f32"), ti.i32: (np.int32, "i32"), ti.u32: (np.uint32, "u32")}


class _Imported:
    """The Python runtime's arrays as the C-API sees them: (TiMemory, shape, dtype name) by array, made once.
    An array is not kept alive here (a weak reference tells a live array from a new one given a dead one's id):
    a plane that grew leaves its old allocation to be freed, not held for the process's life."""

    def __init__(self, rt: capi.Runtime):
        self.rt = rt
        self._by_id: dict[int, tuple] = {}

    def __call__(self, arr) -> tuple:
        hit = self._by_id.get(id(arr))
        if hit is not None and hit[0]() is arr:
            return hit[1]
        np_dtype, name = _NP_OF[arr.dtype]
        shape = tuple(arr.shape)
        mem = self.rt.memory(_address(arr), int(np.prod(shape)) * np.dtype(np_dtype).itemsize)
        self._by_id[id(arr)] = (weakref.ref(arr, lambda _, key=id(arr): self._forget(key)), (mem, shape, name))
        return mem, shape, name

    def _forget(self, key: int) -> None:
        hit = self._by_id.get(key)
        if hit is not None and hit[0]() is None:
            del self._by_id[key]


_UNSET = object()


class ArgumentArrays:
    """Argument arrays kept by call site, each patched where an argument changed since that site's last launch:
    an int as i32, a float as f32, a Taichi ndarray imported once by address (held by a weak reference: a plane
    that grew is freed, not kept for the site's next launch), a torch CUDA tensor (float32, contiguous) by its
    address, never held (its memory is torch's)."""

    def __init__(self):
        self._args: dict[tuple, tuple] = {}

    def __call__(self, where: tuple, args, n: int, imported, rt):
        """The argument array kept for ``where`` (n slots, at least len(args)), patched to ``args``; ``imported``
        and ``rt``: the runtime the array is for (the process's, or a lane's)."""
        entry = self._args.get(where)
        if entry is None:
            entry = self._args[where] = (capi.arguments(n), [_UNSET] * len(args))
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
                if type(h) is not weakref.ref or h() is not a:
                    capi.set_ndarray(packed[i], *imported(a))
                    held[i] = weakref.ref(a)
            else:
                where_ = (a.data_ptr(), tuple(a.shape))
                if h != where_:
                    capi.set_ndarray(packed[i], rt.memory(where_[0], a.numel() * 4), where_[1], "f32")
                    held[i] = where_
        return packed


class CompiledLayers:
    """A launcher's per-layer kernels through Taichi's C-API (CPU, CUDA).  Build with :meth:`create`."""

    def __init__(self, launcher):
        self.launcher, self.cfg, self.cache = launcher, launcher.cfg, launcher.cache
        self.arch = backend.active()
        self.gpu = launcher.gpu
        cfg = self.cfg
        self.rt = runtime(self.arch)
        kernels = self._kernels(launcher)
        path, self.compiled = aot.module_dir(self.arch, kernels)
        module = self.rt.load_module(path)
        self.k = {name: self.rt.kernel(module, name) for name in kernels}
        self.imported = _Imported(self.rt)
        self._packed = ArgumentArrays()  # the kept rows' copies (copy_rows)
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.shapes = {"q": (1, H, D), "k": (1, KV, D), "v": (1, KV, D), "out": (1, H, D)}
        # the layer's staging arrays: the Python runtime's, imported once (the CPU reads and writes them through
        # numpy views)
        self.staging = launcher.layer_device_arrays()
        self.stager = arrays.Stager(launcher._layer_views) if not self.gpu else None
        self._staged = tuple(self.imported(a) for a in self.staging)
        self._args: dict[int, dict] = {}
        self._lib = capi.library()
        self._launch = self._lib.ti_launch_kernel
        self._handle = self.rt.handle
        self._stream_fence = _StreamFence() if self.arch == "cuda" else None
        # the CPU's producer on threads of its own at depth (ProducerLanes); None on CUDA or a 1-core machine
        self.lanes = producer_lanes(self.arch) if not self.gpu else None
        self._lane_kernels = []
        if self.lanes is not None:
            for lane in self.lanes.lanes:
                lane_module = lane.rt.load_module(path)
                self._lane_kernels.append({name: lane.rt.kernel(lane_module, name) for name in ROUTE_LAYOUTS})
        # the CPU's launches return when their kernel has run: the flags' summary is read at once, so a refused
        # layer writes nothing and its refusal names the value (the host checks its arrays only then)
        self._summary = None if self.gpu else host_view(launcher.checks.flags)[:TOKEN_FLAGS]

    @classmethod
    def create(cls, launcher, path: str):
        """The compiled path for ``launcher`` where ``path`` asks for it and the C-API works here (take_compiled);
        None for the Python path.  On CUDA "auto" takes the Python path: there the C-API path gives the Python
        path's bits on an H100 (test_layer_launch), but a whole model's token measured no cheaper on it
        (docs/PERF.md's CUDA section) and its host cost per layer is unmeasured, so the default stays on the path
        every CUDA figure ran on; launch="capi" opts in."""
        return take_compiled(path, "per-layer attention", lambda: cls(launcher))

    @staticmethod
    def _kernels(launcher) -> dict[str, tuple]:
        """The per-layer kernels by name, each with the key its build depends on (aot.module_key): one a route, the
        layer folded into one launch (kernels/layer_kernel.py)."""
        cfg, gpu = launcher.cfg, launcher.gpu
        geometry = (cfg.head_dim, cfg.heads_per_kv, cfg.n_kv_heads, cfg.n_heads, gpu, launcher.items_cap,
                    repr(plan_key(cfg.head_dim, cfg.heads_per_kv, gpu)))
        kernels = build_layer_kernels(cfg.head_dim, cfg.heads_per_kv, cfg.n_kv_heads, cfg.n_heads, gpu,
                                      launcher.items_cap)
        out = {route: (kernel, ("layer_kernel", route, geometry)) for route, kernel in kernels.items()}
        for kind, stores in launcher.cache.stores.items():  # what a token overwrites, kept at its open (token.py)
            out[f"save_{kind}"] = (stores.save_rows, ("save_rows", LAYOUT_OF[kind], geometry))
            out[f"restore_{kind}"] = (stores.restore_rows, ("restore_rows", LAYOUT_OF[kind], geometry))
        return out

    # ---- per layer -------------------------------------------------------------------------------
    def _layer_args(self, layer: int) -> dict:
        """The layer's argument array, the parts that never change filled in (its layer table, the flags, the
        scale, the window)."""
        args = self._args.get(layer)
        if args is not None:
            return args
        launcher, cache, cfg = self.launcher, self.cache, self.cfg
        kind = cfg.layer_kinds[layer]
        grp = cache.token_group(layer)
        imp = self.imported
        a = {"args": capi.arguments(LAYER_ARGS), "kind": kind, "plane": None, "partials": None, "io": None,
             # the arrays by argument index (the CPU's q, k, v, out staged), for the lanes' own imports
             "objs": dict(zip(_IO, self.staging)), "lanes": {}}
        x = a["args"]
        for i, arr in ((_FLAGS, launcher.checks.flags), (_VISITS, launcher._no_visits), (_LAYERS, grp.layers_dev),
                       (_SLOTS, grp.slots_dev)):
            capi.set_ndarray(x[i], *imp(arr))
            a["objs"][i] = arr
        capi.set_i32(x[_WINDOW], window_of(cfg, kind))
        capi.set_f32(x[_SCALE], cfg.attention_scale)
        self._args[layer] = a
        return a

    def _set_io(self, a: dict, io: tuple) -> None:
        """q, k, v, out (TiMemory, shape, dtype) into the layer's arguments."""
        if a["io"] == io:
            return
        for i, m in zip(_IO, io):
            capi.set_ndarray(a["args"][i], *m)
        a["io"] = io

    def attend(self, plan, layer: int, route_sizes, io: tuple, stamp: int) -> int:
        """Launch ``layer`` of the planned token on ``io`` = (q, k, v, out) as (TiMemory, shape, dtype): one launch
        of the route's folded kernel (three where the CPU deals the producer's items to its lanes); returns the
        launches made.  On the CPU a layer the scan flags raises ScanRefused, having written nothing."""
        p, new_states, routes, _ = plan
        route = routes[layer]
        if route not in (ladder.SPLITK, ladder.INTERLEAVED):
            raise EngineError(f"layer {layer}: route {route} reads host arrays (Launcher.attend_layer_host)")
        a = self._layer_args(layer)
        kind = a["kind"]
        st, cache, launcher = new_states[kind], self.cache, self.launcher
        self._set_io(a, io)
        x = a["args"]
        planes = (cache.k[kind], cache.v[kind])
        if a["plane"] is None or a["plane"][0] is not planes[0] or a["plane"][1] is not planes[1]:
            for i, plane in zip((_K_PLANE, _V_PLANE), planes):
                capi.set_ndarray(x[i], *self.imported(plane))
                a["objs"][i] = plane
            a["plane"] = planes
        _, visible = visible_span(self.cfg, kind, p)
        nwg, nsg = launcher.split_geometry(visible, route_sizes[route])
        partials = launcher.partials_for(kind, 1, nwg)
        if a["partials"] is not partials:
            capi.set_ndarray(x[_PARTIALS], *self.imported(partials))
            a["partials"] = a["objs"][_PARTIALS] = partials
        x[_STAMP].value.i32 = stamp
        x[_POSITION].value.i32 = p
        x[_CAPACITY].value.i32 = st.capacity
        x[_ORIGIN_LOGICAL].value.i32 = st.origin_logical
        x[_ORIGIN_PHYSICAL].value.i32 = st.origin_physical
        x[_NWG].value.i32 = nwg
        x[_NSG].value.i32 = nsg
        kernel = self.k[route]
        fence = self._stream_fence
        if fence is not None:
            fence.before()
            self._launch(self._handle, kernel, LAYER_ARGS, x)
            fence.after()
            return 1
        if self.lanes is None or launcher.serial_layer(visible):  # every part on this thread
            self._run_parts(x, kernel, LAYER_ALL, 0, 1, stamp)
            return 1
        # the lanes must not read a ring's new row before it is stored: scan and store first, then the items dealt
        # to this thread and the lanes, then the merge once every item is done
        self._run_parts(x, kernel, LAYER_SCAN | LAYER_STORE, 0, 1, stamp)
        threads = min(self.cfg.n_kv_heads * nwg, 1 + len(self.lanes.lanes))

        def start(i, lane):
            args = self._lane_args(a, i - 1, lane)
            args[_FIRST].value.i32, args[_STRIDE].value.i32 = i, threads
            lane.start(self._lane_kernels[i - 1][route], args)

        x[_PARTS].value.i32 = LAYER_PRODUCE
        x[_FIRST].value.i32, x[_STRIDE].value.i32 = 0, threads
        deal(self.lanes, threads, start, lambda: self._launch(self._handle, kernel, LAYER_ARGS, x))
        self._run_parts(x, kernel, LAYER_REDUCE, 0, 1, stamp)
        return 3

    def _run_parts(self, x, kernel, parts: int, first: int, stride: int, stamp: int) -> None:
        """One launch of ``parts`` of the layer on this thread; ScanRefused where its scan flagged the layer."""
        x[_PARTS].value.i32 = parts
        x[_FIRST].value.i32, x[_STRIDE].value.i32 = first, stride
        self._launch(self._handle, kernel, LAYER_ARGS, x)
        if parts & LAYER_SCAN and self._summary.max() == stamp:
            raise ScanRefused(stamp)

    def _lane_args(self, a: dict, i: int, lane) -> ctypes.Array:
        """Lane i's arguments for the layer of ``a``: its own imports of the layer's arrays (a runtime's memory is
        its own), the scalars copied from this thread's."""
        held = a["lanes"].get(i)
        if held is None:
            held = a["lanes"][i] = (capi.arguments(LAYER_ARGS), {})
        args, seen = held
        for j, obj in a["objs"].items():
            if seen.get(j) is not obj:
                capi.set_ndarray(args[j], *lane.imported(obj))
                seen[j] = obj
        size, base, mine = ctypes.sizeof(capi.Argument), ctypes.addressof(args), ctypes.addressof(a["args"])
        for first, last in _SCALAR_RUNS:
            ctypes.memmove(base + first * size, mine + first * size, (last - first) * size)
        return args

    def copy_rows(self, op: str, kind: str, which: str, args: tuple) -> None:
        """The rows a token overwrites, kept at its open (``op`` "save") or put back at an abandon ("restore"), of
        plane ``which`` ("k", "v"): the class's stores.save_rows / restore_rows on ``args``, one C call (through
        Taichi's Python path each cost ~0.5 ms on the CPU)."""
        name = f"{op}_{kind}"
        self._launch(self._handle, self.k[name], len(args),
                     self._packed((name, which), args, len(args), self.imported, self.rt))

    # ---- the caller's arrays -----------------------------------------------------------------------
    def staged(self) -> tuple:
        """(q, k, v, out) staging arrays as (TiMemory, shape, dtype)."""
        return self._staged

    def put(self, i: int, src, row: int) -> None:
        """Token ``row`` of a host source (arrays.Stager.source) into staging array i (q, k, v)."""
        if not self.gpu:
            self.stager.put(i, src, row)
            return
        one = src[row]
        one = one.detach().cpu().float().numpy() if not isinstance(one, np.ndarray) else one
        self.launcher.transfer.upload(self.staging[i], np.asarray(one, np.float32)[None])

    def get_out(self, dst: np.ndarray) -> None:
        """The staged output into ``dst`` [heads, d] (the host waits for the layer's kernels)."""
        if not self.gpu:
            np.copyto(dst, self.stager.out())
            return
        dst[...] = self.launcher.transfer.download(self.staging[3], self.shapes["out"])[0]

    def device_io(self, q, k, v, out) -> tuple | None:
        """Device arrays (torch CUDA tensors, float32 contiguous, or Taichi ndarrays) as (TiMemory, shape, dtype),
        imported where they lie; None once MAX_IMPORTED addresses have been imported (the caller goes through the
        staging arrays: stage_device, unstage_device)."""
        rt = self.rt
        if rt.imported > MAX_IMPORTED:
            return None
        io = []
        for a in (q, k, v, out):
            address = a.data_ptr() if not isinstance(a, ti.Ndarray) else _address(a)
            shape = tuple(a.shape)
            io.append((rt.memory(address, int(np.prod(shape)) * 4), shape, "f32"))
        return tuple(io)

    def _device_address(self, a) -> int:
        return a.data_ptr() if not isinstance(a, ti.Ndarray) else _address(a)

    def stage_device(self, arrays3) -> None:
        """Device q, k, v copied into the staging arrays (device to device, on the legacy default stream)."""
        t = self.launcher.transfer
        for dev, a in zip(self.staging, arrays3):
            if not t.device_copy(_address(dev), self._device_address(a), int(np.prod(tuple(a.shape))) * 4):
                raise EngineError("the CUDA driver could not copy a layer's arrays into the engine's staging arrays")

    def unstage_device(self, out) -> None:
        t = self.launcher.transfer
        if not t.device_copy(self._device_address(out), _address(self.staging[3]), int(np.prod(tuple(out.shape))) * 4):
            raise EngineError("the CUDA driver could not copy a layer's output out of the engine's staging arrays")


class _StreamFence:
    """Orders the C-API's launches (on the legacy default stream, as Taichi's launcher copies their arguments
    there) with the caller's current torch stream, where that is another: events both ways."""

    def __init__(self):
        import ctypes.util

        lib = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
        self._record, self._wait = lib.cuEventRecord, lib.cuStreamWaitEvent
        self._record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        create = lib.cuEventCreate
        create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self._events = []
        for _ in range(2):
            ev = ctypes.c_void_p()
            if create(ctypes.byref(ev), 2) != 0:  # CU_EVENT_DISABLE_TIMING
                raise capi.CApiError("cuEventCreate failed")
            self._events.append(ev)
        self._stream = None
        capi.library().ti_set_cuda_stream(None)

    def current(self) -> int:
        try:
            import torch
        except ImportError:
            return 0
        refuse_capture(torch)
        return int(torch.cuda.current_stream().cuda_stream) if torch.cuda.is_initialized() else 0

    def before(self) -> None:
        stream = self._stream = self.current()
        if stream:
            self._record(self._events[0], stream)
            self._wait(None, self._events[0], 0)

    def after(self) -> None:
        if self._stream:
            self._record(self._events[1], None)
            self._wait(self._stream, self._events[1], 0)


class _Lane:
    """A thread of the CPU producer's besides the caller's, with a C-API runtime of its own (no runtime is shared
    between threads): it runs the launch it is handed and says when it is done."""

    def __init__(self, arch: str, index: int):
        self.rt = capi.Runtime(arch)
        self.imported = _Imported(self.rt)
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._job = None
        threading.Thread(target=self._serve, name=f"muser-ti producer lane {index}", daemon=True).start()

    def _serve(self) -> None:
        launch = capi.library().ti_launch_kernel
        while True:
            self._go.acquire()
            kernel, args = self._job
            launch(self.rt.handle, kernel, len(args), args)  # ctypes lets the GIL go for the call
            self._done.release()

    def start(self, kernel: int, args) -> None:
        """Launch ``kernel`` (a handle in this lane's runtime) on ``args`` (an argument array of this runtime's)."""
        self._job = (kernel, args)
        self._go.release()

    def join(self) -> None:
        """Wait for the launch; a Ctrl-C meanwhile is raised once the lane is done, not before."""
        interrupted = False
        while True:
            try:
                self._done.acquire()
                break
            except KeyboardInterrupt:
                interrupted = True
        if interrupted:
            raise KeyboardInterrupt


class ProducerLanes:
    """The process's extra producer threads on the CPU: cores - 1 of them, at most MAX_PRODUCER_THREADS - 1.
    Taichi's own thread pool wakes its workers late on a 2-core VM: a layer's two work items of a millisecond each
    ran one after the other (docs/PERF.md, "A model's calls on the CPU, one layer at a time"); a thread that is
    handed its launch while the caller runs its own half starts at once."""

    def __init__(self, arch: str, n: int):
        self.lanes = [_Lane(arch, i) for i in range(n)]
        self.lock = threading.Lock()  # one layer's launch at a time (engines driven from several threads)


def deal(lanes: ProducerLanes | None, threads: int, start, here) -> None:
    """A launch's items dealt to this thread and ``threads - 1`` lanes: ``start(i, lane)`` hands lane i - 1 thread i's
    launch, ``here()`` runs thread 0's; every lane is done before this returns (or raises), since they write the
    planes too.  One thread: ``here()`` alone."""
    if threads == 1:
        here()
        return
    with lanes.lock:
        started = []
        try:
            for i in range(1, threads):
                lane = lanes.lanes[i - 1]
                start(i, lane)
                started.append(lane)
            here()
        finally:
            for lane in started:
                lane.join()


_LANES: dict[str, ProducerLanes | None] = {}


def _forget_lanes_after_fork() -> None:
    """In a forked child the lanes' threads are gone (fork copies only the calling thread): without this, the
    first deep layer would hand a launch to a thread that is not there and wait for ever.  The child's layers run
    on its calling thread alone."""
    for lanes in _LANES.values():
        if lanes is not None:
            lanes.lanes = []
            lanes.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_lanes_after_fork)


def producer_lanes(arch: str) -> ProducerLanes | None:
    """The process's ProducerLanes on ``arch`` (made on first use), or None where there is one core."""
    if arch not in _LANES:
        n = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
                MAX_PRODUCER_THREADS) - 1
        _LANES[arch] = ProducerLanes(arch, n) if n > 0 else None
    return _LANES[arch]


def take_compiled(path: str, what: str, build, auto_on_cuda: bool = False):
    """The launch-path rule of one engine's layers and a batch's (batch_compiled.py): ``build()`` (the compiled path,
    through Taichi's C-API) where ``path`` ("auto" | "capi" | "python") asks for it and the C-API works here, else
    None (Taichi's Python path).  "auto" takes the C-API on the CPU (and on CUDA where ``auto_on_cuda``), falling back
    with one warning naming why where it cannot load; "capi" takes it on the CPU and CUDA and raises where it cannot;
    on Vulkan and Metal the planes live in the Python runtime's device, which a C-API runtime cannot share.  ``what``
    names the caller in the warning."""
    if path not in LAUNCH_PATHS:
        raise EngineError(f"launch={path!r}: expected one of {', '.join(LAUNCH_PATHS)}")
    arch = backend.active()
    if path == "python":
        return None
    if arch not in ("cpu", "cuda"):
        if path == "capi":
            raise EngineError(f"launch='capi': the engine launches through Taichi's C-API on cpu and cuda; on {arch} "
                              f"the planes live in the Python runtime's device, which a C-API runtime cannot share "
                              f"(launch='auto' takes Taichi's Python path there)")
        return None
    if path == "auto" and arch == "cuda" and not auto_on_cuda:
        return None
    try:
        return build()
    except capi.CApiError as exc:
        if path == "capi":
            raise EngineError(f"launch='capi': {exc}") from None
        warnings.warn(f"muser_ti: Taichi's C-API cannot be used here ({exc}); {what} takes Taichi's Python launch "
                      f"path, tens of microseconds a kernel", RuntimeWarning, stacklevel=5)
        return None


def refuse_capture(torch) -> None:
    """Raise CaptureRefused where the caller's stream is capturing a CUDA graph (CAPTURE_REASON says why)."""
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        raise CaptureRefused(CAPTURE_REASON)


_RUNTIMES: dict[str, capi.Runtime] = {}


def runtime(arch: str) -> capi.Runtime:
    """The process's C-API runtime for ``arch``, made on first use and kept (its imports are (address, size)
    records, valid whatever the Python runtime does; capi.Runtime.memory)."""
    rt = _RUNTIMES.get(arch)
    if rt is None:
        rt = _RUNTIMES[arch] = capi.Runtime(arch)
    return rt


__all__ = ["CAPTURE_REASON", "CaptureRefused", "CompiledLayers", "LAUNCH_PATHS", "ScanRefused", "refuse_capture",
           "runtime", "take_compiled"]
