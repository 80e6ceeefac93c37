"""How a step's kernels go out: the built kernels, the split geometry, the partials scratch, the token's
arrays on the device, graph record and replay, and the one-dispatch step.

Every layer on one route shares one launch sequence (store, producer, reducer), so a token costs the
same few launches whatever the layer count.  On a GPU a step's dispatches are recorded and replayed as
one compiled ``ti.graph`` (replay.py); on CUDA and Vulkan a step with both layer classes on their own
routes that grows no plane is one dispatch instead (kernels/one_dispatch.py), gated on the token scan.
"""

from __future__ import annotations

import numpy as np
import taichi as ti

from . import backend, inputs, ladder
from .config import NOPE, SWA, Geometry
from .device_checks import DeviceChecks
from .errors import EngineError
from .kernels.common import MAX_WORKGROUPS, on_gpu
from .kernels.interleaved import build_interleaved
from .kernels.split_geometry import (cpu_serial, cpu_split_geometry, gpu_items_cap, gpu_split_geometry,
                                     gpu_target_workgroups, gpu_workgroups_per_pair)
from .kernels.splitk import build_splitk
from .kernels.one_dispatch import ONE_DISPATCH_ARCHS, build_step_kernel
from .kernels.reducer import build_reduce
from .kernels.stores import build_unpack
from .kernels.token_scan import FLAG_CELLS, NEVER_STAMPED, OPEN_GATE
from .kv_cache import KVCache
from .planes import PlaneState, visible_span, window_of
from .replay import GraphReplay
from .transfer import Transfer


class Launcher:
    """An engine's kernels and launch plumbing over its cache; ``vec``: the pinned rung's side (or None)."""

    def __init__(self, cfg: Geometry, cache: KVCache, vec=None, launch: str = "auto"):
        self.cfg, self.cache, self.vec = cfg, cache, vec
        self.launch_path = launch  # a per-layer token's: layer_launch.LAUNCH_PATHS
        self._compiled = False  # the compiled per-layer path (layer_launch.CompiledLayers), made on first use
        self.gpu = gpu = on_gpu()
        D, G, KV, H, L = cfg.head_dim, cfg.heads_per_kv, cfg.n_kv_heads, cfg.n_heads, cfg.n_layers
        # the split's workgroup target, fixed for the engine: its producers' loop bound follows from it
        self.target = gpu_target_workgroups() if gpu else 0
        self.items_cap = gpu_items_cap(self.target, L * KV) if gpu else 0
        caps = dict(items_cap=self.items_cap, layers_cap=L if gpu else 0)  # constant loop bounds on a GPU
        self.splitk, self.reduce_f32, self.reduce_f16 = build_splitk(D, G, KV, H, gpu, **caps)
        self.interleaved, self.reduce_v2 = build_interleaved(D, G, KV, H, gpu, **caps)
        # one layer's merge (a per-layer token) on the CPU: the same reducers on one thread (kernels/reducer.py)
        self.reduce_one = {} if gpu else {red: build_reduce(D, H, False, ti.f32, serial=True)
                                          for red in (self.reduce_f32, self.reduce_v2)}
        # and its producer at short context, where waking the thread pool costs more than a core's arithmetic
        # (split_geometry.cpu_serial); compiled on first use
        self.producer_one = {} if gpu else {self.splitk: build_splitk(D, G, KV, H, False, serial=True)[0],
                                            self.interleaved: build_interleaved(D, G, KV, H, False, serial=True)[0]}
        # (class, group size) -> [n_group, H, workgroups, 2 + D] scratch: one per class, as the one-dispatch
        # step runs both producers before either reducer
        self._partials: dict[tuple[str, int], object] = {}
        self._no_visits = ti.ndarray(ti.i32, (1, 1))
        self.shapes = inputs.token_shapes(cfg)
        self.out = ti.ndarray(ti.f32, self.shapes["out"])
        self.q, self.k_cur, self.v_cur = (ti.ndarray(ti.f32, self.shapes[n]) for n in ("q", "k", "v"))
        self.q_dev = self.q  # the queries the producers read this step (step_device's own array, or self.q)
        self.transfer = Transfer()  # per-token copies: the CUDA driver's memcpy where it can (transfer.py)
        # Where host copies go through Taichi (Vulkan, Metal), each synchronises the device; there q, k and v
        # go up packed, as the host-array argument of the kernel that unpacks them, which needs no wait
        self.unpack = build_unpack(H, KV, D) if gpu and self.transfer.path == "taichi" else None
        self.graphs = GraphReplay()  # GPU: compiled step graphs by dispatch structure
        # the token scan and its flags (device_checks.py); the one-dispatch step's layer table follows the flags
        self.checks = DeviceChecks(cfg, self.transfer, self.graphs, gpu, self.download_token, extra_cells=L)
        self.recorded = None  # the step's dispatches while a GPU step is being recorded
        self.launches = 0  # kernel launches of the last step (does not grow with the layer count)
        self.step_kernel = None  # CUDA, Vulkan: a step on the default routes is one dispatch
        self._layer_host = self._layer_dev = None  # a per-layer token's arrays (attend_layer_host), made on first use
        # (not on a batch's pooled planes: the one-dispatch step addresses a class's planes from slot 0)
        if (gpu and backend.active() in ONE_DISPATCH_ARCHS and SWA in cache.planes and NOPE in cache.planes
                and cache.pool is None):
            nope, swa = cache.planes[NOPE].layers, cache.planes[SWA].layers
            self.step_kernel = build_step_kernel(D, G, KV, H, len(nope), len(swa), cfg.attention_scale,
                                                 window_of(cfg, NOPE), window_of(cfg, SWA), self.target)
            table = np.zeros(FLAG_CELLS + L, np.int32)  # its layer table, after the flags: NoPE, then SWA layers
            table[FLAG_CELLS:] = nope + swa
            self.checks.flags.from_numpy(table)
            # and partials for the most workgroups that split can give, made once
            self.step_partials = [self.partials_for(kind, len(layers), gpu_workgroups_per_pair(len(layers) * KV,
                                                                                               self.target))
                                  for kind, layers in ((NOPE, nope), (SWA, swa))]

    # ---- split geometry and scratch ------------------------------------------------------------
    def split_geometry(self, visible: int, n_group: int) -> tuple[int, int]:
        """(workgroups, simdgroups) of a producer launch: the chapter's block ownership, with as many
        workgroups as fill the machine: on the CPU fewer than the chapter's, on a GPU more (kernels/split_geometry.py
        says why)."""
        if self.gpu:
            return gpu_split_geometry(visible, n_group * self.cfg.n_kv_heads, self.target)
        return cpu_split_geometry(visible, n_group * self.cfg.n_kv_heads)

    def serial_layer(self, visible: int) -> bool:
        """Whether one layer's producer runs on the launching thread (the CPU at short context: cpu_serial)."""
        return not self.gpu and cpu_serial(visible, self.cfg.n_kv_heads)

    def partials_for(self, kind: str, n_group: int, nwg: int):
        """Partials scratch for a group, grown (to a power of two workgroups) when a launch needs more."""
        buf = self._partials.get((kind, n_group))
        if buf is None or buf.shape[2] < nwg:
            cap = max(MAX_WORKGROUPS, 1 << (nwg - 1).bit_length())
            g = self.cfg
            buf = self._partials[kind, n_group] = ti.ndarray(ti.f32, (n_group, g.n_heads, cap, 2 + g.head_dim))
        return buf

    def producer_split(self, kind: str, n_layers: int, p: int):
        """(partials scratch, workgroups, simdgroups) of a producer launch over n_layers of a class at ``p``."""
        _, visible = visible_span(self.cfg, kind, p)
        nwg, nsg = self.split_geometry(visible, n_layers)
        assert not self.gpu or n_layers * self.cfg.n_kv_heads * nwg <= self.items_cap  # the producers' bound
        return self.partials_for(kind, n_layers, nwg), nwg, nsg

    # ---- launching -----------------------------------------------------------------------------
    def launch(self, kernel, *args) -> None:
        self.launches += 1
        if self.recorded is not None:
            self.recorded.append((kernel, args))
        else:
            kernel(*args)

    def run_producer(self, producer, reduce, kind: str, layers: tuple[int, ...], st: PlaneState, p: int, k_dev,
                     v_dev, out_dev) -> None:
        grp = self.cache.group(layers)
        partials, nwg, nsg = self.producer_split(kind, len(layers), p)
        self.launch(producer, self.q_dev, k_dev, v_dev, self.cache.k[kind], self.cache.v[kind], partials,
                    self._no_visits, grp.layers_dev, grp.slots_dev, len(layers), p, window_of(self.cfg, kind),
                    st.capacity, st.origin_logical, st.origin_physical, nwg, nsg, self.cfg.attention_scale)
        self.launch(reduce, partials, out_dev, grp.layers_dev, len(layers), nwg)

    def begin(self) -> None:
        """A step's launches start: counted from 0, and recorded for one graph on a GPU."""
        self.launches = 0
        self.recorded = [] if self.gpu else None

    def finish(self, external=()) -> None:
        """Replay the step's recorded dispatches as one compiled ti.graph (replay.py: keys, arguments)."""
        if self.recorded is not None:
            recorded, self.recorded = self.recorded, None
            self.graphs.run(recorded, external)

    def one_dispatch_fits(self, new_states: dict[str, PlaneState], routes, forced: bool) -> bool:
        """The step can be the one dispatch: both classes on their default routes, device planes, no growth."""
        cache = self.cache
        if self.step_kernel is None or cache.mirror is not None or cache.serving is not None or forced:
            return False
        g = self.cfg
        if routes[g.nope_layers[0]] != ladder.INTERLEAVED or routes[g.swa_layers[0]] != ladder.SPLITK:
            return False  # without forced layers a class's layers share its route (Engine._plan)
        return all(st.capacity == cache.planes[kind].state.capacity for kind, st in new_states.items())

    def one_dispatch(self, p: int, new_states: dict[str, PlaneState], k_dev, v_dev, out_dev, gate: str) -> None:
        """The step as one dispatch (kernels/one_dispatch.py): scan, stores, both producers, both reducers.
        gate: "token" - the writes ask this token's scan (a fresh stamp; the host reads it after the step);
        "deferred" - they ask every scan since the host last looked (one refused token holds back every
        write after it; the host looks at its next synchronisation, Engine.sync); "open" - the host has
        checked the token and nothing the scan finds holds a write back (Engine.step)."""
        if gate == "open":
            stamp, base = NEVER_STAMPED, OPEN_GATE
        else:
            stamp = self.checks.next_stamp()
            base = stamp if gate == "token" else self.checks.base
        n, s = new_states[NOPE], new_states[SWA]  # capacities: the planes' own (no plane grows in this step)
        part_nope, part_swa = self.step_partials
        c = self.cache
        self.launch(self.step_kernel, self.q_dev, k_dev, v_dev, out_dev, self.checks.flags, stamp, base, p,
                    c.k[NOPE], c.v[NOPE], part_nope, n.origin_logical, n.origin_physical,
                    c.k[SWA], c.v[SWA], part_swa, s.origin_logical, s.origin_physical)

    def routes(self, p: int, new_states: dict[str, PlaneState], routes, q, k_dev, v_dev, out, out_dev):
        """Each route's dispatches (the graph route); returns (layers on a pinned route, their host output)."""
        by_route: dict[str, list[int]] = {}
        for layer, r in enumerate(routes):
            by_route.setdefault(r, []).append(layer)
        vec_layers = [layer for r in ladder.PINNED_ROUTES for layer in by_route.get(r, [])]
        vec_out = out  # GPU (Metal): the bridge's results land on the host, merged into the output after
        if out is None and vec_layers:
            vec_out = np.empty_like(q)
        cache = self.cache
        if ladder.INTERLEAVED in by_route:
            # first: the NoPE layers need no store launch ahead of them (theirs is fused), so on a GPU the
            # device starts one dispatch into the step's graph while the host issues the SWA dispatches
            self.run_producer(self.interleaved, self.reduce_v2, NOPE, tuple(by_route[ladder.INTERLEAVED]),
                              new_states[NOPE], p, k_dev, v_dev, out_dev)
        if SWA in cache.planes:
            grp = cache.group(cache.planes[SWA].layers)
            # kv_store_f16: every SWA layer stores first; splitk reads the row back from the plane
            self.launch(cache.stores[SWA].store_token, k_dev, v_dev, cache.k[SWA], cache.v[SWA], grp.layers_dev,
                        grp.slots_dev, len(grp.layers), new_states[SWA].physical(p))
        if cache.serving is not None:
            self.vec.stage_serving(p, new_states)
        if ladder.LLAMA_VEC_SWA in by_route:
            self.launches += 1
            self.vec.run(SWA, tuple(by_route[ladder.LLAMA_VEC_SWA]), new_states[SWA], p, q, vec_out)
        if ladder.LLAMA_VEC_NOPE in by_route:
            layers = tuple(by_route[ladder.LLAMA_VEC_NOPE])
            grp, st = cache.group(layers), new_states[NOPE]
            # kv_store_batch_f16, then the pinned kernel reads the head-major plane (store first, no bypass)
            self.launch(cache.stores[NOPE].store_token, k_dev, v_dev, cache.k[NOPE], cache.v[NOPE], grp.layers_dev,
                        grp.slots_dev, len(layers), st.physical(p))
            self.launches += 1
            self.vec.run(NOPE, layers, st, p, q, vec_out)
        if ladder.SPLITK in by_route:
            self.run_producer(self.splitk, self.reduce_f32, SWA, tuple(by_route[ladder.SPLITK]), new_states[SWA], p,
                              k_dev, v_dev, out_dev)
        return vec_layers, vec_out

    # ---- one layer of a token (token.py) ---------------------------------------------------------
    def compiled_layers(self):
        """The per-layer kernels through Taichi's C-API (layer_launch.py), or None for Taichi's Python launch path
        (launch="python", a backend the C-API does not serve, or "auto" where it cannot load)."""
        if self._compiled is False:
            from .layer_launch import CompiledLayers

            self._compiled = CompiledLayers.create(self, self.launch_path)
        return self._compiled

    def attend_layer(self, plan, layer: int, route_sizes, q1, k1, v1, out1, scan_stamp: int | None = None) -> None:
        """One layer of a planned token (Engine._plan_tokens: position, states, routes, mix) on arrays the
        kernels read: q1/out1 [1, heads, d], k1/v1 [1, kv heads, d].  The layer takes its route's kernels with
        the split step() gives a launch over all ``route_sizes[route]`` layers on that route, so its output has
        step()'s bits.  A pinned route reads host arrays: attend_layer_host."""
        p, new_states, routes, _ = plan
        route = routes[layer]
        kind = SWA if route in (ladder.SPLITK, ladder.LLAMA_VEC_SWA) else NOPE
        st, cache = new_states[kind], self.cache
        grp = cache.token_group(layer)
        # device inputs: the token scan first (kernels/token_scan.py), its flags read when the token commits
        checks = self.checks
        dispatches = [] if scan_stamp is None else [(checks.scan, (q1, k1, v1, checks.flags, scan_stamp))]
        if route == ladder.SPLITK:
            dispatches.append((cache.stores[SWA].store_token, (k1, v1, cache.k[SWA], cache.v[SWA], grp.layers_dev,
                                                               grp.slots_dev, 1, st.physical(p))))
            producer, reduce = self.splitk, self.reduce_f32
        elif route == ladder.INTERLEAVED:
            producer, reduce = self.interleaved, self.reduce_v2
        else:
            raise EngineError(f"layer {layer}: route {route} reads host arrays (attend_layer_host)")
        _, visible = visible_span(self.cfg, kind, p)
        nwg, nsg = self.split_geometry(visible, route_sizes[route])
        partials = self.partials_for(kind, 1, nwg)
        args = (q1, k1, v1, cache.k[kind], cache.v[kind], partials, self._no_visits, grp.layers_dev, grp.slots_dev, 1,
                p, window_of(self.cfg, kind), st.capacity, st.origin_logical, st.origin_physical, nwg, nsg,
                self.cfg.attention_scale)
        if self.serial_layer(visible):  # every item on this thread: first 0, stride 1
            dispatches.append((self.producer_one[producer], args + (0, 1)))
        else:
            dispatches.append((producer, args))
        dispatches.append((self.reduce_one.get(reduce, reduce), (partials, out1, grp.layers_dev, 1, nwg)))
        self.launches += len(dispatches)
        if isinstance(q1, ti.Ndarray) and isinstance(out1, ti.Ndarray):
            # one compiled graph a route: a Python launch costs tens of microseconds a kernel, a graph run a few
            self.graphs.run(dispatches, external=(q1, k1, v1, out1, grp.layers_dev, grp.slots_dev))
        else:  # torch CUDA tensors, which a graph does not bind
            for kernel, args in dispatches:
                kernel(*args)

    def attend_layer_host(self, plan, layer: int, route_sizes, q1: np.ndarray, k1: np.ndarray, v1: np.ndarray,
                          out1: np.ndarray) -> None:
        """attend_layer on checked host arrays: zero-copy on the CPU; on a GPU through the engine's one-layer
        device arrays (an upload each, a download of the output).  The pinned routes run here."""
        p, new_states, routes, _ = plan
        route = routes[layer]
        if route in ladder.PINNED_ROUTES:
            kind = SWA if route == ladder.LLAMA_VEC_SWA else NOPE
            st, cache = new_states[kind], self.cache
            grp = cache.token_group(layer)
            self.launch(cache.stores[kind].store_token, k1, v1, cache.k[kind], cache.v[kind], grp.layers_dev,
                        grp.slots_dev, 1, st.physical(p))
            q_all, out_all = self.layer_host_arrays()
            q_all[layer] = q1[0]
            self.vec.run(kind, (layer,), st, p, q_all, out_all)
            out1[0] = out_all[layer]
            return
        q_dev, k_dev, v_dev, out_dev = self.layer_device_arrays()
        if not self.gpu:  # Taichi's arrays are host memory: copied in and out through views, no kernel
            views = self._layer_views
            for view, a in zip(views, (q1, k1, v1)):
                np.copyto(view, a)
            self.attend_layer(plan, layer, route_sizes, q_dev, k_dev, v_dev, out_dev)
            np.copyto(out1, views[3])
            return
        for dev, a in ((q_dev, q1), (k_dev, k1), (v_dev, v1)):
            self.transfer.upload(dev, a)
        self.attend_layer(plan, layer, route_sizes, q_dev, k_dev, v_dev, out_dev)
        out1[...] = self.transfer.download(out_dev, out1.shape)

    def attend_layer_cuda(self, plan, layer: int, route_sizes, q1, k1, v1, out1, scan_stamp: int) -> bool:
        """attend_layer on torch CUDA tensors through the engine's one-layer arrays: device-to-device copies in
        and out around the route's compiled graph (a graph binds ndarrays only; a Python launch with torch
        arguments costs ~80 us a kernel).  False where the driver cannot copy (then launch on the tensors)."""
        q_dev, k_dev, v_dev, out_dev = self.layer_device_arrays()
        t = self.transfer
        for dev, a in ((q_dev, q1), (k_dev, k1), (v_dev, v1)):
            if not t.device_copy(t.address(dev), a.data_ptr(), a.numel() * 4):
                return False
        self.attend_layer(plan, layer, route_sizes, q_dev, k_dev, v_dev, out_dev, scan_stamp)
        return t.device_copy(out1.data_ptr(), t.address(out_dev), out1.numel() * 4)

    def layer_host_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """[layers, heads, d] host q and out for a pinned route's one layer (it indexes them by layer)."""
        if self._layer_host is None:
            self._layer_host = (np.zeros(self.shapes["q"], np.float32), np.zeros(self.shapes["out"], np.float32))
        return self._layer_host

    def layer_device_arrays(self) -> tuple:
        """One layer's q, k, v and out as Taichi arrays ([1, ...]), made once (on the CPU with host views)."""
        if self._layer_dev is None:
            g = self.cfg
            shapes = [(1, g.n_heads, g.head_dim), (1, g.n_kv_heads, g.head_dim), (1, g.n_kv_heads, g.head_dim),
                      (1, g.n_heads, g.head_dim)]
            self._layer_dev = tuple(ti.ndarray(ti.f32, shape) for shape in shapes)
            if not self.gpu:
                self._layer_views = [host_view(a) for a in self._layer_dev]
        return self._layer_dev



    # ---- the token's arrays ---------------------------------------------------------------------
    def upload(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple:
        """A checked host token to the kernels: (k_dev, v_dev), the queries in q_dev.  On the CPU a numpy
        array is passed zero-copy; on a GPU it is copied into the engine's arrays."""
        if not self.gpu:
            self.q_dev = q
            return k, v
        if self.unpack is not None:
            # launched now, ahead of the step's graph on the same queue (a graph binds device arrays only)
            self.launches += 1
            self.unpack(np.concatenate((q, k, v), axis=1), self.q, self.k_cur, self.v_cur)
        else:
            for dev, a in ((self.q, q), (self.k_cur, k), (self.v_cur, v)):
                self.transfer.upload(dev, a)
        self.q_dev = self.q
        return self.k_cur, self.v_cur

    def host_or_dev(self, a: np.ndarray):
        """A host array for a kernel: zero-copy on the CPU, uploaded once on a GPU."""
        if not self.gpu:
            return a
        dev = ti.ndarray(ti.f32, a.shape)
        dev.from_numpy(a)
        return dev

    def download_out(self) -> np.ndarray:
        return self.transfer.download(self.out, self.shapes["out"])

    def download_token(self, q, k, v) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(self.transfer.download(a, self.shapes[name]) for name, a in (("q", q), ("k", k), ("v", v)))


def host_view(arr) -> np.ndarray:
    """A zero-copy view of a float32 or int32 Taichi array in host memory (the CPU backend), valid while ``arr``
    lives."""
    import ctypes

    addr = ti.lang.impl.get_runtime().prog.get_ndarray_data_ptr_as_int(arr.arr)
    shape = tuple(arr.shape)
    ctype, dtype = (ctypes.c_float, np.float32) if arr.dtype == ti.f32 else (ctypes.c_int32, np.int32)
    buf = (ctype * int(np.prod(shape))).from_address(int(addr))
    return np.frombuffer(buf, dtype=dtype).reshape(shape)




__all__ = ["Launcher"]
