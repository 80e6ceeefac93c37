"""The engine: encodes one decode token through the ladder (the chapter's encode_token).

Per token, three stages, in this order:

1. **validate** the inputs (muser_ti/inputs.py);
2. **plan**: every plane's state after the append, then the ladder per layer on that state
   (muser_ti/ladder.py) - nothing is written yet;
3. **commit**: the device writes and the attention, one launch sequence per route for *all* layers on
   that route (muser_ti/launch.py), then the cache's bookkeeping (muser_ti/kv_cache.py).

A rejected token (bad input, a forced route whose predicate fails, a plane that cannot hold its window)
raises in stage 1 or 2: the cache is exactly as it was.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from . import backend, inputs, interrupts, ladder
from .config import Geometry
from .errors import EngineError, PinnedUnavailable, PlaneError
from .config import NOPE
from .kv_cache import LAYOUT_OF, KVCache
from .kernels.token_scan import REFUSAL_RING
from .device_checks import InFlight
from .launch import Launcher
from .layer_launch import LAUNCH_PATHS
from .pinned import AUTO_REASON, mirror as plane_mirror, pinned_status
from .pinned.vec import VecRung
from .planes import PlaneState, visible_span
from .reference import gather, over_planes
from .token import Prompt, Token

GRAPHS = ("teacher", "serving")
PINNED_MODES = ("auto", "on", "off")
DEVICE_CHECKS = ("per_token", "deferred")


_atomically = interrupts.atomically


def pinned_library_status(arch: str = "auto") -> tuple[bool, str]:
    """(loaded, description): can llama.cpp's vec kernel read planes on ``arch`` in this process?"""
    return pinned_status(arch)


class Engine:
    """Decode attention over a model's planes, route by route.

    arch: "auto" | "cpu" | "cuda" | "vulkan" | "metal"; pinned: "auto" (the project's own routes wherever the
    pinned rung's numerics cannot be trusted on every accepted input: everywhere today, pinned/__init__.py) |
    "on" (llama.cpp's kernel where it is loaded: its bits, its bound) | "off";
    graph: "teacher" (read wrapped rings directly) | "serving" (llama's cell order; needs the pinned rung).
    force: a route name (for the layers of its class) or {layer: route}, for diagnosis.  A forced route
    whose predicate fails raises RouteError at the step, before anything is written.
    capacity: per-session override of every plane's capacity (a "deliberately tiny raw session" when < 32).
    mirror: None | "host".  Mirror planes (muser_ti/pinned/mirror.py, ``eng.mirror``): a second copy of every
    plane, written on every store, that the vec routes read instead of the planes.  On arch="metal" with
    the pinned rung loaded the engine always keeps one, in bridge buffers (never run: no macOS here);
    "host" keeps one in numpy memory on any arch, to test the bookkeeping off macOS.
    device_checks: "per_token" | "deferred", how step_device learns that the device refused a token
    (step_device says how).
    launch: how a per-layer token's kernels go out (Engine.token): "auto" (compiled, through Taichi's C-API, on
    the CPU and CUDA; Taichi's Python launch path elsewhere, or with one warning where the C-API cannot load) |
    "capi" (the C-API or an error) | "python".  The same kernels either way: the same bits.
    """

    def __init__(self, cfg: Geometry, arch: str = "auto", pinned: str = "auto", graph: str = "teacher",
                 force: str | dict | None = None, capacity: int | None = None, mirror: str | None = None,
                 device_checks: str = "per_token", launch: str = "auto", pool_slot: tuple | None = None):
        inputs.choice("pinned", pinned, PINNED_MODES)
        inputs.choice("launch", launch, LAUNCH_PATHS)
        inputs.choice("device_checks", device_checks, DEVICE_CHECKS)
        inputs.choice("graph", graph, GRAPHS)
        capacity = inputs.capacity(cfg, capacity)
        inputs.choice("mirror", mirror, plane_mirror.MIRRORS)
        loaded, why = pinned_library_status(arch)
        if pinned == "on" and not loaded:
            raise PinnedUnavailable(f"pinned='on' but the pinned library is not loaded: {why}")
        if pinned == "off":
            loaded, why = False, "disabled (pinned='off')"
        elif pinned == "auto" and loaded:
            loaded, why = False, f"{why} is there, but {AUTO_REASON}"
        if graph == "serving" and not loaded:
            raise PinnedUnavailable(
                f"graph='serving' stages SWA rows into llama.cpp's cell order for the pinned kernel, which is "
                f"not in use: {why}")
        self.cfg = cfg
        self.arch = backend.activate(arch)
        self.pinned_loaded, self.pinned_description = loaded, why
        self.graph = graph
        self._forced = ladder.parse_force(force, cfg.layer_kinds)
        self._routes = ladder.RouteLog(cfg.layer_kinds)
        backing = plane_mirror.backing_for(self.arch, loaded, mirror)
        # pool_slot: (PlanePool, slot) where a Batch holds this engine's planes in its pool (plane_pool.py)
        self.cache = KVCache(cfg, capacity, backing, serving=graph == "serving", pool_slot=pool_slot)
        self.vec = VecRung(cfg, self.cache, backing.runner(cfg) if backing is not None else None)
        self.launcher = Launcher(cfg, self.cache, self.vec, launch)
        self.device_checks = device_checks
        self._in_flight = InFlight()  # deferred checks: the steps since the host last looked
        self._serial = 0  # commits so far: what makes a retried commit count its token once (RouteLog.record)
        self._open = None  # the per-layer token or prompt being run (token.py), which holds every other call off

    # ---- state the user reads --------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Absolute position of the next token."""
        return self.cache.position

    @property
    def planes(self):
        """{layer class: PlaneSet}: every class's plane state (len, capacity, origins) and its cap."""
        return self.cache.planes

    @property
    def mirror(self):
        return self.cache.mirror

    @property
    def launches_last_step(self) -> int:
        """Kernel launches the last step made (does not grow with the layer count)."""
        return self.launcher.launches

    @property
    def one_dispatch_step(self) -> bool:
        """True where a step on the default routes runs as one dispatch (CUDA, Vulkan; kernels/one_dispatch.py)."""
        return self.launcher.step_kernel is not None

    @property
    def routes(self) -> list:
        """Each layer's route for the last token."""
        return self._routes.last

    @routes.setter
    def routes(self, routes) -> None:
        self._routes.last = list(routes)

    @property
    def route_counts(self) -> Counter:
        """Layer-steps per route over every accepted token (restored with a snapshot); a new Counter on
        every read.  With deferred checks it counts the steps in flight until the next sync()."""
        return self._routes.counts()

    @route_counts.setter
    def route_counts(self, counts) -> None:
        self._routes.restore(counts)

    def split_geometry(self, visible: int, n_group: int) -> tuple[int, int]:
        """(workgroups, simdgroups) of a producer launch over n_group layers (launch.py)."""
        return self.launcher.split_geometry(visible, n_group)

    # ---- the public API --------------------------------------------------------------------------
    def prefill(self, k: np.ndarray, v: np.ndarray) -> None:
        """Append tokens without attention; k, v: float32 [n_tokens, n_layers, n_kv_heads, head_dim]."""
        self._settle()
        k, v = inputs.prefill_tokens(self.cfg, k, v)
        n = k.shape[0]
        if n == 0:
            return
        if self.position + n > self.cfg.max_context:
            raise EngineError(f"prefill of {n} tokens at position {self.position} passes max_context={self.cfg.max_context}")
        start, states, new_states = self.position, self.cache.states(), self._planned(self.cache.plan_prefill, n)

        def commit():
            self.cache.write_prefill(k, v, states, new_states, start, self.launcher.host_or_dev)
            self.cache.commit(new_states, start + n)

        _atomically(commit)

    def step(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Attend one token: q [n_layers, n_heads, head_dim], k/v [n_layers, n_kv_heads, head_dim] -> like q."""
        self._settle()
        q, k, v = inputs.step_token(self.cfg, q, k, v)
        return self._commit(self._plan(), q, k, v)

    def step_device(self, q, k, v, out):
        """Attend one token with the activations on the device: q, k, v and out are Taichi float32
        ndarrays of step()'s shapes; the output is written into ``out``, which is returned.

        Nothing crosses to the host but a few flags: one kernel scans q, k and v for non-finite values
        and for k/v outside the f16 planes' range, so bad input is refused as step() refuses it with the
        cache and ``out`` unchanged.  device_checks="per_token" (the default) reads the flags after every
        token, one device wait, and raises for a refused token at once, with step()'s message.
        device_checks="deferred" reads them only where the host synchronises anyway (sync(), step,
        prefill, rewind, save, load, the inspection methods): the device holds back every write after a
        refused token, and that call raises for the first refused token and rolls the engine back to just
        before it (position, plane states, routes), as CUDA reports an asynchronous error late.  Deferred
        checks apply to one-dispatch steps (CUDA, Vulkan); any other step looks at the flags first.
        Steps that need the activations on the host (a pinned llama.cpp route, mirror planes) copy them.
        """
        self.cache.check_alive()
        self._check_none_open()
        inputs.device_token(self.cfg, {"q": q, "k": k, "v": v, "out": out})
        launcher, checks = self.launcher, self.launcher.checks
        if self.device_checks == "deferred" and checks.unlooked >= REFUSAL_RING:
            self.sync()  # the device keeps every token's flags for REFUSAL_RING scans
        try:
            plan = self._plan()
        except EngineError:
            self.sync()
            checks.scan_token(q, k, v)  # a bad token is named before a full cache, as step() names it
            raise
        p, new_states, routes, mix = plan
        if launcher.one_dispatch_fits(new_states, routes, bool(self._forced)):
            if self.device_checks == "deferred":
                self._in_flight.add(checks.scans + 1, p, self.cache.states(), self.routes, mix)
                self._commit(plan, None, None, None, device=(q, k, v, out), gate="deferred")
            else:  # the scan is the step's first task and gates its writes; the flags are read after it
                self._commit(plan, None, None, None, device=(q, k, v, out), gate="token")
            return out
        self.sync()
        checks.scan_token(q, k, v)
        if self.cache.mirror is not None or any(r in ladder.PINNED_ROUTES for r in routes):
            launcher.transfer.upload(out, self._commit(plan, *launcher.download_token(q, k, v)))
        else:
            self._commit(plan, None, None, None, device=(q, k, v, out))
        launcher.launches += 1  # the scan
        return out

    def sync(self) -> None:
        """Wait for the device and look at the flags of every step_device token not yet looked at (deferred
        checks): raise for the first refused one, the engine rolled back to just before it."""
        self.cache.check_alive()
        if self._in_flight:
            self._in_flight.settle(self.launcher.checks.look(), self.cache, self._routes)

    def rewind(self, position: int) -> None:
        """Drop every token at or after ``position`` (speculative-decoding rollback).

        Refused, with the state unchanged, where a ring has already evicted rows the next token at
        ``position`` would need (a ring only rolls back as far as its slack beyond the window).
        """
        self._settle()
        position = inputs.position("rewind", position, self.position)
        new_states = self._planned(self.cache.plan_rewind, position)
        _atomically(lambda: self.cache.rewind(position, new_states))

    def clear(self) -> None:
        """An empty session on the planes this engine has (nothing allocated or freed): position 0, no route counts.
        A batch's slot is reused this way (muser_ti/batch.py)."""
        self._settle()
        _atomically(self.cache.clear)
        self._routes = ladder.RouteLog(self.cfg.layer_kinds)

    def reserve(self, tokens: int) -> None:
        """Allocate every growing plane for ``tokens`` rows now (at most its limit, max_context) rather than as the
        session grows: a batch's pool is sized up front this way.  The same bits either way: a plane's size only
        sets where its rows live."""
        self._settle()
        tokens = inputs.integer("reserve tokens", tokens)
        for kind, ps in self.cache.planes.items():
            want = min(max(tokens, 1), ps.cap)
            if kind == NOPE and want > ps.state.capacity:
                self.cache.ensure_capacity(kind, want)

    def token(self, n: int = 1) -> Token:
        """Open the next token (n tokens: a verify pass) for attention one layer at a time, as a model's forward
        calls it (token.py)::

            with eng.token() as t:
                out_l = t.attend(layer, q_l, k_l, v_l)   # q_l [n_heads, head_dim], k_l/v_l [n_kv_heads, head_dim]

        Layers attend in order, each once; the token commits at the block's end when every layer has, and an
        exception between layers leaves the engine exactly as before it.  Same routes and output bits as
        step() for the same token.  Without a with-block: t.commit() after the last layer, or t.abandon()."""
        return Token(self, n)

    def prompt(self, n: int) -> Prompt:
        """Open a prompt of n tokens whose K/V arrive layer by layer, with no attention (the framework's own
        attention computes the prompt's outputs): ``with eng.prompt(n) as pr: pr.store(layer, k_l, v_l)``;
        it commits as one prefill (ring wrap and NoPE growth as prefill()) once every layer has stored."""
        return Prompt(self, n)

    @property
    def open_token(self):
        """The per-layer token or prompt being run, or None."""
        return self._open

    def _check_none_open(self) -> None:
        if self._open is not None:
            raise EngineError(f"{self._open.describe()}: finish it (every layer, then commit) or abandon() it first")

    def cached_kv(self, layer: int, start: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 copies (k, v) [n, n_kv_heads, head_dim] of tokens start..position-1 as ``layer``'s plane holds
        them (f16): what a framework's own attention needs for a multi-token forward after the prompt."""
        layer = inputs.integer("cached_kv layer", layer)
        if not 0 <= layer < self.cfg.n_layers:
            raise EngineError(f"cached_kv layer {layer}: expected a layer in [0, {self.cfg.n_layers})")
        start = inputs.position("cached_kv start", start, self.position)
        k, v, st, layout = self.plane_rows(layer)
        if start < st.origin_logical:
            raise EngineError(f"cached_kv layer {layer} from {start}: the plane holds tokens {st.origin_logical}.."
                              f"{st.origin_logical + st.len - 1} only (a ring keeps its window and slack)")
        logicals = np.arange(start, self.position)
        return (gather(k, st, logicals, layout).astype(np.float32), gather(v, st, logicals, layout).astype(np.float32))

    # ---- plan, then commit -----------------------------------------------------------------------
    def _settle(self) -> None:
        """A point where the host synchronises: the engine must be alive, no per-layer token open, and every
        deferred check looked at."""
        self.cache.check_alive()
        self._check_none_open()
        if self._in_flight:
            self.sync()

    @staticmethod
    def _planned(plan, *args):
        try:
            return plan(*args)
        except PlaneError as exc:
            raise EngineError(str(exc)) from None

    def _plan(self):
        """(position, plane states after the append, route per layer, the routes as a tuple: route_counts'
        key), or raise with nothing written."""
        p = self.position
        if p >= self.cfg.max_context:
            raise EngineError(f"position {p} is past max_context={self.cfg.max_context}")
        new_states = self._planned(self.cache.plan_append)
        return (p, new_states, *self._routes_for(new_states))

    def _plan_tokens(self, n: int) -> list[tuple]:
        """_plan for the next n tokens, each on the states the ones before it leave (Engine.token(n)).  A growing
        plane gets, for every token, the capacity the last needs: it grows once, when the token opens (its
        rows keep their places, so the addressing and the ladder's choice are what n steps would give)."""
        states, planned = self.cache.states(), []
        for i in range(n):
            p = self.position + i
            if p >= self.cfg.max_context:
                raise EngineError(f"position {p} is past max_context={self.cfg.max_context}")
            states = self._planned(lambda: {kind: ps.check_append(p, states[kind])
                                            for kind, ps in self.cache.planes.items()})
            planned.append((p, states))
        final = planned[-1][1]
        plans = []
        for p, states in planned:
            states = {kind: st if kind != NOPE or st.capacity == final[kind].capacity else
                      st.with_capacity(final[kind].capacity) for kind, st in states.items()}
            plans.append((p, states, *self._routes_for(states)))
        return plans

    def _routes_for(self, new_states) -> tuple[list, tuple]:
        """(route per layer, the routes as a tuple) on the plane states after the append."""
        strict = ladder.strict_attention()
        # the ladder depends on the layer's class and plane state only, so it is evaluated once per class;
        # forced layers are checked one by one
        chosen = {kind: ladder.choose_route(kind, st, self.pinned_loaded, strict) for kind, st in new_states.items()}
        if self._forced:
            routes = [chosen[kind] if layer not in self._forced else
                      ladder.select(kind, new_states[kind], self.pinned_loaded, strict, self._forced[layer], layer)
                      for layer, kind in enumerate(self.cfg.layer_kinds)]
            used, mix = set(routes), tuple(routes)
        else:  # every layer takes its class's route: one tuple per route mix, listed anew (users may edit .routes)
            used, mix = tuple(chosen.values()), self._routes.mix_of(chosen)
            routes = list(mix)
        pinned = sorted({r for r in used if r in ladder.PINNED_ROUTES})
        if pinned and not self.pinned_loaded:
            raise PinnedUnavailable(
                f"the ladder chose {pinned} ({ladder.STRICT_ENV} set or pinned forced) but the pinned library is not "
                f"loaded: {self.pinned_description}")
        return routes, mix

    def _commit(self, plan, q, k, v, device=None, gate=None):
        """Write and attend the accepted token.  q, k, v: checked host arrays; or device = (q, k, v, out)
        ndarrays, with out receiving the result (then nothing is returned), checked on the device already or,
        with ``gate`` ("token", "deferred"), by the one-dispatch step's first task (Launcher.one_dispatch): a
        refused token then leaves the planes, ``out`` and, once the host has looked, the engine as they were.
        Atomic (_atomically): an interrupt or any exception leaves the token written and counted, or neither."""
        p, new_states, routes, mix = plan
        self._serial += 1
        serial, launcher, checks = self._serial, self.launcher, self.launcher.checks
        result = []

        def commit():
            result[:] = [self._attend(plan, q, k, v, device, gate)]
            if gate == "token" and checks.flagged():
                return  # the device refused it and wrote nothing: the engine stays as it was (raised below)
            self.cache.commit(new_states, p + 1)
            self._routes.record(routes, mix, serial)

        _atomically(commit)
        if gate == "token" and checks.flagged():
            checks.refuse(*device[:3])
        out, vec_layers, vec_out = result[0]
        if device is not None:
            return None
        if out is None:
            out = launcher.download_out()
            if vec_layers:
                out[vec_layers] = vec_out[vec_layers]
        return out

    def _attend(self, plan, q, k, v, device, gate):
        """The token's device writes and attention, without a change to the engine's bookkeeping: the rows
        stored (after any growth), the partials and the output, which come out the same however often it runs."""
        p, new_states, routes, mix = plan
        cache, launcher = self.cache, self.launcher
        one_dispatch = gate is not None or launcher.one_dispatch_fits(new_states, routes, bool(self._forced))
        launcher.begin()
        for kind, st in new_states.items():
            cache.ensure_capacity(kind, st.capacity)
        if device is None:
            # every route stores this token's row in every layer (a store kernel, or fused into the
            # interleaved producer): the mirror gets the same row, before anything reads it
            cache.mirror_token(new_states, k, v, p)
            k_dev, v_dev = launcher.upload(q, k, v)
            out = np.empty_like(q) if not launcher.gpu else None
            out_dev = out if out is not None else launcher.out
        else:
            launcher.q_dev, k_dev, v_dev, out_dev = device
            out = None
        vec_layers, vec_out = [], out
        if one_dispatch:
            launcher.one_dispatch(p, new_states, k_dev, v_dev, out_dev, gate or "open")
        else:
            vec_layers, vec_out = launcher.routes(p, new_states, routes, q, k_dev, v_dev, out, out_dev)
        launcher.finish(external=device or ())
        return out, vec_layers, vec_out

    # ---- inspection --------------------------------------------------------------------------------
    def plane_state(self, layer: int) -> PlaneState:
        return self.cache.planes[self.cfg.layer_kinds[layer]].state

    def plane_rows(self, layer: int) -> tuple[np.ndarray, np.ndarray, PlaneState, str]:
        """Copies of one layer's K and V planes (f16), its state and layout, for the reference and tests."""
        self._settle()
        kind = self.cfg.layer_kinds[layer]
        k, v = self.cache.halves(kind)
        slot = self.cache.slot[layer]
        return k[slot], v[slot], self.cache.planes[kind].state, LAYOUT_OF[kind]

    def plane_halves(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of a class's K and V planes (every layer of the class), as float16 [..., head_dim]."""
        self._settle()
        return self.cache.halves(kind)

    def planes_snapshot(self) -> dict[str, tuple[np.ndarray, np.ndarray, PlaneState]]:
        """Every class's planes (all layers) and state: compare before/after a rejected call."""
        self._settle()
        return {kind: (*self.cache.halves(kind), ps.state) for kind, ps in self.cache.planes.items()}

    def reference(self, q: np.ndarray, k_cur: np.ndarray | None = None, v_cur: np.ndarray | None = None,
                  routes: list[str] | None = None) -> np.ndarray:
        """float64 reference of the last step over the engine's own planes, per layer (reference.over_planes:
        layers that took the interleaved route read the current token from k_cur/v_cur, as that route does)."""
        if routes is None and any(route is None for route in self.routes):
            raise EngineError("reference(): no step has run yet; it is the float64 reference of the last step, so "
                              "call step(q, k, v) first and pass reference() the same q, k and v")
        self._settle()
        return over_planes(self.cfg, self.cache, self.routes if routes is None else routes, q, k_cur, v_cur)

    def kv_bytes_last_step(self) -> int:
        """KV bytes the last step read: visible rows x bytes per row, summed over layers."""
        p = self.position - 1
        return sum(visible_span(self.cfg, kind, p)[1] for kind in self.cfg.layer_kinds) * self.cfg.kv_bytes_per_row

    # ---- snapshots (muser_ti/snapshot.py) ------------------------------------------------------------
    def save(self, path) -> None:
        """Write this session (planes, origins, position, geometry) to a safetensors file, atomically."""
        from . import snapshot

        snapshot.save(path, self.cfg, *self.snapshot_contents())

    def snapshot_contents(self) -> tuple[dict[str, np.ndarray], dict]:
        """(tensors, session): the cache's state_dict with the session's graph, route counts and routes."""
        self._settle()
        tensors, meta = self.cache.state_dict()
        return tensors, {**meta, "graph": self.graph, "route_counts": dict(self.route_counts), "routes": list(self.routes)}

    def load(self, path) -> None:
        """Replace this session with a saved one; a bad or mismatched file is refused, state unchanged."""
        from . import snapshot

        self._settle()
        snap = snapshot.read(path)
        snapshot.check_fits(snap, self.cache)
        self._restore(snap)

    def _restore(self, snap) -> None:
        def commit():
            self.cache.load_state_dict(snap.tensors, snap.load_meta)
            self.route_counts = Counter(snap.meta["route_counts"])
            self.routes = list(snap.meta["routes"])

        _atomically(commit)

    @classmethod
    def from_snapshot(cls, path, arch: str = "auto", pinned: str = "auto", graph: str | None = None,
                      force=None, mirror: str | None = None, device_checks: str = "per_token") -> "Engine":
        """A new engine holding the session saved in ``path`` (its geometry and session capacity); ``graph``
        defaults to the graph the session was saved from."""
        from . import snapshot

        snap = snapshot.read(path)
        engine = cls(snap.geometry, arch=arch, pinned=pinned, graph=graph or snap.meta["graph"], force=force,
                     capacity=snap.session_capacity, mirror=mirror, device_checks=device_checks)
        snapshot.check_fits(snap, engine.cache)
        engine._restore(snap)
        return engine
