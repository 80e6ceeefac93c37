"""One layer of a per-layer token (token.py) launched from compiled code: Taichi's C-API.

A model calls the engine once a layer, 52 times a token for Glimmer.  Through Taichi's Python launch path each
of a layer's kernels costs tens of microseconds of host time; here the layer's kernels (the token scan, the
store where the route has one, the producer, the reducer) were compiled ahead of time (aot.py), loaded into a
C-API runtime (capi.py), and each launch is one C call on an argument array built once per layer and patched
in place: the token's position, the plane's origins, the split.

Memory: the planes and the engine's scratch are the Python runtime's arrays, imported once by address (the
CPU's host memory; on CUDA, device memory of the primary context both runtimes share).  The caller's arrays:
on the CPU they are copied (converted where their dtype is not float32) into the layer's staging arrays, a few
kilobytes, imported once: importing each new array would grow the C-API's table of allocations for ever, since
Taichi 1.7.4 cannot free an imported CPU allocation.  On CUDA a float32 contiguous tensor is imported where it
lies (a framework's caching allocator hands out the same few addresses token after token) up to
``MAX_IMPORTED`` addresses, then copied into the staging arrays on the device.

The producer on the CPU: at short context a serial kernel on the calling thread (split_geometry.cpu_serial); deeper,
the same serial kernel on the calling thread and on ProducerLanes (threads of the engine's own, each with a C-API
runtime of its own), the layer's work items dealt round-robin, since Taichi's thread pool wakes its workers late on
a small VM; without lanes (one core) the serial kernel alone.  Each item is the same code every way: the same bits.

Checks: the token scan runs as the layer's first kernel and writes its flags; the host reads them once, when
the token commits (token.py), and a flagged layer abandons the token, which undoes every write it made.

Ordering on CUDA: Taichi 1.7.4's launcher copies each launch's arguments with an asynchronous copy on the
legacy default stream.  The kernels therefore go on that stream too (``ti_set_cuda_stream(0)``); where the
caller's current stream is another, the launches are fenced with events both ways (the caller's stream's work
before them, theirs before the caller's next), so the engine orders with the model's own kernels without a
host synchronisation.  CUDA-graph capture is refused (:func:`refuse_capture` says why).

Same bits as the Python path: the same kernels (the same Taichi IR, compiled by the same LLVM) on the same
split geometry (launch.Launcher.split_geometry); tests/test_layer_launch.py holds the two paths to each other.
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
from .kernels.producer import plan_key
from .kernels.token_scan import TOKEN_FLAGS, build_token_scan
from .launch import host_view
from .planes import visible_span, window_of

LAUNCH_PATHS = ("auto", "capi", "python")
MAX_IMPORTED = 4096  # distinct caller addresses imported on CUDA before copies take over (capi.Runtime says why)
# A layer's producer has n_kv_heads x nwg work items at the split step() gives it: 2 to 4 for Glimmer (2 KV heads,
# at most 2 workgroups a pair at 13 layers a launch), so more threads than 4 would find nothing to do.
MAX_PRODUCER_THREADS = 4
PRODUCER_ARGS = 20  # the serial producer's arguments: the producer's 18, then first and stride


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
                self._lane_kernels.append({name: lane.rt.kernel(lane_module, name + "_serial")
                                           for name in ("splitk", "interleaved")})
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
        """The per-layer kernels by name, each with the key its build depends on (aot.module_key)."""
        cfg, gpu = launcher.cfg, launcher.gpu
        geometry = (cfg.head_dim, cfg.heads_per_kv, cfg.n_kv_heads, cfg.n_heads, gpu, launcher.items_cap,
                    repr(plan_key(cfg.head_dim, cfg.heads_per_kv, gpu)))
        scan = build_token_scan(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, serial=not gpu)
        reduce_splitk = launcher.reduce_one.get(launcher.reduce_f32, launcher.reduce_f32)
        reduce_interleaved = launcher.reduce_one.get(launcher.reduce_v2, launcher.reduce_v2)
        kernels = {"scan": (scan, ("scan", geometry)),
                   "reduce_splitk": (reduce_splitk, ("reduce_f32", geometry)),
                   "reduce_interleaved": (reduce_interleaved, ("reduce_v2", geometry))}
        if gpu:
            kernels["splitk"] = (launcher.splitk, ("splitk", geometry))
            kernels["interleaved"] = (launcher.interleaved, ("interleaved", geometry))
        else:  # the serial producers only (_produce): each compiles in tens of seconds on a cold cache
            kernels["splitk_serial"] = (launcher.producer_one[launcher.splitk], ("splitk_serial", geometry))
            kernels["interleaved_serial"] = (launcher.producer_one[launcher.interleaved],
                                             ("interleaved_serial", geometry))
        if SWA in launcher.cache.planes:
            kernels["store"] = (launcher.cache.stores[SWA].store_token, ("store_token", geometry))
        return kernels

    # ---- per layer -------------------------------------------------------------------------------
    def _layer_args(self, layer: int) -> dict:
        """The layer's argument arrays, the parts that never change filled in (its layer table, the flags, the
        scale, the window)."""
        args = self._args.get(layer)
        if args is not None:
            return args
        launcher, cache, cfg = self.launcher, self.cache, self.cfg
        kind = cfg.layer_kinds[layer]
        grp = cache.token_group(layer)
        imp = self.imported
        a = {"scan": capi.arguments(5), "store": capi.arguments(8), "producer": capi.arguments(PRODUCER_ARGS),
             "reduce": capi.arguments(5), "kind": kind, "plane": None, "partials": None, "io": None,
             # the producer's arrays (the CPU's: q, k, v staged), for the lanes' own imports; their arguments
             "objs": [*self.staging[:3], None, None, None, launcher._no_visits, grp.layers_dev, grp.slots_dev],
             "lanes": {}}
        flags, layers_mem, slots_mem = imp(launcher.checks.flags), imp(grp.layers_dev), imp(grp.slots_dev)
        capi.set_ndarray(a["scan"][3], *flags)
        p = a["producer"]
        capi.set_ndarray(p[6], *imp(launcher._no_visits))
        capi.set_ndarray(p[7], *layers_mem)
        capi.set_ndarray(p[8], *slots_mem)
        capi.set_i32(p[9], 1)
        capi.set_i32(p[11], window_of(cfg, kind))
        capi.set_f32(p[17], cfg.attention_scale)
        s = a["store"]
        capi.set_ndarray(s[4], *layers_mem)
        capi.set_ndarray(s[5], *slots_mem)
        capi.set_i32(s[6], 1)
        r = a["reduce"]
        capi.set_ndarray(r[2], *layers_mem)
        capi.set_i32(r[3], 1)
        self._args[layer] = a
        return a

    def _set_io(self, a: dict, io: tuple) -> None:
        """q, k, v, out (TiMemory, shape, dtype) into every kernel of the layer that reads them."""
        if a["io"] == io:
            return
        q, k, v, out = io
        for i, m in enumerate((q, k, v)):
            capi.set_ndarray(a["scan"][i], *m)
            capi.set_ndarray(a["producer"][i], *m)
        capi.set_ndarray(a["store"][0], *k)
        capi.set_ndarray(a["store"][1], *v)
        capi.set_ndarray(a["reduce"][1], *out)
        a["io"] = io

    def attend(self, plan, layer: int, route_sizes, io: tuple, stamp: int) -> int:
        """Launch ``layer``'s kernels of the planned token on ``io`` = (q, k, v, out) as (TiMemory, shape, dtype);
        returns the launches made."""
        p, new_states, routes, _ = plan
        route = routes[layer]
        if route not in (ladder.SPLITK, ladder.INTERLEAVED):
            raise EngineError(f"layer {layer}: route {route} reads host arrays (Launcher.attend_layer_host)")
        a = self._layer_args(layer)
        kind = a["kind"]
        st, cache, launcher = new_states[kind], self.cache, self.launcher
        self._set_io(a, io)
        planes = (cache.k[kind], cache.v[kind])
        if a["plane"] is None or a["plane"][0] is not planes[0] or a["plane"][1] is not planes[1]:
            km, vm = self.imported(planes[0]), self.imported(planes[1])
            capi.set_ndarray(a["producer"][3], *km)
            capi.set_ndarray(a["producer"][4], *vm)
            capi.set_ndarray(a["store"][2], *km)
            capi.set_ndarray(a["store"][3], *vm)
            a["plane"] = planes
            a["objs"][3:5] = planes
        _, visible = visible_span(self.cfg, kind, p)
        nwg, nsg = launcher.split_geometry(visible, route_sizes[route])
        partials = launcher.partials_for(kind, 1, nwg)
        if a["partials"] is not partials:
            pm = self.imported(partials)
            capi.set_ndarray(a["producer"][5], *pm)
            capi.set_ndarray(a["reduce"][0], *pm)
            a["partials"] = partials
            a["objs"][5] = partials
        pr = a["producer"]
        pr[10].value.i32 = p
        pr[12].value.i32 = st.capacity
        pr[13].value.i32 = st.origin_logical
        pr[14].value.i32 = st.origin_physical
        pr[15].value.i32 = nwg
        pr[16].value.i32 = nsg
        a["reduce"][4].value.i32 = nwg
        capi.set_i32(a["scan"][4], stamp)
        launch, rt, k = self._launch, self._handle, self.k
        fence = self._stream_fence
        if fence is not None:
            fence.before()
        launch(rt, k["scan"], 5, a["scan"])
        if self._summary is not None and self._summary.max() == stamp:
            raise ScanRefused(stamp)
        if route == ladder.SPLITK:
            a["store"][7].value.i32 = st.physical(p)
            launch(rt, k["store"], 8, a["store"])
            self._produce(a, "splitk", visible, self.cfg.n_kv_heads * nwg)
            launch(rt, k["reduce_splitk"], 5, a["reduce"])
            n = 4
        else:
            self._produce(a, "interleaved", visible, self.cfg.n_kv_heads * nwg)
            launch(rt, k["reduce_interleaved"], 5, a["reduce"])
            n = 3
        if fence is not None:
            fence.after()
        return n

    def _produce(self, a: dict, route: str, visible: int, items: int) -> None:
        """The layer's producer launch (``route``: "splitk" | "interleaved") over its ``items`` work items.  On a GPU:
        Taichi's parallel kernel.  On the CPU the serial kernel: on this thread alone at short context
        (Launcher.serial_layer) or without lanes (one core); else on this thread and each lane, items dealt
        round-robin (thread i takes items i, i + threads, ...), every item the same work as in the parallel kernel,
        which the CPU's module leaves out (Taichi's pool woke its second worker too late for a layer's items)."""
        pr, launch, rt = a["producer"], self._launch, self._handle
        if self.gpu:
            launch(rt, self.k[route], 18, pr)
            return
        alone = self.lanes is None or self.launcher.serial_layer(visible)
        threads = 1 if alone else min(items, 1 + len(self.lanes.lanes))
        pr[18].value.i32 = 0
        pr[19].value.i32 = threads

        def start(i, lane):
            args = self._lane_args(a, i - 1, lane)
            args[18].value.i32 = i
            args[19].value.i32 = threads
            lane.start(self._lane_kernels[i - 1][route], args)

        deal(self.lanes, threads, start, lambda: launch(rt, self.k[route + "_serial"], PRODUCER_ARGS, pr))

    def _lane_args(self, a: dict, i: int, lane) -> ctypes.Array:
        """Lane i's producer arguments for the layer of ``a``: its own imports of the layer's arrays (a runtime's
        memory is its own), the scalars copied from this thread's."""
        held = a["lanes"].get(i)
        if held is None:
            held = a["lanes"][i] = (capi.arguments(PRODUCER_ARGS), [None] * len(a["objs"]))
        args, seen = held
        for j, obj in enumerate(a["objs"]):
            if seen[j] is not obj:
                capi.set_ndarray(args[j], *lane.imported(obj))
                seen[j] = obj
        size = ctypes.sizeof(capi.Argument)
        ctypes.memmove(ctypes.addressof(args) + 9 * size, ctypes.addressof(a["producer"]) + 9 * size, 9 * size)
        return args

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
