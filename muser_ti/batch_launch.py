"""One launch per route for every sequence of a batch's layer (batch.py): the pool's group kernels and arrays.

A batch's sequences live in one plane pool (plane_pool.py), so one launch can attend them all.  Per layer, the
sequences whose route is the project's own (splitk, interleaved) go out together: each route is its store (splitk
only; interleaved fuses it), one producer and one reducer launch over every sequence on it, whatever the batch
size, as one compiled graph.  What differs between the sequences (position, origins, the split, the row the token
takes) is a table the group kernels read per sequence (kernels/common.GROUP_*), made once a step per class; each
sequence keeps the split a lone engine gives it, so its output has the bits it has alone.

Inputs: host arrays (numpy, torch on the CPU, mlx) are checked on the host, the first bad value named with its
sequence; device arrays (torch CUDA tensors) are copied into the batch's arrays on the device and scanned there,
a record per row (token_scan.build_row_scan), which the step's commit reads (one wait a step).
"""

from __future__ import annotations

import numpy as np
import taichi as ti

from . import ladder
from .batch_compiled import CompiledGroups
from .config import F16_MAX, NOPE, SWA
from .device_checks import REFUSAL_KINDS
from .errors import EngineError
from .kernels import halves
from .kernels.common import (GROUP_COLUMNS, GROUP_NSG, GROUP_NWG, GROUP_ORIGIN_LOGICAL, GROUP_ORIGIN_PHYSICAL,
                             GROUP_POSITION, GROUP_ROW, HEAD_MAJOR, MAX_WORKGROUPS, TOKEN_MAJOR, cached, on_gpu)
from .kernels.producer import build_producer, plan_key
from .kernels.reducer import build_reduce
from .kernels.stores import build_stores
from .kernels.token_scan import TOKEN_FLAGS, build_row_scan
from .kv_cache import LAYOUT_OF
from .launch import host_view
from .planes import visible_span, window_of
from .replay import GraphReplay
from .transfer import Transfer

GROUP_ROUTES = {ladder.SPLITK: SWA, ladder.INTERLEAVED: NOPE}  # the routes a group launch serves, and their class
AXES = ("head", "d")


def group_producers(cfg, gpu: bool, serial: bool = False) -> dict:
    """The per-group producers of both routes (kernels/producer.group_producer_kernel), built once a geometry;
    serial (CPU): their variants that run items first, first + stride, ... on the launching thread."""
    D, G, KV = cfg.head_dim, cfg.heads_per_kv, cfg.n_kv_heads
    out = {}
    for route, layout, bypass in ((ladder.SPLITK, TOKEN_MAJOR, False), (ladder.INTERLEAVED, HEAD_MAJOR, True)):
        out[route] = cached(("group_producer", layout, D, G, KV, gpu, plan_key(D, G, gpu), serial),
                            lambda layout=layout, bypass=bypass: build_producer(D, G, KV, gpu, layout, bypass, False,
                                                                                per_group=True, serial=serial))
    return out


class BatchLauncher:
    """The group kernels of a pool of ``pool.slots`` sequences, and the arrays one layer's launch binds."""

    def __init__(self, cfg, pool, launch: str = "auto"):
        self.cfg, self.pool, self.launch_path = cfg, pool, launch
        self.gpu = gpu = on_gpu()
        D, KV, H, B = cfg.head_dim, cfg.n_kv_heads, cfg.n_heads, pool.slots
        self.producers = group_producers(cfg, gpu)
        # the CPU's compiled path deals a producer's items to the calling thread and its lanes (layer_launch.py)
        self.serial_producers = {} if gpu else group_producers(cfg, gpu, serial=True)
        self.reduce = build_reduce(D, H, gpu, ti.f32, per_group=True)
        self.stores = {kind: build_stores(D, KV, LAYOUT_OF[kind]) for kind in pool.k}
        self.row_scan = build_row_scan(H, KV, D)
        self.q, self.out = ti.ndarray(ti.f32, (B, H, D)), ti.ndarray(ti.f32, (B, H, D))
        self.k, self.v = ti.ndarray(ti.f32, (B, KV, D)), ti.ndarray(ti.f32, (B, KV, D))
        self.flags = ti.ndarray(ti.i32, (B, TOKEN_FLAGS))  # the row scan's stamps (zero: no scan yet)
        self.stamp = 0
        self._no_visits = ti.ndarray(ti.i32, (1, 1))
        self.graphs = GraphReplay()
        self.transfer = Transfer()
        self._views = None if gpu else [host_view(a) for a in (self.q, self.k, self.v, self.out)]
        self._partials: dict[str, object] = {}
        # small i32 arrays kept by what they are for (a layer's plane slots, the rows on a route, a class's state
        # table), rewritten only when their values change: a layer's graph binds the same arrays step after step
        self._arrays: dict[tuple, tuple] = {}
        self._tables: dict[tuple, tuple] = {}  # table(): the values last written, and the array
        self._slot_tables: dict[int, tuple] = {}  # layer -> (the sequences' slots, their plane-slot table)
        # the rows a step's tokens take, kept at its open for an abandon: [sequences, layers of the class, kv, d]
        self._kept = {kind: (halves.alloc(shape), halves.alloc(shape))
                      for kind in pool.k for shape in [(B, pool.n_layers[kind], KV, D)]}
        self.launches = 0
        self._compiled = False  # the C-API path (batch_compiled.CompiledGroups), made on a step's first layer

    # ---- small arrays ------------------------------------------------------------------------------
    def held(self, key: tuple, values: np.ndarray):
        """The i32 device array kept for ``key`` (its shape part of it), holding ``values``: written only when they
        differ from what it holds, so a new mix of sequences costs an upload, not a new array and a new graph."""
        arr, written = self._arrays.get(key, (None, None))
        if arr is None:
            arr = ti.ndarray(ti.i32, values.shape)
        if written is None or not np.array_equal(written, values):
            if self.gpu:
                self.transfer.upload(arr, values)
            else:
                host_view(arr)[...] = values
            self._arrays[key] = (arr, values.copy())
        return arr

    def table(self, what: str, values: tuple[int, ...]):
        """``held`` for a 1-D table: a layer's plane slots, a route's activation rows, a class's bases or rows
        (the same values as last time cost a tuple comparison: this runs several times a layer)."""
        key = (what, len(values))
        last = self._tables.get(key)
        if last is not None and last[0] == values:
            return last[1]
        arr = self.held(key, np.asarray(values, np.int32))
        self._tables[key] = (values, arr)
        return arr

    def keep_rows(self, slots: list[int], rows: dict[str, tuple[int, ...]]) -> list:
        """Row ``rows[kind][g]`` of every layer of class ``kind`` of sequence slot ``slots[g]``, K and V, into the kept
        arrays, one launch a class (stores.save_group); returns what ``restore_rows`` puts back."""
        kept = []
        for kind, kind_rows in rows.items():
            bases = tuple(self.pool.base(kind, s) for s in slots)
            args = (self.table(f"bases {kind}", bases), self.table(f"kept rows {kind}", kind_rows), len(bases),
                    self.pool.n_layers[kind])
            self._launch_one(("keep", kind), self.stores[kind].save_group,
                             (self.pool.k[kind], self.pool.v[kind], *self._kept[kind], *args))
            kept.append((kind, args))
        return kept

    def restore_rows(self, kept: list) -> None:
        for kind, args in kept:
            self._launch_one(("restore", kind), self.stores[kind].restore_group,
                             (*self._kept[kind], self.pool.k[kind], self.pool.v[kind], *args))

    def _launch_one(self, key, kernel, args) -> None:
        compiled = self.compiled
        if compiled is not None:
            compiled.run(key, [(kernel, args)])
        else:
            kernel(*args)

    def partials_for(self, kind: str, nwg: int):
        """Partials scratch [sequences, heads, workgroups, 2 + d] for a class, grown to a power of two."""
        buf = self._partials.get(kind)
        if buf is None or buf.shape[2] < nwg:
            cap = max(MAX_WORKGROUPS, 1 << (nwg - 1).bit_length(), buf.shape[2] if buf is not None else 0)
            g = self.cfg
            buf = self._partials[kind] = ti.ndarray(ti.f32, (self.pool.slots, g.n_heads, cap, 2 + g.head_dim))
        return buf

    # ---- a layer ---------------------------------------------------------------------------------
    @property
    def compiled(self) -> CompiledGroups | None:
        """The group kernels through Taichi's C-API where the launch path takes it (batch_compiled.py), else None."""
        if self._compiled is False:
            KV = self.cfg.n_kv_heads
            # a group producer's items: n_group x KV x nwg_max (its arguments 9 and 13)
            spread = {id(self.producers[route]): (f"producer_{route}_serial", lambda args: args[9] * KV * args[13])
                      for route in self.serial_producers}
            self._compiled = CompiledGroups.create(self.aot_kernels(), self.launch_path, spread)
        return self._compiled

    def aot_kernels(self) -> dict[str, tuple]:
        """The group kernels by name, each with the key its build depends on (aot.module_key)."""
        cfg = self.cfg
        geometry = (cfg.head_dim, cfg.heads_per_kv, cfg.n_kv_heads, cfg.n_heads, self.gpu,
                    repr(plan_key(cfg.head_dim, cfg.heads_per_kv, self.gpu)))
        kernels = {"row_scan": (self.row_scan, ("row_scan", geometry)),
                   "reduce": (self.reduce, ("reduce_groups", geometry))}
        if self.gpu:
            kernels["producer_splitk"] = (self.producers[ladder.SPLITK], ("group_producer", TOKEN_MAJOR, geometry))
            kernels["producer_interleaved"] = (self.producers[ladder.INTERLEAVED],
                                               ("group_producer", HEAD_MAJOR, geometry))
        for route, serial in self.serial_producers.items():  # the CPU's (CompiledGroups deals their items out)
            kernels[f"producer_{route}_serial"] = (serial, ("serial_group_producer", route, geometry))
        if SWA in self.stores:
            kernels["store"] = (self.stores[SWA].store_group, ("store_group", geometry))
        for kind, stores in self.stores.items():  # a step's rows kept at its open, put back on abandon
            layout = LAYOUT_OF[kind]
            kernels[f"save_{kind}"] = (stores.save_group, ("save_group", layout, geometry))
            kernels[f"restore_{kind}"] = (stores.restore_group, ("restore_group", layout, geometry))
        return kernels

    def own_io(self) -> tuple:
        """The launcher's own q, k, v, out: what a layer reads and writes unless the caller's device tensors are
        launched on where they lie (the C-API path)."""
        return self.q, self.k, self.v, self.out

    def next_stamp(self) -> int:
        self.stamp += 1
        return self.stamp

    def dispatches(self, route: str, layer: int, rows: tuple[int, ...], slots: tuple[int, ...], state, nwg_max: int,
                   io: tuple):
        """One route's launches over the sequences in ``rows`` (activation rows) at ``layer``, reading and writing
        ``io`` = (q, k, v, out): (kernel, args) each."""
        kind = GROUP_ROUTES[route]
        cfg, pool = self.cfg, self.pool
        last = self._slot_tables.get(layer)  # the plane slots of the same sequences: no walk over the batch
        if last is not None and last[0] == slots:
            slot_table = last[1]
        else:
            local = cfg.swa_layers.index(layer) if kind == SWA else cfg.nope_layers.index(layer)
            slot_table = self.table(f"slots {layer}", tuple(pool.base(kind, s) + local for s in slots))
            self._slot_tables[layer] = (slots, slot_table)
        row_table = self.table(f"rows {route}", rows)
        n = len(rows)
        partials = self.partials_for(kind, nwg_max)
        k_plane, v_plane = pool.k[kind], pool.v[kind]
        q, k, v, out = io
        launches = []
        if route == ladder.SPLITK:  # kv_store_f16 first: splitk reads the row back from the plane
            launches.append((self.stores[SWA].store_group, (k, v, k_plane, v_plane, row_table, slot_table, n, state)))
        launches.append((self.producers[route], (q, k, v, k_plane, v_plane, partials, self._no_visits, row_table,
                                                 slot_table, n, state, window_of(cfg, kind), pool.capacity[kind],
                                                 nwg_max, cfg.attention_scale)))
        launches.append((self.reduce, (partials, out, row_table, n, state)))
        return launches

    def scan(self, io: tuple, n_rows: int) -> tuple:
        """The row scan of a layer's device inputs (token_scan.build_row_scan), stamped; returns (dispatch, stamp)."""
        stamp = self.next_stamp()
        return (self.row_scan, (*io[:3], self.flags, stamp, n_rows)), stamp

    def run(self, layer: int, dispatches) -> None:
        """A layer's dispatches: through the C-API where it is taken, else as one compiled graph (replay.py)."""
        self.launches += len(dispatches)
        compiled = self.compiled
        if compiled is not None:
            compiled.run(layer, dispatches)
        else:
            self.graphs.run(dispatches)

    # ---- inputs and outputs ------------------------------------------------------------------------
    def put_host(self, arrays_in: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        """Checked host q, k, v [B, ...] into the batch's arrays (views on the CPU, uploads on a GPU)."""
        n = arrays_in[0].shape[0]
        for dev, a, i in zip((self.q, self.k, self.v), arrays_in, range(3)):
            if self.gpu:
                if n == dev.shape[0]:
                    self.transfer.upload(dev, a)
                else:  # fewer sequences than slots: the leading rows
                    whole = np.zeros(tuple(dev.shape), np.float32)
                    whole[:n] = a
                    self.transfer.upload(dev, whole)
            else:
                np.copyto(self._views[i][:n], a)

    def get_host(self, n: int) -> np.ndarray:
        if self.gpu:
            return self.transfer.download(self.out, tuple(self.out.shape))[:n].copy()
        return self._views[3][:n].copy()

    def put_device(self, tensors) -> bool:
        """torch CUDA q, k, v [B, ...] (float32, contiguous) into the batch's arrays on the device; False where the
        driver cannot copy."""
        t = self.transfer
        return all(t.device_copy(t.address(dev), a.data_ptr(), a.numel() * 4)
                   for dev, a in zip((self.q, self.k, self.v), tensors))

    def get_device(self, out_tensor) -> bool:
        t = self.transfer
        return t.device_copy(out_tensor.data_ptr(), t.address(self.out), out_tensor.numel() * 4)

    def refused_rows(self, first_stamp: int, n_rows: int) -> dict[int, tuple[int, list[str]]]:
        """{row: (the latest stamp that flagged it, what the row scans since ``first_stamp`` found)} for rows below
        ``n_rows`` (one download: a wait)."""
        if self.stamp < first_stamp:
            return {}
        flags = self.transfer.download(self.flags, tuple(self.flags.shape)) if self.gpu else host_view(self.flags)
        flags = flags[:n_rows]
        out = {}
        for b in np.flatnonzero((flags >= first_stamp).any(axis=1)):
            out[int(b)] = (int(flags[b].max()), [REFUSAL_KINDS[i] for i in range(TOKEN_FLAGS)
                                                 if flags[b, i] >= first_stamp])
        return out


def group_state(plans, kind: str, route: str, launchers, route_sizes) -> tuple[np.ndarray, int]:
    """The per-group table of one class and route ([groups, GROUP_COLUMNS]: each sequence's position, origins, the
    split its own engine gives this layer, its row) and the largest split."""
    rows = np.zeros((len(plans), GROUP_COLUMNS), np.int32)
    for g, (plan, launcher, sizes) in enumerate(zip(plans, launchers, route_sizes)):
        p, new_states = plan[0], plan[1]
        st = new_states[kind]
        _, visible = visible_span(launcher.cfg, kind, p)
        nwg, nsg = launcher.split_geometry(visible, sizes[route])
        rows[g, GROUP_POSITION], rows[g, GROUP_ORIGIN_LOGICAL], rows[g, GROUP_ORIGIN_PHYSICAL] = (
            p, st.origin_logical, st.origin_physical)
        rows[g, GROUP_NWG], rows[g, GROUP_NSG], rows[g, GROUP_ROW] = nwg, nsg, st.physical(p)
    return rows, int(rows[:, GROUP_NWG].max())


def checked_rows(where: str, name: str, a: np.ndarray, shape: tuple[int, ...]) -> int | None:
    """The first row of ``a`` [B, ...] holding a value the planes cannot hold (non-finite or past f16), or None;
    one vectorised test over the whole batch (a refusal then names the value from that row)."""
    if a.shape != shape:
        raise EngineError(f"{where} {name}: shape {a.shape}, expected {shape} (sequence, heads, head_dim)")
    bad = ~(np.abs(a) <= F16_MAX)
    if not bad.any():
        return None
    return int(np.argwhere(bad)[0][0])


__all__ = ["AXES", "BatchLauncher", "GROUP_ROUTES", "checked_rows", "group_producers", "group_state"]
