"""A token attended one layer at a time, as a model's forward pass calls attention (Engine.token, Engine.prompt).

In a transformer, layer l + 1's query comes from layer l's attention output, so a model cannot hand the
engine every layer's q at once (Engine.step).  Here the token is planned once, as FlashInfer plans a batch
once and runs it per layer: its position, every plane's state after the append and the ladder's route per
layer, exactly as step() plans them.  Then each layer attends when the model gets to it, on the kernels and
the split geometry step() would use for that layer (the split is sized by the number of layers on the
route, as in step()'s one launch for them all), so a layer's output has step()'s bits.

The token is atomic.  Opening it keeps what it will overwrite: the ring rows its append takes and, where a
growing plane grows, the allocation before the growth.  It commits when every layer has attended; an
exception or Ctrl-C between layers (the with-block's exit), or abandon(), puts those rows, allocations and
states back, so the engine is exactly as before the token.  While a token is open the engine refuses every
other call that reads or changes the cache, naming the open token.

``Engine.token(n)`` attends n tokens at once (a speculative verify pass, a short chunk): each layer runs the
n tokens in order, each over the cache and the chunk's earlier tokens, the same work as n steps.
``Engine.prompt(n)`` ingests a prompt's K/V layer by layer without attention, for a framework whose own
attention computes the prompt's outputs; it commits as one prefill.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from . import arrays, inputs, interrupts, ladder
from .config import F16_MAX
from .errors import EngineError
from .kernels.token_scan import REFUSAL_RING
from .layer_launch import ScanRefused


def _checked(where: str, name: str, a: np.ndarray, shape: tuple[int, ...], axes: tuple[str, ...]) -> np.ndarray:
    """A host array of ``shape``, finite and within the f16 range the planes (and q) are held to."""
    if a.shape != shape:
        raise EngineError(f"{where} {name}: shape {a.shape}, expected {shape} ({', '.join(axes)})")
    bad = ~(np.abs(a) <= F16_MAX)  # NaN compares false: caught with the infinities and the out-of-range values
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        value, at = a[idx], ", ".join(f"{ax} {i}" for ax, i in zip(axes, idx))
        if not np.isfinite(value):
            raise EngineError(f"{where} {name}: non-finite value {value} at {at}")
        held = "the planes hold" if name != "q" else "q is held to"
        raise EngineError(f"{where} {name}: value {value:.6g} at {at} is outside the f16 range {held} (|x| <= 65504)")
    return a


def _layer_shapes(cfg, n: int, q) -> tuple[bool, dict[str, tuple[int, ...]]]:
    """(whether the caller's arrays carry the token axis, the [n, heads, d] shapes the kernels take)."""
    ndim = len(tuple(q.shape))
    return ndim == 3 or n > 1, {"q": (n, cfg.n_heads, cfg.head_dim), "k": (n, cfg.n_kv_heads, cfg.head_dim),
                                "v": (n, cfg.n_kv_heads, cfg.head_dim)}


class _Open:
    """What Token and Prompt share: the engine they hold open, the layer order, the refusals."""

    what = "token"

    def __init__(self, engine, n: int):
        n = inputs.integer(f"{type(self).__name__.lower()} n", n)
        if n < 1:
            raise EngineError(f"{self.what} n={n}: expected a positive number of tokens")
        engine._settle()
        self.engine, self.cfg, self.n = engine, engine.cfg, n
        self.start = engine.position
        if self.start + n > self.cfg.max_context:
            raise EngineError(f"{self.what} of {n} token(s) at position {self.start} passes max_context="
                              f"{self.cfg.max_context}")
        self.next_layer = 0
        self.is_open = False

    def __repr__(self) -> str:
        state = "open" if self.is_open else "closed"
        return (f"<{type(self).__name__} {state}: {self.n} token(s) at position {self.start}, layer {self.next_layer} "
                f"of {self.cfg.n_layers} next>")

    def describe(self) -> str:
        return (f"a {self.what} of {self.n} token(s) at position {self.start} is open (layers 0..{self.next_layer - 1} "
                f"done, layer {self.next_layer} next)" if self.next_layer else
                f"a {self.what} of {self.n} token(s) at position {self.start} is open (no layer done yet)")

    def _check_layer(self, verb: str, layer) -> int:
        if not self.is_open:
            raise EngineError(f"{verb} layer {layer!r}: this {self.what} at position {self.start} is closed "
                              f"(committed or abandoned); open a new one")
        layer = inputs.integer(f"{verb} layer", layer)
        L = self.cfg.n_layers
        if not 0 <= layer < L:
            raise EngineError(f"{verb} layer {layer}: expected a layer in [0, {L})")
        if layer < self.next_layer:
            raise EngineError(f"{verb} layer {layer}: layer {layer} has already {verb}ed this {self.what} (layers "
                              f"0..{self.next_layer - 1} have); layer {self.next_layer} is next")
        if layer > self.next_layer:
            raise EngineError(f"{verb} layer {layer}: out of order: layer {self.next_layer} is next (layers "
                              f"{verb} in order 0..{L - 1})")
        return layer

    def _missing(self) -> str | None:
        L = self.cfg.n_layers
        if self.next_layer == L:
            return None
        return (f"the {self.what} at position {self.start} cannot commit: layers {self.next_layer}..{L - 1} have not "
                f"run (every layer runs once, in order)" if self.next_layer < L - 1 else
                f"the {self.what} at position {self.start} cannot commit: layer {L - 1} has not run")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.is_open:
            return False
        if exc_type is not None:
            self.abandon()
            return False
        missing = self._missing()
        if missing is not None:
            self.abandon()
            raise EngineError(missing + "; it was abandoned and the engine is as before it")
        self.commit()
        return False

    def _close(self) -> None:
        self.is_open = False
        if self.engine._open is self:
            self.engine._open = None


class Token(_Open):
    """``n`` tokens (usually one) attended layer by layer; Engine.token(n) opens one."""

    def __init__(self, engine, n: int = 1, keep_rows: bool = True):
        super().__init__(engine, n)
        self._keep_rows = keep_rows  # False: a batch keeps the rows its sequences' tokens overwrite (batch.py)
        cache = engine.cache
        if cache.serving is not None or cache.mirror is not None:
            raise EngineError("per-layer attention does not run the serving graph or mirror planes (the pinned Metal "
                              "rung's copy); use step(), or graph='teacher' without mirror planes")
        self.plans = engine._plan_tokens(n)
        self.before = cache.states()
        # each route's layer count, per token: a layer's split is sized as step()'s launch over them all
        self.route_sizes = [Counter(routes) for _, _, routes, _ in self.plans]
        self._old_arrays: dict[str, tuple] = {}
        self._saved: dict[str, tuple] = {}
        self._scans: dict[int, int] = {}  # the device scans of this token's layers: stamp -> layer
        with interrupts.held_back():
            try:
                self._keep_what_it_overwrites()
            except BaseException:
                self._undo()
                raise
        self.is_open = True
        engine._open = self

    def _keep_what_it_overwrites(self) -> None:
        cache, n = self.engine.cache, self.n
        final = self.plans[-1][1]
        for kind, ps in cache.planes.items():
            st = final[kind]
            if cache.pool is not None:
                # a batch's pool grows for every slot now, if it must (kept: the same rows in a larger allocation)
                cache.ensure_capacity(kind, st.capacity)
                if not self._keep_rows:
                    continue
            elif st.capacity != ps.state.capacity:
                # a growing plane grows now: the rows move into a new allocation and the old one is kept whole
                self._old_arrays[kind] = (cache.k[kind], cache.v[kind])
                cache.ensure_capacity(kind, st.capacity)
                continue
            first = self.plans[0][1][kind].physical(self.start)  # the n appends take consecutive rows (mod capacity)
            rows = min(n, st.capacity)
            saved = (*cache.kept_rows(kind, rows), first, rows, st.capacity)
            for which, plane, kept in (("k", cache.k[kind], saved[0]), ("v", cache.v[kind], saved[1])):
                self._copy_rows("save", kind, which, (plane, kept, cache.slot_base[kind], len(ps.layers), first, rows,
                                                      st.capacity))
            self._saved[kind] = saved

    def _copy_rows(self, op: str, kind: str, which: str, args: tuple) -> None:
        """The class's stores.save_rows or restore_rows (``op``) on ``args``: through the compiled path's C call
        where the engine launches through Taichi's C-API, else Taichi's Python launch."""
        compiled = self.engine.launcher.compiled_layers()
        if compiled is not None:
            compiled.copy_rows(op, kind, which, args)
        else:
            stores = self.engine.cache.stores[kind]
            (stores.save_rows if op == "save" else stores.restore_rows)(*args)

    def _undo(self) -> None:
        """Back to the state before the token: allocations, rows, plane states (idempotent: it sets)."""
        cache = self.engine.cache

        def undo():
            for kind, (k, v) in self._old_arrays.items():
                cache.k[kind], cache.v[kind] = k, v
            for kind, (sk, sv, first, rows, capacity) in self._saved.items():
                n_slots, base = len(cache.planes[kind].layers), cache.slot_base[kind]
                for which, kept, plane in (("k", sk, cache.k[kind]), ("v", sv, cache.v[kind])):
                    self._copy_rows("restore", kind, which, (kept, plane, base, n_slots, first, rows, capacity))
            cache.commit(self.before, self.start)

        interrupts.atomically(undo)

    # ---- the model's calls ---------------------------------------------------------------------
    def attend(self, layer: int, q, k, v):
        """Attend this token (these tokens) at ``layer``: q [n_heads, head_dim] (or [n, n_heads, head_dim]), k and v
        [n_kv_heads, head_dim] (or [n, ...]), in any kind arrays.py takes; returns the output like q, float32, in
        q's kind.  Layers attend in order 0..n_layers-1, each once."""
        layer = self._check_layer("attend", layer)
        launcher = self.engine.launcher
        lead, shapes = _layer_shapes(self.cfg, self.n, q)
        arch = self.engine.arch
        device = all(arrays.device_resident(a, arch) for a in (q, k, v)) and self._device_ok(q)
        compiled = launcher.compiled_layers()
        if compiled is not None and not any(plan[2][layer] in ladder.PINNED_ROUTES for plan in self.plans):
            out = self._attend_compiled(compiled, layer, q, k, v, lead, shapes, device)
        elif device:
            out = self._attend_device(layer, q, k, v, lead, shapes)
        else:
            out = self._attend_host(layer, q, k, v, lead, shapes)
        self.next_layer += 1
        return out

    def _attend_compiled(self, compiled, layer, q, k, v, lead, shapes, device):
        """The layer's kernels through Taichi's C-API (layer_launch.py); every input checked by the device scan,
        whose flags the commit reads."""
        where = f"attend layer {layer}"
        launcher = self.engine.launcher
        if device:
            q3, k3, v3 = (self._device_shape(where, name, a, shapes[name]) for name, a in (("q", q), ("k", k), ("v", v)))
            out3 = arrays.device_out(q3, shapes["q"])
            for i, plan in enumerate(self.plans):
                row = (q3, k3, v3, out3) if self.n == 1 else (q3[i:i + 1], k3[i:i + 1], v3[i:i + 1], out3[i:i + 1])
                io = compiled.device_io(*row)
                staged = io is None  # past the addresses it imports: through the staging arrays
                if staged:
                    compiled.stage_device(row[:3])
                    io = compiled.staged()
                launcher.launches += compiled.attend(plan, layer, self.route_sizes[i], io, self._scan_stamp(layer))
                if staged:
                    compiled.unstage_device(row[3])
            return out3 if lead else out3.reshape(shapes["q"][1:])
        sources = [arrays.Stager.source(where, name, a, shapes[name]) for name, a in (("q", q), ("k", k), ("v", v))]
        out = np.empty(shapes["q"], np.float32)
        io = compiled.staged()
        for i, plan in enumerate(self.plans):
            for j, src in enumerate(sources):
                compiled.put(j, src, i)
            try:
                launcher.launches += compiled.attend(plan, layer, self.route_sizes[i], io, self._scan_stamp(layer))
            except ScanRefused:
                self._refuse_host(layer, sources)
            compiled.get_out(out[i])
        return arrays.like_input(out if lead else out[0], q)

    def _refuse_host(self, layer: int, sources) -> None:
        """The CPU's scan refused host arrays at ``layer`` (before the layer wrote anything): the token is abandoned
        and the error names the first bad value, as the host check words it."""
        refused = self.engine.launcher.checks.look()  # what the scan found, every scan so far looked at
        self.abandon()
        where = f"attend layer {layer}"
        axes = {"q": ("token", "head", "d"), "k": ("token", "kv head", "d"), "v": ("token", "kv head", "d")}
        for name, src in zip("qkv", sources):
            h = arrays.to_host(f"{where} {name}", src)
            _checked(where, name, h, h.shape, axes[name])
        raise EngineError(f"{where}: the scan refused its arrays ({'; '.join(refused[1]) if refused else '?'}); the "
                          f"token at position {self.start} was abandoned and the engine is as before it")

    def _attend_device(self, layer, q, k, v, lead, shapes):
        """Taichi's Python launch path on device-resident arrays: the layer's compiled graph (launch.py)."""
        where = f"attend layer {layer}"
        launcher = self.engine.launcher
        q3, k3, v3 = (self._device_shape(where, name, a, shapes[name]) for name, a in (("q", q), ("k", k), ("v", v)))
        out3 = arrays.device_out(q3, shapes["q"])
        torch_in = arrays.framework_of(q3) == "torch"
        for i, plan in enumerate(self.plans):
            # one token: the arrays whole (Taichi ndarrays have no views); n tokens: torch's row views
            row = (q3, k3, v3, out3) if self.n == 1 else (q3[i:i + 1], k3[i:i + 1], v3[i:i + 1], out3[i:i + 1])
            stamp = self._scan_stamp(layer)
            if not (torch_in and launcher.attend_layer_cuda(plan, layer, self.route_sizes[i], *row, stamp)):
                launcher.attend_layer(plan, layer, self.route_sizes[i], *row, scan_stamp=stamp)
        return out3 if lead else out3.reshape(shapes["q"][1:])

    def _attend_host(self, layer, q, k, v, lead, shapes):
        """Taichi's Python launch path on host arrays, checked on the host first (launch.attend_layer_host)."""
        where = f"attend layer {layer}"
        axes = {"q": ("token", "head", "d"), "k": ("token", "kv head", "d"), "v": ("token", "kv head", "d")}
        host = {}
        for name, a in (("q", q), ("k", k), ("v", v)):
            h = arrays.to_host(f"{where} {name}", a)
            if not lead and h.ndim == 2:
                h = h[None]
            host[name] = _checked(where, name, h, shapes[name], axes[name])
        out = np.empty(shapes["q"], np.float32)
        launcher = self.engine.launcher
        for i, plan in enumerate(self.plans):
            launcher.attend_layer_host(plan, layer, self.route_sizes[i], host["q"][i:i + 1], host["k"][i:i + 1],
                                       host["v"][i:i + 1], out[i:i + 1])
        return arrays.like_input(out if lead else out[0], q)

    def _device_ok(self, q) -> bool:
        """A Taichi ndarray can be read in place only whole ([1, heads, d]): ndarrays have no views."""
        return arrays.framework_of(q) == "torch" or (self.n == 1 and len(tuple(q.shape)) == 3)

    @staticmethod
    def _device_shape(where, name, a, shape):
        a = arrays.device_f32(f"{where} {name}", a)
        if tuple(a.shape) == shape:
            return a
        if tuple(a.shape) == shape[1:] and shape[0] == 1 and arrays.framework_of(a) == "torch":
            return a.reshape(shape)
        raise EngineError(f"{where} {name}: shape {tuple(a.shape)}, expected {shape}")

    def _scan_stamp(self, layer: int) -> int:
        """Device inputs are scanned on the device (kernels/token_scan.build_token_scan: the first dispatch of the
        layer's) and nothing waits for it here: the flags are read once, when the token commits (one device wait a
        token, not one a layer), and a flagged layer's token is abandoned then, which undoes every write it made."""
        checks = self.engine.launcher.checks
        if checks.unlooked >= REFUSAL_RING:  # the device keeps REFUSAL_RING scans' flags: look before it wraps
            self._look()
        stamp = checks.next_stamp()
        self._scans[stamp] = layer
        return stamp

    def _look(self) -> None:
        """Read the device scans' flags (one wait); a refused layer abandons the token and raises naming it."""
        refused = self.engine.launcher.checks.look()
        if refused is not None:
            stamp, what = refused
            self.abandon()
            raise EngineError(f"attend layer {self._scans.get(stamp, '?')}: the device scan refused its arrays "
                              f"({'; '.join(what)}); the token at position {self.start} was abandoned and the engine "
                              f"is as before it")

    def check(self) -> None:
        """Read what the device scans of this token's layers found, now (one wait; host inputs were checked as they
        came): a refused layer abandons the token and raises naming it.  commit() calls it; a batch calls every
        sequence's before any commits (batch.py)."""
        if self._scans:
            self._look()

    def commit(self) -> None:
        """Commit the token: every layer has attended.  A with-block commits at its exit."""
        if not self.is_open:
            raise EngineError(f"commit: this token at position {self.start} is closed (committed or abandoned)")
        missing = self._missing()
        if missing is not None:
            raise EngineError(missing + "; attend the rest, or abandon() it")
        engine = self.engine
        self.check()
        engine._serial += 1
        serial, final = engine._serial, self.plans[-1][1]
        steps = [(list(routes), mix) for _, _, routes, mix in self.plans]

        def commit():
            engine.cache.commit(final, self.start + self.n)
            engine._routes.record_many(steps, serial)

        interrupts.atomically(commit)
        self._close()

    def abandon(self) -> None:
        """Undo everything this token wrote: the engine is exactly as before it.  Closed tokens: nothing to do."""
        if not self.is_open:
            return
        self._undo()
        self._close()


class Prompt(_Open):
    """A prompt's K/V, ``n`` tokens, stored layer by layer without attention; Engine.prompt(n) opens one.  The
    rows are kept on the host until every layer has stored, then go in as one prefill (Engine.prefill: ring
    wrap and NoPE growth as there), so an abandoned prompt writes nothing."""

    what = "prompt"

    def __init__(self, engine, n: int):
        super().__init__(engine, n)
        engine._planned(engine.cache.plan_prefill, n)  # refused now (a NoPE plane past its cap), not at the end
        L, KV, D = self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.head_dim
        self._k = np.empty((n, L, KV, D), np.float32)
        self._v = np.empty((n, L, KV, D), np.float32)
        self.is_open = True
        engine._open = self

    def store(self, layer: int, k, v) -> None:
        """The prompt's k and v at ``layer``: [n, n_kv_heads, head_dim] (or [n_kv_heads, head_dim] for one token)."""
        layer = self._check_layer("store", layer)
        where = f"prompt store layer {layer}"
        shape = (self.n, self.cfg.n_kv_heads, self.cfg.head_dim)
        axes = ("token", "kv head", "d")
        rows = []
        for name, a in (("k", k), ("v", v)):
            h = arrays.to_host(f"{where} {name}", a)
            if self.n == 1 and h.ndim == 2:
                h = h[None]
            rows.append(_checked(where, name, h, shape, axes))
        self._k[:, layer], self._v[:, layer] = rows
        self.next_layer += 1

    def commit(self) -> None:
        if not self.is_open:
            raise EngineError(f"commit: this prompt at position {self.start} is closed (committed or abandoned)")
        missing = self._missing()
        if missing is not None:
            raise EngineError(missing + "; store the rest, or abandon() it")
        self._close()
        try:
            self.engine.prefill(self._k, self._v)
        finally:
            self._k = self._v = None

    def abandon(self) -> None:
        if self.is_open:
            self._close()
            self._k = self._v = None


__all__ = ["Prompt", "Token"]
