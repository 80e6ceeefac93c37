"""The engine: encodes one decode token through the ladder (the chapter's encode_token).

Per token: validate the inputs; compute every plane's state after the append (nothing is written
yet); evaluate the ladder per layer on that state; then launch, per route, one kernel sequence for
*all* layers on that route, so the launch count per token depends on the routes taken, not on the
number of layers.  A rejected token (bad input, a forced route whose predicate fails, a plane that
cannot hold its window) raises before any write: the cache is exactly as it was.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from dataclasses import dataclass

import numpy as np
import taichi as ti

from . import backend, ladder, llama_rung, plane_mirror
from .config import NOPE, SWA, Geometry
from .kernels import halves
from .kernels.common import HEAD_MAJOR, MAX_WORKGROUPS, TOKEN_MAJOR, on_gpu
from .kernels.interleaved import build_interleaved
from .kernels.splitk import (build_splitk, gpu_items_cap, gpu_split_geometry, gpu_target_workgroups,
                             gpu_workgroups_per_pair, splitk_geometry)
from .kernels.step_gpu import ONE_DISPATCH_ARCHS, build_step_kernel
from .kernels.stores import NEVER_STAMPED, TOKEN_FLAGS, build_stores, build_token_scan, build_unpack
from .planes import PlaneError, PlaneSet, PlaneState, plane_shape, ring_rows_to_write, visible_span, window_of
from .reference import attend
from .replay import GraphReplay
from .transfer import Transfer

GRAPHS = ("teacher", "serving")
PINNED_MODES = ("auto", "on", "off")
MIRRORS = (None, "host")
LAYOUT_OF = {SWA: TOKEN_MAJOR, NOPE: HEAD_MAJOR}


class EngineError(ValueError):
    """Bad input at the public API; the engine's state is unchanged."""


class PinnedUnavailable(RuntimeError):
    """A pinned route was selected or requested but the pinned library is not loaded."""


def pinned_library_status(arch: str = "auto") -> tuple[bool, str]:
    """(loaded, description): can llama.cpp's vec kernel read planes on ``arch`` in this process?

    Without it the ladder falls to the project's own kernels, as §16.0 says it does when the
    metallib is missing.
    """
    return llama_rung.pinned_status(backend.resolve_arch(arch))


@dataclass
class _Group:
    """Device-side list of the layers on one route (cached per composition)."""

    layers: tuple[int, ...]
    slots: tuple[int, ...]
    layers_dev: object
    slots_dev: object


class Engine:
    """Decode attention over a model's planes, route by route.

    arch: "auto" | "cpu" | "cuda" | "vulkan" | "metal"; pinned: "auto" | "on" | "off";
    graph: "teacher" (read wrapped rings directly) | "serving" (llama's cell order; needs the pinned rung).
    force: a route name (for the layers of its class) or {layer: route}, for diagnosis.  A forced route
    whose predicate fails raises RouteError at the step, before anything is written.
    capacity: per-session override of every plane's capacity (a "deliberately tiny raw session" when < 32).
    mirror: None | "host".  Mirror planes (muser_ti/plane_mirror.py, ``eng.mirror``): a second copy of every
    plane, written on every store, that the vec routes read instead of the planes.  On arch="metal" with
    the pinned rung loaded the engine always keeps one, in bridge buffers (the bridge cannot read Taichi's
    Metal planes; never run: no macOS here).  "host" keeps one in numpy memory on any arch, to test the
    bookkeeping off macOS; on the CPU the vec routes then read it through ggml.
    """

    def __init__(self, cfg: Geometry, arch: str = "auto", pinned: str = "auto", graph: str = "teacher",
                 force: str | dict | None = None, capacity: int | None = None, mirror: str | None = None):
        if pinned not in PINNED_MODES:
            raise EngineError(f"pinned={pinned!r}; expected one of {list(PINNED_MODES)}")
        if graph not in GRAPHS:
            raise EngineError(f"graph={graph!r}; expected one of {list(GRAPHS)}")
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise EngineError(f"capacity={capacity!r}; expected a positive integer")
        if mirror not in MIRRORS:
            raise EngineError(f"mirror={mirror!r}; expected one of {list(MIRRORS)}")
        loaded, why = pinned_library_status(arch)
        if pinned == "on" and not loaded:
            raise PinnedUnavailable(f"pinned='on' but the pinned library is not loaded: {why}")
        if pinned == "off":
            loaded, why = False, "disabled (pinned='off')"
        if graph == "serving" and not loaded:
            raise PinnedUnavailable(
                f"graph='serving' stages SWA rows into llama.cpp's cell order for the pinned kernel, which is "
                f"not loaded: {why}")
        self.cfg = cfg
        self.arch = backend.activate(arch)
        self._generation = backend.generation()
        self.pinned_loaded = loaded
        self.pinned_description = why
        self.graph = graph
        self._forced = self._parse_force(force)
        self._layer_kinds = cfg.layer_kinds
        self._routes_by_mix: dict[tuple[str, ...], tuple[str, ...]] = {}  # unforced: each class's route -> routes

        g = cfg
        self.planes: dict[str, PlaneSet] = {}
        for kind, layers in ((SWA, g.swa_layers), (NOPE, g.nope_layers)):
            if not layers:
                continue
            if kind == SWA:
                cap = capacity if capacity is not None else g.swa_ring_capacity
            else:
                cap = min(capacity, g.max_context) if capacity is not None else g.max_context
            self.planes[kind] = PlaneSet(g, kind, layers, cap)
        self._slot = {}
        for kind, ps in self.planes.items():
            for i, layer in enumerate(ps.layers):
                self._slot[layer] = i

        self._k: dict[str, object] = {}
        self._v: dict[str, object] = {}
        for kind, ps in self.planes.items():
            self._k[kind], self._v[kind] = self._alloc_plane(kind, ps.state.capacity)
        self.mirror = self._make_mirror(mirror)
        self._bridge_runner = self.mirror.backing.runner(g) if self.mirror is not None else None

        gpu = on_gpu()
        D, G, KV, H = g.head_dim, g.heads_per_kv, g.n_kv_heads, g.n_heads
        # the split's workgroup target, fixed for the engine: its producers' loop bound follows from it
        self._gpu_target = gpu_target_workgroups() if gpu else 0
        self._items_cap = gpu_items_cap(self._gpu_target, g.n_layers * KV) if gpu else 0
        caps = dict(items_cap=self._items_cap, layers_cap=g.n_layers if gpu else 0)  # constant loop bounds
        self._splitk, self._reduce_f32, _ = build_splitk(D, G, KV, H, gpu, **caps)
        self._interleaved, self._reduce_v2 = build_interleaved(D, G, KV, H, gpu, **caps)
        self._stores = {kind: build_stores(D, KV, LAYOUT_OF[kind]) for kind in self.planes}
        self._gpu = gpu
        # (class, group size) -> [n_group, H, workgroups, 2 + D] scratch: one per class, as the one-dispatch
        # step runs both producers before either reducer
        self._partials: dict[tuple[str, int], object] = {}
        self._no_visits = ti.ndarray(ti.i32, (1, 1))
        self._token_shape = {"q": (g.n_layers, H, D), "k": (g.n_layers, KV, D), "v": (g.n_layers, KV, D),
                             "out": (g.n_layers, H, D)}
        self._out = ti.ndarray(ti.f32, self._token_shape["out"])
        self._scan = build_token_scan(H, KV, D)
        # the scan's flags; the one-dispatch step keeps its layer table after them (kernels/step_gpu.py)
        self._flags_shape = (TOKEN_FLAGS + g.n_layers,)
        self._token_flags = ti.ndarray(ti.i32, self._flags_shape)
        self._token_flags.fill(0)
        self._scans = 0  # the stamp of the last scan (build_token_scan says why)
        self._q, self._k_cur, self._v_cur = (ti.ndarray(ti.f32, self._token_shape[n]) for n in ("q", "k", "v"))
        self._transfer = Transfer()  # per-token copies: the CUDA driver's memcpy where it can (transfer.py)
        # Where host copies go through Taichi (Vulkan, Metal), from_numpy synchronises the device after its
        # copy kernel (1.5-2.2 ms per upload on the H200's Vulkan, docs/PERF.md run 7).  There q, k and v go
        # up packed, as the host-array argument of the kernel that unpacks them: Taichi stages a kernel's
        # host arrays when it launches it and needs no synchronisation for one the kernel only reads.
        self._unpack = build_unpack(H, KV, D) if on_gpu() and self._transfer.path == "taichi" else None
        self._groups: dict[tuple[int, ...], _Group] = {}
        self._graphs = GraphReplay()  # GPU: compiled step graphs by dispatch structure
        # CUDA, Vulkan: a step on the default routes is one dispatch (kernels/step_gpu.py)
        self._step_kernel = None
        if gpu and backend.active() in ONE_DISPATCH_ARCHS and SWA in self.planes and NOPE in self.planes:
            c = self.cfg
            # the kernel computes each class's split from the position and the engine's target
            target = self._gpu_target
            self._step_kernel = build_step_kernel(D, G, KV, H, len(c.nope_layers), len(c.swa_layers), c.attention_scale,
                                                  window_of(c, NOPE), window_of(c, SWA), target)
            # its layer table, after the flags: NoPE layers, then SWA layers (a class's slots are its order)
            table = np.zeros(TOKEN_FLAGS + c.n_layers, np.int32)
            table[TOKEN_FLAGS:] = self.planes[NOPE].layers + self.planes[SWA].layers
            self._token_flags.from_numpy(table)
            # and partials for the most workgroups that split can give, made once
            self._step_partials = [self._partials_for(kind, len(self.planes[kind].layers), gpu_workgroups_per_pair(
                len(self.planes[kind].layers) * KV, target)) for kind in (NOPE, SWA)]
        self._recorded = None
        self._llama_runners: dict[int, object] = {}  # group size -> ggml graph runner (pinned rung, CPU)
        self._serving = None
        if graph == "serving" and SWA in self.planes:
            zeros = self.mirror.backing.zeros if self.mirror is not None else np.zeros  # Metal: cells the bridge reads
            self._serving = llama_rung.ServingCache(len(self.planes[SWA].layers), g.window, g.n_ubatch, KV, D, zeros)

        self.position = 0
        self.launches_last_step = 0  # kernel launches the last step made (does not grow with layer count)
        self.routes: list[str | None] = [None] * g.n_layers
        # route_counts, kept as accepted steps per route mix (the whole model's routes, a tuple): a step adds 1
        # to one count instead of 52 (Counter.update of a 52-layer list took 4.9 us of Python a token, ~2 % of
        # a 2,048-key step on the H200); the per-route sums are made when route_counts is read
        self._steps_by_mix: dict[tuple[str, ...], int] = {}
        self._restored_counts: Counter = Counter()  # counts a snapshot brought in (route_counts' setter)

    # ---- construction helpers ------------------------------------------------------------------
    def _parse_force(self, force) -> dict[int, str]:
        if force is None:
            return {}
        if isinstance(force, str):
            if force not in ladder.ROUTES:
                raise ladder.RouteError(f"unknown route {force!r}; routes are {list(ladder.ROUTES)}")
            kind = ladder.ROUTE_KIND[force]
            return {i: force for i, k in enumerate(self.cfg.layer_kinds) if k == kind}
        out = {}
        for layer, route in dict(force).items():
            if not (isinstance(layer, int) and 0 <= layer < self.cfg.n_layers):
                raise ladder.RouteError(f"force: layer {layer!r} is not in [0, {self.cfg.n_layers})")
            if route not in ladder.ROUTES:
                raise ladder.RouteError(f"force: unknown route {route!r} for layer {layer}; routes are {list(ladder.ROUTES)}")
            out[layer] = route
        return out

    def _make_mirror(self, mirror: str | None):
        """The mirror planes (plane_mirror.py): bridge buffers on Metal with the rung loaded, numpy for "host"."""
        if self.arch == "metal" and self.pinned_loaded:
            if mirror == "host":
                raise EngineError("mirror='host': on Metal the pinned rung reads bridge buffers, so the engine keeps its "
                                  "mirror there; pass mirror=None")
            from . import metal_bridge

            try:
                backing = plane_mirror.MetalBacking(metal_bridge.load())
            except metal_bridge.MetalBridgeError as exc:
                raise PinnedUnavailable(f"the pinned Metal bridge verified but did not open: {exc}") from None
        elif mirror == "host":
            backing = plane_mirror.HostBacking()
        else:
            return None
        # Memory: the mirror holds every plane a second time (plane_mirror.py gives Glimmer's figures); on
        # Metal it cannot be avoided, since Taichi cannot bind the bridge's buffers nor hand out its own.
        return plane_mirror.PlaneMirror(self.cfg, backing, {kind: ps.state for kind, ps in self.planes.items()})

    def _set_state(self, kind: str, st: PlaneState) -> None:
        """Every plane-state change goes through here, so the mirror's bookkeeping follows the planes."""
        self.planes[kind].state = st
        if self.mirror is not None:
            self.mirror.set_state(kind, st)

    def _alloc_plane(self, kind: str, capacity: int):
        shape = plane_shape(self.cfg, kind, len(self.planes[kind].layers), capacity)
        return halves.alloc(shape), halves.alloc(shape)

    def _group(self, layers: tuple[int, ...]) -> _Group:
        grp = self._groups.get(layers)
        if grp is None:
            slots = tuple(self._slot[layer] for layer in layers)
            ld = ti.ndarray(ti.i32, (len(layers),))
            sd = ti.ndarray(ti.i32, (len(layers),))
            ld.from_numpy(np.asarray(layers, np.int32))
            sd.from_numpy(np.asarray(slots, np.int32))
            grp = self._groups[layers] = _Group(layers, slots, ld, sd)
        return grp

    def _check_alive(self):
        if backend.generation() != self._generation:
            raise EngineError("Taichi was re-initialised for another arch since this engine was made; its planes are gone")

    @staticmethod
    def _where(name: str, idx: tuple[int, ...]) -> str:
        axes = ("layer", "head", "d") if name == "q" else ("layer", "kv head", "d")
        if len(idx) == 4:
            axes = ("token",) + axes
        return ", ".join(f"{a} {i}" for a, i in zip(axes, idx))

    def _check_array(self, name: str, a, shape: tuple[int, ...]) -> np.ndarray:
        if not isinstance(a, np.ndarray):
            raise EngineError(f"{name}: expected a numpy array, got {type(a).__name__}")
        if a.shape != shape:
            raise EngineError(f"{name}: shape {a.shape}, expected {shape}")
        if a.dtype not in (np.float32, np.float64, np.float16):
            raise EngineError(f"{name}: dtype {a.dtype}, expected float32")
        a = np.ascontiguousarray(a, dtype=np.float32)
        if not np.isfinite(a).all():  # one pass on the common path; the bad index only when there is one
            idx = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
            raise EngineError(f"{name}: non-finite value {a[idx]} at {self._where(name, idx)}")
        return a

    def _check_kv_range(self, name: str, a: np.ndarray):
        if a.size and max(float(a.max()), -float(a.min())) > 65504.0:
            idx = tuple(int(i) for i in np.argwhere(np.abs(a) > 65504.0)[0])
            raise EngineError(f"{name}: value {a[idx]:.6g} at {self._where(name, idx)} overflows the f16 plane (|x| <= 65504)")

    # ---- public API ----------------------------------------------------------------------------
    def prefill(self, k: np.ndarray, v: np.ndarray) -> None:
        """Append tokens without attention; k, v: float32 [n_tokens, n_layers, n_kv_heads, head_dim]."""
        self._check_alive()
        g = self.cfg
        if not isinstance(k, np.ndarray) or k.ndim != 4:
            raise EngineError(f"prefill k: expected a 4-d numpy array [n_tokens, {g.n_layers}, {g.n_kv_heads}, {g.head_dim}]")
        n = k.shape[0]
        shape = (n, g.n_layers, g.n_kv_heads, g.head_dim)
        k = self._check_array("prefill k", k, shape)
        v = self._check_array("prefill v", v, shape)
        self._check_kv_range("prefill k", k)
        self._check_kv_range("prefill v", v)
        if n == 0:
            return
        if self.position + n > g.max_context:
            raise EngineError(f"prefill of {n} tokens at position {self.position} passes max_context={g.max_context}")
        try:
            new_states = {kind: ps.check_prefill(self.position, n) for kind, ps in self.planes.items()}
        except PlaneError as exc:
            raise EngineError(str(exc)) from None
        for kind, ps in self.planes.items():
            before = ps.state
            self._ensure_capacity(kind, new_states[kind].capacity)
            if kind == SWA:
                first, rows = ring_rows_to_write(before, self.position, n)
            else:
                first, rows = 0, np.arange(before.len, before.len + n, dtype=np.int32)
            grp = self._group(ps.layers)
            rows_dev = ti.ndarray(ti.i32, (len(rows),))
            rows_dev.from_numpy(rows)
            self._stores[kind].store_tokens(self._host_or_dev(k), self._host_or_dev(v), self._k[kind], self._v[kind],
                                            grp.layers_dev, grp.slots_dev, len(ps.layers), rows_dev, first, len(rows))
            if self.mirror is not None:  # the same rows from the same f32 tokens: O(rows written)
                self.mirror.store(kind, rows, k[first:], v[first:])
            self._set_state(kind, new_states[kind])
        if self._serving is not None:
            keep = min(n, self._serving.cells)
            swa = list(self.planes[SWA].layers)
            for t in range(n - keep, n):
                rows = k[t][swa].astype(np.float16), v[t][swa].astype(np.float16)
                self._serving.stage(self.position + t, *rows)
        self.position += n

    def step(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Attend one token: q [n_layers, n_heads, head_dim], k/v [n_layers, n_kv_heads, head_dim] -> like q."""
        self._check_alive()
        q, k, v = self._check_token(q, k, v)
        p, new_states, routes, mix = self._plan_step()
        return self._commit_step(p, new_states, routes, mix, q, k, v)

    def step_device(self, q, k, v, out):
        """Attend one token with the activations on the device: q, k, v and out are Taichi float32
        ndarrays of step()'s shapes; the output is written into ``out``, which is returned.

        Nothing crosses to the host but a few flags: one kernel scans q, k and v for non-finite values
        and for k/v outside the f16 planes' range, and its flags are read before anything is written, so
        bad input is refused as step() refuses it (the same messages) with the cache unchanged.  Steps
        that need the activations on the host (a pinned llama.cpp route, mirror planes) copy them there.
        """
        self._check_alive()
        for name, a in (("q", q), ("k", k), ("v", v), ("out", out)):
            shape = self._token_shape[name]
            if not isinstance(a, ti.Ndarray) or tuple(a.shape) != shape or a.dtype != ti.f32:
                got = (f"{a.dtype} ndarray of shape {tuple(a.shape)}" if isinstance(a, ti.Ndarray)
                       else type(a).__name__)
                raise EngineError(f"step_device {name}: expected a Taichi float32 ndarray of shape {shape}, got {got}")
        try:
            p, new_states, routes, mix = self._plan_step()
        except EngineError:
            self._scan_device_token(q, k, v)  # a bad token is named before a full cache, as step() names it
            raise
        if self._one_dispatch_fits(new_states, routes):
            # the scan is the step's first task and gates its writes; the flags are read after it
            self._commit_step(p, new_states, routes, mix, None, None, None, device=(q, k, v, out), gated=True)
            return out
        self._scan_device_token(q, k, v)
        if self.mirror is not None or any(r in ladder.PINNED_ROUTES for r in routes):
            host = self._commit_step(p, new_states, routes, mix, *self._download_token(q, k, v))
            self._transfer.upload(out, host)
        else:
            self._commit_step(p, new_states, routes, mix, None, None, None, device=(q, k, v, out))
        self.launches_last_step += 1  # the scan
        return out

    @property
    def route_counts(self) -> Counter:
        """Layer-steps per route over every accepted token (restored with a snapshot); a new Counter on
        every read."""
        counts = Counter(self._restored_counts)
        for mix, steps in self._steps_by_mix.items():
            for route, layers in Counter(mix).items():
                counts[route] += layers * steps
        return counts

    @route_counts.setter
    def route_counts(self, counts) -> None:
        self._restored_counts = Counter(counts)
        self._steps_by_mix = {}

    @property
    def one_dispatch_step(self) -> bool:
        """True where a step on the default routes runs as one dispatch (CUDA, Vulkan; kernels/step_gpu.py)."""
        return self._step_kernel is not None

    def _one_dispatch_fits(self, new_states, routes) -> bool:
        """The step can be the one dispatch: both classes on their default routes, device planes, no growth."""
        if self._step_kernel is None or self.mirror is not None or self._serving is not None or self._forced:
            return False
        g = self.cfg
        if routes[g.nope_layers[0]] != ladder.INTERLEAVED or routes[g.swa_layers[0]] != ladder.SPLITK:
            return False  # without forced layers a class's layers share its route (_plan_step)
        return all(st.capacity == self.planes[kind].state.capacity for kind, st in new_states.items())

    def _check_token(self, q, k, v) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        q = self._check_array("q", q, self._token_shape["q"])
        k = self._check_array("k", k, self._token_shape["k"])
        v = self._check_array("v", v, self._token_shape["v"])
        self._check_kv_range("k", k)
        self._check_kv_range("v", v)
        return q, k, v

    def _scan_device_token(self, q, k, v) -> None:
        """Refuse a device token step() would refuse: flags from one kernel, then, only when one is set,
        the host check on a copy, which names the first bad value."""
        self._scans += 1
        if self._gpu:  # through a one-dispatch graph: Taichi's Python launch path costs ~100 us more (PERF.md)
            self._replay([(self._scan, (q, k, v, self._token_flags, self._scans))], external=(q, k, v))
        else:
            self._scan(q, k, v, self._token_flags, self._scans)
        self._refuse_if_flagged(q, k, v)

    def _refuse_if_flagged(self, q, k, v) -> None:
        """Raise, naming the first bad value, if the last scan (stamp self._scans) flagged the token."""
        flags = self._transfer.download(self._token_flags, self._flags_shape)[:TOKEN_FLAGS] == self._scans
        if flags.any():
            self._check_token(*self._download_token(q, k, v))
            raise EngineError(f"step_device: the device scan flagged the token ({flags.tolist()}) but its host "
                              f"copy passes the checks")  # a scan that disagrees with the host is a bug: say so

    def _download_token(self, q, k, v) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(self._transfer.download(a, self._token_shape[name]) for name, a in (("q", q), ("k", k), ("v", v)))

    def _plan_step(self):
        """(position, plane states after the append, route per layer, the routes as a tuple: route_counts'
        key), or raise with nothing written."""
        g = self.cfg
        p = self.position
        if p >= g.max_context:
            raise EngineError(f"position {p} is past max_context={g.max_context}")
        try:
            new_states = {kind: ps.check_append(p) for kind, ps in self.planes.items()}
        except PlaneError as exc:
            raise EngineError(str(exc)) from None
        strict = ladder.strict_attention()
        # the ladder depends on the layer's class and plane state only, so it is evaluated once per class;
        # forced layers are checked one by one
        chosen = {kind: ladder.choose_route(kind, st, self.pinned_loaded, strict) for kind, st in new_states.items()}
        if self._forced:
            routes = [chosen[kind] if layer not in self._forced else
                      ladder.select(kind, new_states[kind], self.pinned_loaded, strict, self._forced[layer], layer)
                      for layer, kind in enumerate(self._layer_kinds)]
            used = set(routes)
            mix = tuple(routes)
        else:  # every layer takes its class's route: one tuple per route mix, listed anew (users may edit .routes)
            used = tuple(chosen.values())
            mix = self._routes_by_mix.get(used)
            if mix is None:
                mix = self._routes_by_mix[used] = tuple(chosen[kind] for kind in self._layer_kinds)
            routes = list(mix)
        pinned = sorted({r for r in used if r in ladder.PINNED_ROUTES})
        if pinned and not self.pinned_loaded:
            raise PinnedUnavailable(
                f"the ladder chose {pinned} ({ladder.STRICT_ENV} set or pinned forced) but the pinned library is not "
                f"loaded: {self.pinned_description}")
        return p, new_states, routes, mix

    def _commit_step(self, p, new_states, routes, mix, q, k, v, device=None, gated=False):
        """Write and attend the accepted token.  q, k, v: checked host arrays; or device = (q, k, v, out)
        ndarrays, with out receiving the result (then nothing is returned), checked on the device already or,
        with ``gated``, by the one-dispatch step's first task: then its flags are read after the step and a
        refused token leaves the planes, ``out`` and the engine's state as they were."""
        one_dispatch = gated or self._one_dispatch_fits(new_states, routes)  # before a growing plane is grown
        # ---- commit: from here on the token is accepted (gated: unless the step's scan refuses it) ----
        self.launches_last_step = 0
        self._recorded = [] if self._gpu else None  # GPU: replay the step's dispatches as one ti.graph
        for kind, st in new_states.items():
            self._ensure_capacity(kind, st.capacity)
        if self.mirror is not None:
            # every route stores this token's row in every layer (a store kernel, or fused into the
            # interleaved producer): the mirror gets the same row, before anything reads it
            for kind, st in new_states.items():
                self.mirror.store(kind, [st.physical(p)], k[None], v[None])
        out = None
        if device is not None:
            self._q_dev, k_dev, v_dev, out_dev = device
        else:
            if self._unpack is not None:
                # launched now, ahead of the step's graph on the same queue (a graph binds device arrays only)
                self.launches_last_step += 1
                self._unpack(np.concatenate((q, k, v), axis=1), self._q, self._k_cur, self._v_cur)
                self._q_dev, k_dev, v_dev = self._q, self._k_cur, self._v_cur
            else:
                self._q_dev = self._upload(self._q, q)
                k_dev, v_dev = self._upload(self._k_cur, k), self._upload(self._v_cur, v)
            out = np.empty_like(q) if not on_gpu() else None
            out_dev = out if out is not None else self._out
        vec_layers, vec_out = [], out
        if one_dispatch:
            self._launch_one_dispatch(p, new_states, k_dev, v_dev, out_dev, gated)
        else:
            vec_layers, vec_out = self._launch_routes(p, new_states, routes, q, k_dev, v_dev, out, out_dev)
        if self._recorded is not None:
            self._replay(self._recorded, external=device or ())
            self._recorded = None
        if gated:
            self._refuse_if_flagged(*device[:3])
        for kind, st in new_states.items():
            self._set_state(kind, st)
        self.position = p + 1
        self.routes = routes
        self._steps_by_mix[mix] = self._steps_by_mix.get(mix, 0) + 1
        if device is not None:
            return None
        if out is None:
            out = self._transfer.download(self._out, q.shape)
            if vec_layers:
                out[vec_layers] = vec_out[vec_layers]
        return out

    def _launch_one_dispatch(self, p, new_states, k_dev, v_dev, out_dev, gated: bool) -> None:
        """The step as one dispatch (kernels/step_gpu.py): scan, stores, both producers, both reducers.
        gated: the writes ask the scan's flags (a fresh stamp); else the host has checked the token and the
        stamp is one no flag ever holds, so nothing the scan finds can hold a write back."""
        if gated:
            self._scans += 1
        stamp = self._scans if gated else NEVER_STAMPED
        n, s = new_states[NOPE], new_states[SWA]  # capacities: the planes' own (no plane grows in this step)
        part_nope, part_swa = self._step_partials
        self._launch(self._step_kernel, self._q_dev, k_dev, v_dev, out_dev, self._token_flags, stamp, p,
                     self._k[NOPE], self._v[NOPE], part_nope, n.origin_logical, n.origin_physical,
                     self._k[SWA], self._v[SWA], part_swa, s.origin_logical, s.origin_physical)

    def _launch_routes(self, p, new_states, routes, q, k_dev, v_dev, out, out_dev):
        """Each route's dispatches (the graph route); returns (layers on a pinned route, their host output)."""
        by_route: dict[str, list[int]] = {}
        for layer, r in enumerate(routes):
            by_route.setdefault(r, []).append(layer)
        vec_layers = [layer for r in ladder.PINNED_ROUTES for layer in by_route.get(r, [])]
        vec_out = out  # GPU (Metal): the bridge's results land on the host, merged into the output below
        if out is None and vec_layers:
            vec_out = np.empty_like(q)
        if ladder.INTERLEAVED in by_route:
            # first: the NoPE layers need no store launch ahead of them (theirs is fused), so on a GPU the
            # device starts work one dispatch into the step's graph and runs it while the host issues the SWA
            # dispatches (docs/PERF.md run 10: Taichi's host issue, ~20-45 us per dispatch, left the device
            # idle while the SWA store and producer were issued)
            self._run_producer(self._interleaved, self._reduce_v2, NOPE, tuple(by_route[ladder.INTERLEAVED]),
                               new_states[NOPE], p, k_dev, v_dev, out_dev)
        if SWA in self.planes:
            st = new_states[SWA]
            grp = self._group(self.planes[SWA].layers)
            # kv_store_f16: every SWA layer stores first; splitk reads the row back from the plane.
            self._launch(self._stores[SWA].store_token, k_dev, v_dev, self._k[SWA], self._v[SWA], grp.layers_dev, grp.slots_dev,
                                          len(grp.layers), st.physical(p))
        if self._serving is not None:
            # llama's cell order is kept up to date on every token, whichever route runs, so the
            # pinned kernel finds the cache llama.cpp would have.
            ring = self._vec_planes(SWA)
            row = new_states[SWA].physical(p)
            self._serving.stage(p, ring[0][:, row], ring[1][:, row])
        if ladder.LLAMA_VEC_SWA in by_route:
            self._run_llama(SWA, tuple(by_route[ladder.LLAMA_VEC_SWA]), new_states[SWA], p, q, vec_out)
        if ladder.LLAMA_VEC_NOPE in by_route:
            layers = tuple(by_route[ladder.LLAMA_VEC_NOPE])
            grp = self._group(layers)
            st = new_states[NOPE]
            # kv_store_batch_f16, then the pinned kernel reads the head-major plane (store first, no bypass)
            self._launch(self._stores[NOPE].store_token, k_dev, v_dev, self._k[NOPE], self._v[NOPE], grp.layers_dev,
                         grp.slots_dev, len(layers), st.physical(p))
            self._run_llama(NOPE, layers, st, p, q, vec_out)
        if ladder.SPLITK in by_route:
            self._run_producer(self._splitk, self._reduce_f32, SWA, tuple(by_route[ladder.SPLITK]),
                               new_states[SWA], p, k_dev, v_dev, out_dev)
        return vec_layers, vec_out

    def rewind(self, position: int) -> None:
        """Drop every token at or after ``position`` (speculative-decoding rollback).

        Refused, with the state unchanged, where a ring has already evicted rows the next token at
        ``position`` would need (a ring only rolls back as far as its slack beyond the window).
        """
        self._check_alive()
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or not 0 <= position <= self.position:
            raise EngineError(f"rewind to {position!r}: expected an integer in [0, {self.position}] (the current position)")
        position = int(position)
        try:
            new_states = {kind: ps.check_rewind(position, self.position) for kind, ps in self.planes.items()}
        except PlaneError as exc:
            raise EngineError(str(exc)) from None
        for kind, st in new_states.items():
            self._set_state(kind, st)  # rows past len are dead: no data moves, in the planes or the mirror
        if self._serving is not None:
            self._serving.forget_from(position)
        self.position = position

    # ---- inspection ----------------------------------------------------------------------------
    def plane_state(self, layer: int) -> PlaneState:
        return self.planes[self.cfg.layer_kinds[layer]].state

    def plane_rows(self, layer: int) -> tuple[np.ndarray, np.ndarray, PlaneState, str]:
        """Copies of one layer's K and V planes (f16), its state and layout, for the reference and tests."""
        kind = self.cfg.layer_kinds[layer]
        slot = self._slot[layer]
        k, v = self.plane_halves(kind)
        return k[slot], v[slot], self.planes[kind].state, LAYOUT_OF[kind]

    def plane_halves(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of a class's K and V planes (every layer of the class), as float16 [..., head_dim]:
        the device keeps them packed two halves to a word (kernels/halves.py), the same bytes."""
        return halves.to_halves(self._k[kind]), halves.to_halves(self._v[kind])

    def planes_snapshot(self) -> dict[str, tuple[np.ndarray, np.ndarray, PlaneState]]:
        """Every class's planes (all layers) and state: compare before/after a rejected call."""
        return {kind: (*self.plane_halves(kind), ps.state) for kind, ps in self.planes.items()}

    def reference(self, q: np.ndarray, k_cur: np.ndarray | None = None, v_cur: np.ndarray | None = None,
                  routes: list[str] | None = None) -> np.ndarray:
        """float64 reference of the last step over the engine's own planes, per layer.

        Layers that took the interleaved route read the current token from k_cur/v_cur (f32), as that
        route does; all others read it back from the f16 plane.
        """
        g = self.cfg
        p = self.position - 1
        routes = self.routes if routes is None else routes
        snap = {kind: self.plane_halves(kind) for kind in self.planes}
        out = np.empty((g.n_layers, g.n_heads, g.head_dim), np.float64)
        for layer, kind in enumerate(g.layer_kinds):
            kp, vp = snap[kind]
            slot = self._slot[layer]
            current = None
            if routes[layer] == ladder.INTERLEAVED and k_cur is not None:
                current = (k_cur[layer], v_cur[layer])
            out[layer] = attend(q[layer], kp[slot], vp[slot], self.planes[kind].state, p, window_of(g, kind),
                                g.attention_scale, LAYOUT_OF[kind], current)
        return out

    def kv_bytes_last_step(self) -> int:
        """KV bytes the last step read: visible rows x bytes per row, summed over layers."""
        p = self.position - 1
        return sum(visible_span(self.cfg, kind, p)[1] for kind in self.cfg.layer_kinds) * self.cfg.kv_bytes_per_row

    # ---- internals -----------------------------------------------------------------------------
    def _host_or_dev(self, a: np.ndarray):
        """On the CPU a numpy array is passed to kernels zero-copy; on GPUs it is uploaded once."""
        if not on_gpu():
            return a
        dev = ti.ndarray(ti.f32, a.shape)
        dev.from_numpy(a)
        return dev

    def _upload(self, dev, a: np.ndarray):
        if not on_gpu():
            return a
        self._transfer.upload(dev, a)
        return dev

    def _ensure_capacity(self, kind: str, capacity: int) -> None:
        ps = self.planes[kind]
        if capacity == ps.state.capacity:
            return
        # Growing plane: copy the live rows into a larger allocation (amortised doubling).
        k_new, v_new = self._alloc_plane(kind, capacity)
        n_slots = len(ps.layers)
        copy = self._stores[kind].copy_rows
        copy(self._k[kind], k_new, n_slots, ps.state.len)
        copy(self._v[kind], v_new, n_slots, ps.state.len)
        self._k[kind], self._v[kind] = k_new, v_new
        if self.mirror is not None:
            self.mirror.grow(kind, capacity)
        self._set_state(kind, ps.state.with_capacity(capacity))

    def _partials_for(self, kind: str, n_group: int, nwg: int):
        """Partials scratch for a group, grown (to a power of two workgroups) when a launch needs more."""
        buf = self._partials.get((kind, n_group))
        if buf is None or buf.shape[2] < nwg:
            cap = max(MAX_WORKGROUPS, 1 << (nwg - 1).bit_length())
            g = self.cfg
            buf = self._partials[kind, n_group] = ti.ndarray(ti.f32, (n_group, g.n_heads, cap, 2 + g.head_dim))
        return buf

    def split_geometry(self, visible: int, n_group: int) -> tuple[int, int]:
        """(workgroups, simdgroups) of a producer launch: the chapter's rule on the CPU; on a GPU the same
        ownership with more workgroups so one launch fills the card (kernels/splitk.py says why)."""
        if self._gpu:
            return gpu_split_geometry(visible, n_group * self.cfg.n_kv_heads, self._gpu_target)
        return splitk_geometry(visible)

    def _producer_launch(self, kind: str, layers, p: int):
        """(group, partials scratch, workgroups, simdgroups) of a producer launch over ``layers`` at ``p``."""
        return (self._group(layers),) + self._producer_split(kind, len(layers), p)

    def _producer_split(self, kind: str, n_layers: int, p: int):
        """(partials scratch, workgroups, simdgroups) of a producer launch over n_layers of a class at ``p``."""
        _, visible = visible_span(self.cfg, kind, p)
        nwg, nsg = self.split_geometry(visible, n_layers)
        assert not self._gpu or n_layers * self.cfg.n_kv_heads * nwg <= self._items_cap  # the producers' bound
        return self._partials_for(kind, n_layers, nwg), nwg, nsg

    def _run_producer(self, producer, reduce, kind, layers, st: PlaneState, p, k_dev, v_dev, out_dev):
        grp, partials, nwg, nsg = self._producer_launch(kind, layers, p)
        self._launch(producer, self._q_dev, k_dev, v_dev, self._k[kind], self._v[kind], partials, self._no_visits,
                 grp.layers_dev, grp.slots_dev, len(layers), p, window_of(self.cfg, kind), st.capacity,
                 st.origin_logical, st.origin_physical, nwg, nsg, self.cfg.attention_scale)
        self._launch(reduce, partials, out_dev, grp.layers_dev, len(layers), nwg)

    def _host_plane(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """Zero-copy numpy views of a class's K and V planes (CPU backend: Taichi's own memory)."""
        from .ggml_flash_attn import taichi_plane

        views = []
        for arr in (self._k[kind], self._v[kind]):
            raw = taichi_plane(arr)
            buf = (ctypes.c_uint16 * raw.n_elems).from_address(raw.addr)
            views.append(np.frombuffer(buf, dtype=np.float16).reshape(halves.halves_shape(arr)))
        return views[0], views[1]

    def _llama_runner(self, n_nodes: int):
        runner = self._llama_runners.get(n_nodes)
        if runner is None:
            from .ggml_flash_attn import GgmlFlashAttn

            g = self.cfg
            runner = GgmlFlashAttn(g.head_dim, g.n_heads, g.n_kv_heads, g.attention_scale,
                                   llama_rung.default_threads(), n_nodes=n_nodes)
            self._llama_runners[n_nodes] = runner
        return runner

    def _vec_planes(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """The K/V planes the vec routes read: the mirror when there is one, else the planes in place (CPU)."""
        if self.mirror is not None:
            return self.mirror.k[kind], self.mirror.v[kind]
        return self._host_plane(kind)

    def _run_llama(self, kind: str, layers: tuple[int, ...], st: PlaneState, p: int, q: np.ndarray, out) -> None:
        """llama.cpp's vec kernel over the planes (or their mirror) in place: one dispatch for the route's layers."""
        views = self._vec_views(kind, layers, st, p)
        self.launches_last_step += 1
        if self._bridge_runner is not None:  # Metal: the bridge over the mirror's buffers
            result = self._bridge_runner.attend_many(q[list(layers)], views)
        else:
            result = self._llama_runner(len(layers)).attend_many(q[list(layers)], views)
        out[list(layers)] = result

    def _vec_views(self, kind: str, layers: tuple[int, ...], st: PlaneState, p: int) -> list:
        """One KVView per layer: what the vec kernel reads for the token at ``p`` (planes in state ``st``)."""
        from .ggml_flash_attn import KVView

        g = self.cfg
        kp, vp = self._vec_planes(kind)
        views = []
        for layer in layers:
            slot = self._slot[layer]
            if kind == SWA and self._serving is not None:
                n_kv, mask = self._serving.view(p)
                k_plane, v_plane, first = self._serving.k[slot], self._serving.v[slot], 0
            elif kind == SWA:
                first, n_kv, mask = llama_rung.ring_view(st, p, g.window)
                k_plane, v_plane = kp[slot], vp[slot]
            else:
                first, n_kv, mask = 0, p + 1, None
                k_plane, v_plane = kp[slot], vp[slot]
            # row stride: a full token row (n_kv*head_dim halves) token-major, one head row head-major
            rs, hs = (g.n_kv_heads * g.head_dim, g.head_dim) if kind == SWA else (g.head_dim, st.capacity * g.head_dim)
            views.append(KVView(k_plane, v_plane, first, n_kv, rs, hs, mask))
        return views

    def _launch(self, kernel, *args):
        self.launches_last_step += 1
        if getattr(self, "_recorded", None) is not None:
            self._recorded.append((kernel, args))
        else:
            kernel(*args)

    def _replay(self, dispatches, external=()) -> None:
        """Run a list of dispatches as one compiled ti.graph (replay.py: keys, arguments, costs)."""
        self._graphs.run(dispatches, external)

    # ---- snapshots (muser_ti/snapshot.py) ------------------------------------------------------
    def save(self, path) -> None:
        """Write this session (planes, origins, position, geometry) to a safetensors file, atomically."""
        from .snapshot import save_engine

        save_engine(self, path)

    def load(self, path) -> None:
        """Replace this session with a saved one; a bad or mismatched file is refused, state unchanged."""
        from .snapshot import restore_into

        restore_into(self, path)

    @classmethod
    def from_snapshot(cls, path, arch: str = "auto", pinned: str = "auto", graph: str | None = None,
                      force=None, mirror: str | None = None) -> "Engine":
        """A new engine holding the session saved in ``path`` (its geometry and session capacity)."""
        from .snapshot import load_engine

        return load_engine(path, arch=arch, pinned=pinned, graph=graph, force=force, mirror=mirror)
