"""Many sequences at once: a pool of sequence slots on one geometry, attended together layer by layer.

A server decodes many sequences per step (llama.cpp's slots, FlashInfer's batch decode, vLLM's and SGLang's
continuous batching, mlx-lm's BatchGenerator).  :class:`Batch` holds up to ``max_sequences`` of them, each
with everything one engine has: its own position, sliding-window rings and growing NoPE planes (so its own
origins), its own ladder (the route of each of its layers follows its own plane state), rewind, snapshot,
the float64 reference.  A slot is an :class:`~muser_ti.Engine`, and the pool is sized up front: ``max_sequences``
slots of ``context`` tokens, each slot's rings holding the window and its slack and its growing planes allocated
for ``context`` rows when the pool is made, so a slot holds ``(rings x (window + slack) + full layers x context)
x kv_heads x head_dim x 2 (K, V) x 2 bytes`` from the start.  (Without ``context`` the growing planes grow on
demand, as one engine's do.)  Slots, not pages: every sequence is a contiguous ring per sliding layer and a
contiguous plane per full layer, which is what the ladder's kernels address (llama.cpp's vec rung reads a plane as
rows); FlashInfer's and vLLM's pages let a sequence take memory as it grows and share prefixes, at the cost of a
page table in every kernel: a slot's growing planes here are reserved whole.

Sequences **join** (a free slot, empty; its prompt ingested as any engine's, ``Batch.prompt``) and **leave**
(the slot emptied for the next) between steps without touching any other sequence's rows.  A full pool
refuses the joining sequence, naming how many it holds and which sequences run; nothing else changes.

Per step the model calls each layer once for the whole batch (:meth:`Batch.token`): ``attend(layer, q, k, v)``
with ``q [B, n_heads, head_dim]`` (or ``[B, n, heads, d]``: n tokens a sequence), row ``b`` the step's b-th
sequence.  The step is atomic over the batch: a refusal in any sequence (a bad value, a plane past its cap)
names the sequence and its row, and abandons every sequence's token, so every sequence is exactly as before
the step; so does an exception or Ctrl-C between layers.

A layer goes out as one launch per route for every sequence on it (batch_launch.py: the group kernels, each
sequence's own position, origins and split read from a per-sequence table), through Taichi's C-API on the CPU (and
on CUDA with ``launch="capi"``: batch_compiled.py) or as one compiled graph (replay.py); a sequence on a pinned
route, n tokens a sequence and ``Batch.of``'s engines go out as each sequence's own token (token.py).  Either way
a sequence in a batch gives exactly the bits it gives alone.
"""

from __future__ import annotations

import numpy as np

from . import arrays, backend, inputs, interrupts
from .batch_launch import AXES, GROUP_ROUTES, BatchLauncher, checked_rows, group_state
from .config import NOPE, Geometry
from .engine import Engine
from .errors import EngineError
from .kv_cache import KVCache
from .plane_pool import PlanePool
from .planes import NOPE_INITIAL_ROWS
from .token import Token, _checked


class Batch:
    """A pool of ``max_sequences`` sequence slots on ``cfg``; engine options (``arch``, ``capacity``, ``pinned``,
    ``launch``...) apply to every slot.  Sequences are named by the id :meth:`join` returns."""

    def __init__(self, cfg: Geometry, max_sequences: int, arch: str = "auto", context: int | None = None,
                 **engine_options):
        max_sequences = inputs.integer("max_sequences", max_sequences)
        if max_sequences < 1:
            raise EngineError(f"max_sequences={max_sequences}: expected a positive number of sequence slots")
        if context is not None:
            context = inputs.integer("context", context)
            if not 1 <= context <= cfg.max_context:
                raise EngineError(f"context={context}: expected the tokens a slot holds, in [1, max_context="
                                  f"{cfg.max_context}]")
        self.cfg = cfg
        self.context = context
        self._options = dict(engine_options)
        arch = backend.activate(arch)
        caps = KVCache.caps(cfg, inputs.capacity(cfg, engine_options.get("capacity")))
        if NOPE in caps:  # the growing planes: ``context`` rows a slot now, or grown by doubling as sequences need
            caps[NOPE] = min(context, caps[NOPE]) if context is not None else min(caps[NOPE], NOPE_INITIAL_ROWS)
        self.pool = PlanePool(cfg, max_sequences, caps)
        self._slots = [Engine(cfg, arch=arch, pool_slot=(self.pool, i), **engine_options) for i in range(max_sequences)]
        self._launcher = BatchLauncher(cfg, self.pool, engine_options.get("launch", "auto"))
        self.arch = self._slots[0].arch
        self._free = list(range(max_sequences))  # slots, lowest first
        self._slot_of: dict[int, int] = {}  # sequence id -> slot, in the order they joined
        self._next_id = 0
        self._open = None  # the BatchToken or BatchPrompt in flight

    @classmethod
    def of(cls, engines: list) -> "Batch":
        """A batch over engines that exist (each already one sequence's: mlx-lm makes a cache per sequence and merges
        them), in that order, ids 0..n-1; no slot is free.  The engines are shared, not copied."""
        if not engines:
            raise EngineError("Batch.of: no engines")
        cfg = engines[0].cfg
        for i, eng in enumerate(engines):
            if eng.cfg != cfg:
                raise EngineError(f"Batch.of: engine {i}'s geometry {eng.cfg.name!r} is not engine 0's {cfg.name!r}")
        if len({id(e) for e in engines}) != len(engines):
            raise EngineError("Batch.of: an engine is listed twice; each sequence has its own")
        batch = cls.__new__(cls)
        batch.cfg, batch._options, batch._slots, batch.context = cfg, {}, list(engines), None
        batch.pool = batch._launcher = None  # each engine's own planes: its layers go out as its own launches
        batch.arch = engines[0].arch
        batch._free, batch._slot_of = [], {i: i for i in range(len(engines))}
        batch._next_id, batch._open = len(engines), None
        return batch

    # ---- the pool --------------------------------------------------------------------------------------
    @property
    def max_sequences(self) -> int:
        return len(self._slots)

    @property
    def sequences(self) -> list[int]:
        """The ids of the sequences held, in the order they joined."""
        return list(self._slot_of)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __repr__(self) -> str:
        return (f"<Batch {self.cfg.name}: {len(self)} of {self.max_sequences} sequences "
                f"{dict((i, self.sequence(i).position) for i in self._slot_of)} (id: position), arch {self.arch}>")

    def sequence(self, seq: int) -> Engine:
        """Sequence ``seq``'s engine: its position, planes, routes, rewind, save, reference."""
        return self._slots[self._slot(seq, "sequence")]

    def positions(self, seqs=None) -> list[int]:
        return [self.sequence(s).position for s in self._ids(seqs, "positions")]

    def join(self, snapshot=None) -> int:
        """A new sequence in a free slot: empty, or resuming a session ``Engine.save`` wrote (``snapshot``, a path).
        Returns its id.  A full pool refuses, naming what it holds; nothing changes."""
        self._check_none_open("join")
        if not self._free:
            raise EngineError(f"join: the pool is full: {self.max_sequences} of {self.max_sequences} slots hold "
                              f"sequences {self.sequences}; a joining sequence needs one free slot (let a sequence "
                              f"leave, or build the Batch with max_sequences > {self.max_sequences})")
        slot = self._free[0]
        if snapshot is not None:
            # loaded into the slot's engine in place: refused (a wrong geometry, a damaged file) with the slot as it was
            self._slots[slot].load(snapshot)
        self._free.pop(0)
        seq, self._next_id = self._next_id, self._next_id + 1
        self._slot_of[seq] = slot
        return seq

    def leave(self, seq: int) -> None:
        """Sequence ``seq`` leaves: its slot is emptied (its engine cleared: the rows are free, nothing is reallocated)
        and taken by the next sequence to join.  No other sequence's rows are touched."""
        self._check_none_open("leave")
        slot = self._slot(seq, "leave")
        self._empty(seq)
        del self._slot_of[seq]
        self._free.append(slot)
        self._free.sort()

    def save(self, folder) -> list:
        """Every sequence's session into ``folder`` (which must exist), one file a sequence in the order they joined
        (``seq-<id>.safetensors``, each Engine.save: atomic); returns the paths.  ``join(snapshot=path)`` resumes
        one, :meth:`resume` them all."""
        from pathlib import Path

        self._check_none_open("save")
        folder = Path(folder)
        if not folder.is_dir():
            raise EngineError(f"save: {folder} is not an existing folder")
        paths = []
        for seq in self.sequences:
            path = folder / f"seq-{seq}.safetensors"
            self.sequence(seq).save(path)
            paths.append(path)
        return paths

    def resume(self, paths) -> list[int]:
        """Join a sequence resuming each saved session in ``paths`` (Batch.save's, or any Engine.save's): their ids,
        in order.  Refused whole where the free slots are too few, naming how many; a file refused halfway (a damaged
        or mismatched one) takes back the sequences it joined."""
        paths = list(paths)
        if len(paths) > len(self._free):
            raise EngineError(f"resume: {len(paths)} sessions but {len(self._free)} free slot(s) of "
                              f"{self.max_sequences}; nothing was joined")
        joined = []
        try:
            for path in paths:
                joined.append(self.join(snapshot=path))
        except BaseException:
            for seq in joined:
                self.leave(seq)
            raise
        return joined

    def rewind(self, seq: int, position: int) -> None:
        """Sequence ``seq`` back to ``position`` (Engine.rewind: refused, unchanged, past what its rings hold)."""
        self._check_none_open("rewind")
        self.sequence(seq).rewind(position)

    def _empty(self, seq: int) -> None:
        """Sequence ``seq``'s slot emptied in place (Engine.clear: its rows are free for the next sequence)."""
        self._slots[self._slot_of[seq]].clear()

    def kv_bytes(self, seq: int) -> int:
        """The bytes sequence ``seq``'s slot holds for K and V (every plane's allocation, f16)."""
        eng, cfg = self.sequence(seq), self.cfg
        return sum(len(ps.layers) * ps.state.capacity for ps in eng.planes.values()) * cfg.n_kv_heads * cfg.head_dim * 4

    def rewind_each(self, n: int) -> None:
        """Every sequence takes back its last ``n`` tokens (a padded batch's crop); checked for every sequence first,
        so a refusal (a ring that no longer holds what the next token needs) names the sequence and changes
        nothing."""
        self._check_none_open("rewind")
        n = inputs.integer("rewind tokens", n)
        for seq in self.sequences:
            eng = self.sequence(seq)
            if not 0 <= n <= eng.position:
                raise EngineError(f"rewind {n} token(s): sequence {seq} holds {eng.position}; nothing was rewound")
            try:
                eng._planned(eng.cache.plan_rewind, eng.position - n)
            except EngineError as e:
                raise EngineError(f"rewind {n} token(s): sequence {seq}: {e}; nothing was rewound") from e
        for seq in self.sequences:
            self.sequence(seq).rewind(self.sequence(seq).position - n)

    # ---- a step ----------------------------------------------------------------------------------------
    def token(self, seqs=None, n: int = 1) -> "BatchToken":
        """Open the next token (``n`` tokens a sequence) of the sequences ``seqs`` (default: every sequence held, in
        the order they joined; row b of every array is ``seqs[b]``)::

            with batch.token() as t:
                out_l = t.attend(layer, q_l, k_l, v_l)   # q_l [B, n_heads, head_dim], k_l/v_l [B, n_kv_heads, head_dim]
        """
        return BatchToken(self, self._ids(seqs, "token"), n)

    def prompt(self, lengths: dict[int, int]) -> "BatchPrompt":
        """Open the prompts of several sequences, ``{seq: tokens}`` (each sequence's own length), whose K/V arrive
        layer by layer: ``with batch.prompt({a: 300, b: 12}) as p: p.store(layer, {a: (k, v), b: (k, v)})``."""
        return BatchPrompt(self, lengths)

    # ---- helpers ---------------------------------------------------------------------------------------
    def _slot(self, seq, what: str) -> int:
        if isinstance(seq, bool) or not isinstance(seq, int) or seq not in self._slot_of:
            raise EngineError(f"{what}: no sequence {seq!r} in the batch (it holds {self.sequences})")
        return self._slot_of[seq]

    def _ids(self, seqs, what: str) -> list[int]:
        if seqs is None:
            ids = self.sequences
        else:
            ids = [inputs.integer(f"{what} sequence", s) for s in seqs]
            for s in ids:
                self._slot(s, what)
            dup = sorted({s for s in ids if ids.count(s) > 1})
            if dup:
                raise EngineError(f"{what}: sequence(s) {dup} listed twice; each sequence is one row of the batch")
        if not ids:
            raise EngineError(f"{what}: no sequences (the batch holds {self.sequences})")
        return ids

    def _check_none_open(self, what: str) -> None:
        if self._open is not None and self._open.is_open:
            raise EngineError(f"{what}: {self._open.describe()}; commit or abandon it first")


class _BatchOpen:
    """What BatchToken and BatchPrompt share: one open token (or prompt) per sequence, committed or abandoned
    together."""

    what = "token"

    def __init__(self, batch: Batch, seqs: list[int]):
        batch._check_none_open(self.what)
        self.batch, self.seqs = batch, seqs
        self.opened: list = []
        self.is_open = False

    def _open_each(self, open_one) -> None:
        try:
            with interrupts.held_back():  # once for every sequence (each open would hold it back for itself)
                for row, seq in enumerate(self.seqs):
                    self.opened.append(open_one(seq, self.batch.sequence(seq)))
        except EngineError as e:
            self._abandon_opened()
            raise EngineError(f"{self.what} of sequence {seq} (row {row}): {e}; nothing was opened") from e
        except BaseException:
            self._abandon_opened()
            raise
        self.is_open = True
        self.batch._open = self

    def _abandon_opened(self) -> None:
        for one in self.opened:
            one.abandon()
        self.opened = []

    def describe(self) -> str:
        return f"a batch {self.what} of sequences {self.seqs} is open"

    def _refused(self, row: int, e: Exception):
        """Sequence ``row`` refused a layer: every sequence's token is abandoned; the error names the sequence."""
        self.abandon()
        return EngineError(f"sequence {self.seqs[row]} (row {row}): {e}; every sequence's {self.what} of this step was "
                           f"abandoned and the batch is as before it")

    def _check_batch_axis(self, name: str, x, layer: int, verb: str) -> None:
        shape = tuple(x.shape)
        if not shape or shape[0] != len(self.seqs):
            raise EngineError(f"{verb} layer {layer} {name}: shape {shape}, expected the batch's {len(self.seqs)} "
                              f"sequences first ([B, ...], row b is sequence seqs[b] of {self.seqs}); the step was "
                              f"abandoned")

    def _rows(self, name: str, x, layer: int, verb: str):
        """Row views of a [B, ...] array in its own kind."""
        try:
            self._check_batch_axis(name, x, layer, verb)
        except EngineError:
            self.abandon()
            raise
        return [x[b] for b in range(len(self.seqs))]

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
            raise EngineError(f"batch {self.what}: {missing}; it was abandoned and every sequence is as before it")
        self.commit()
        return False

    def _missing(self) -> str | None:
        """What keeps the step from committing (layers not yet run), or None."""
        return self.opened[0]._missing() if self.opened else None

    def abandon(self) -> None:
        """Undo every sequence's token: each exactly as before it.  Closed: nothing to do."""
        if not self.is_open:
            return
        with interrupts.held_back():
            self._abandon_opened()
            self._close()

    def _close(self) -> None:
        self.is_open = False
        if self.batch._open is self:
            self.batch._open = None


class BatchToken(_BatchOpen):
    """The next token of several sequences, attended layer by layer (Batch.token opens one).

    On a batch's pool (every Batch but ``Batch.of``'s) a one-token step goes out grouped: each layer's sequences on
    the project's own routes in one launch per route (batch_launch.py), and the rows their tokens overwrite kept in
    one launch when the step opens.  Otherwise (``n`` tokens a sequence, engines of their own) each sequence's
    layer is its own token's launches."""

    def __init__(self, batch: Batch, seqs: list[int], n: int = 1):
        super().__init__(batch, seqs)
        self.n = n
        self.launcher = batch._launcher if n == 1 else None
        grouped = self.launcher is not None
        self._open_each(lambda seq, eng: Token(eng, n, keep_rows=not grouped))
        self._saved = None
        self._states: dict[tuple, tuple] = {}  # (route, rows) -> (per-group table, largest split): made once a step
        self._device_stamps: dict[int, int] = {}  # row-scan stamp -> layer (device inputs)
        # the grouped path keeps the layer order for the batch (each sequence's token learns it at the commit, or
        # before a layer it attends alone), and, where no sequence forces a layer's route, groups the sequences by
        # route once a class a step: per layer nothing walks the batch
        self.next_layer = 0
        self._by_class = {} if grouped and not any(tok.engine._forced for tok in self.opened) else None
        if grouped:
            self._first_stamp = self.launcher.stamp + 1
            self._slot_ids = [batch._slot_of[s] for s in seqs]
            try:
                with interrupts.held_back():
                    self._save_rows()
            except BaseException:
                self.abandon()
                raise

    # ---- the rows a step overwrites ------------------------------------------------------------------
    def _save_rows(self) -> None:
        """Every sequence's row this token takes in every plane, in one launch a class: a ring's row may hold a token
        a rewind still needs, and a growing plane's row past len is dead but kept too, so an abandoned step leaves
        the planes exactly as they were, bit for bit."""
        rows = {kind: tuple(tok.plans[0][1][kind].physical(tok.start) for tok in self.opened)
                for kind in self.batch.pool.k}
        self._saved = self.launcher.keep_rows(self._slot_ids, rows)

    def _abandon_opened(self) -> None:
        if self._saved is not None:
            self.launcher.restore_rows(self._saved)
            self._saved = None
        super()._abandon_opened()

    # ---- a layer ---------------------------------------------------------------------------------------
    def attend(self, layer: int, q, k, v):
        """Attend every sequence's token at ``layer``: q [B, n_heads, head_dim] (or [B, n, heads, d]), k and v
        [B, n_kv_heads, head_dim] (or [B, n, ...]), any kind arrays.py takes; returns [B, ...] like q, in q's kind."""
        if not self.is_open:
            raise EngineError(f"attend layer {layer!r}: this batch token is closed (committed or abandoned)")
        if self.launcher is not None:
            try:
                layer = self._check_layer(layer)
            except EngineError:
                self.abandon()
                raise
            return self._attend_grouped(layer, q, k, v)
        rows = [self._rows(name, x, layer, "attend") for name, x in (("q", q), ("k", k), ("v", v))]
        outs = []
        for b, tok in enumerate(self.opened):
            try:
                outs.append(tok.attend(layer, rows[0][b], rows[1][b], rows[2][b]))
            except EngineError as e:
                raise self._refused(b, e) from e
            except BaseException:
                self.abandon()
                raise
        return stack(outs, q)

    def _missing(self) -> str | None:
        if self.launcher is None:
            return super()._missing()
        L = self.batch.cfg.n_layers
        if self.next_layer == L:
            return None
        return (f"layers {self.next_layer}..{L - 1} have not run (every layer runs once, in order)"
                if self.next_layer < L - 1 else f"layer {L - 1} has not run")

    def _check_layer(self, layer) -> int:
        """The batch's layer order (a grouped step's: one for every sequence)."""
        L = self.batch.cfg.n_layers
        layer = inputs.integer("attend layer", layer)
        if not 0 <= layer < L:
            raise EngineError(f"attend layer {layer}: expected a layer in [0, {L})")
        if layer != self.next_layer:
            raise EngineError(f"attend layer {layer}: " + (
                f"this batch token's layers 0..{self.next_layer - 1} have attended; layer {self.next_layer} is next"
                if layer < self.next_layer else f"out of order: layer {self.next_layer} is next (layers attend in "
                                                f"order 0..{L - 1})"))
        return layer

    def _grouping(self, layer: int) -> tuple[dict, tuple, tuple]:
        """(route -> activation rows, the rows on a pinned route (each alone), route -> their slots) at ``layer``:
        once a class a step where no sequence forces a route, else walked for the layer."""
        kind = self.batch.cfg.layer_kinds[layer]
        if self._by_class is not None and kind in self._by_class:
            return self._by_class[kind]
        by_route: dict[str, list[int]] = {}
        for b, tok in enumerate(self.opened):
            by_route.setdefault(tok.plans[0][2][layer], []).append(b)
        groups = {route: tuple(rows) for route, rows in by_route.items()}
        alone = tuple(sorted(b for r, rows in groups.items() if r not in GROUP_ROUTES for b in rows))
        slots = {route: tuple(self._slot_ids[b] for b in rows) for route, rows in groups.items()}
        got = (groups, alone, slots)
        if self._by_class is not None:
            self._by_class[kind] = got
        return got

    def _attend_grouped(self, layer: int, q, k, v):
        """Each route's sequences in one launch (batch_launch.py); a sequence on a pinned route, its own launches."""
        L, cfg, B = self.launcher, self.batch.cfg, len(self.seqs)
        where = f"attend layer {layer}"
        groups, alone, slots = self._grouping(layer)
        shapes = {"q": (B, cfg.n_heads, cfg.head_dim), "k": (B, cfg.n_kv_heads, cfg.head_dim),
                  "v": (B, cfg.n_kv_heads, cfg.head_dim)}
        try:
            for name, x in zip("qkv", (q, k, v)):
                self._check_batch_axis(name, x, layer, "attend")
            device, io = self._inputs(where, (q, k, v), shapes)
            dispatches = []
            if device is not None:
                scan, stamp = L.scan(io, B)
                self._device_stamps[stamp] = layer
                dispatches.append(scan)
            for route, rows in groups.items():
                if route in GROUP_ROUTES:
                    state, nwg_max = self._state(route, rows)
                    dispatches += L.dispatches(route, layer, rows, slots[route], state, nwg_max, io)
            L.run(layer, dispatches)
            self.next_layer = layer + 1
            if device is None:
                out = L.get_host(B)
            elif io[3] is not L.out:  # the reducer wrote the caller's tensor where it lies
                out = io[3]
            else:
                out = arrays.device_out(device[0], shapes["q"])
                if not L.get_device(out):
                    raise EngineError(f"{where}: the CUDA driver could not copy the output back")
            for b in alone:
                row = self._alone(layer, b, q, k, v)
                out[b] = (row if device is not None else arrays.to_host(f"{where} out", row)).reshape(out[b].shape)
        except EngineError as e:
            if self.is_open and getattr(e, "row", None) is not None:
                raise self._refused(e.row, e) from e
            self.abandon()
            raise
        except BaseException:
            self.abandon()
            raise
        shape = tuple(q.shape)
        if device is not None:
            return out.reshape(shape)
        return arrays.like_input(out.reshape(shape) if len(shape) == 4 else out, q)

    def _alone(self, layer: int, b: int, q, k, v):
        """Row b's layer through its own token (a pinned route): what it returns, in q's kind."""
        tok = self.opened[b]
        tok.next_layer = layer  # the batch keeps the order; the token's own check then holds
        try:
            return tok.attend(layer, q[b], k[b], v[b])
        except EngineError as e:
            e.row = b
            raise

    def _inputs(self, where: str, qkv, shapes):
        """q, k, v where the layer's launches read them: (device tensors or None, io = (q, k, v, out)).  Device
        tensors (torch CUDA) are launched on where they lie on the C-API path (the output a new tensor beside them),
        else copied into the launcher's arrays on the device; either way they are scanned there.  Host arrays are
        checked here (a bad value names its sequence) and copied into the launcher's arrays."""
        L = self.launcher
        arch = self.batch.arch
        if L.gpu and all(arrays.framework_of(a) == "torch" and arrays.device_resident(a, arch) for a in qkv):
            dev = [_one_token(arrays.device_f32(f"{where} {name}", a), shapes[name]) for name, a in zip("qkv", qkv)]
            for name, a in zip("qkv", dev):
                if tuple(a.shape) != shapes[name]:
                    raise EngineError(f"{where} {name}: shape {tuple(a.shape)}, expected {shapes[name]} (sequence, "
                                      f"heads, head_dim)")
            compiled = L.compiled
            if compiled is not None and compiled.can_import():
                return dev, (*dev, arrays.device_out(dev[0], shapes["q"]))
            if L.put_device(dev):  # into the leading rows of the launcher's arrays
                return dev, L.own_io()
        host = []
        for name, a in zip("qkv", qkv):
            h = _one_token(arrays.to_host(f"{where} {name}", a), shapes[name])
            bad = checked_rows(where, name, h, shapes[name])
            if bad is not None:
                try:
                    _checked(where, name, h[bad], shapes[name][1:], AXES)
                except EngineError as e:
                    e.row = bad
                    raise
            host.append(h)
        L.put_host(tuple(host))
        return None, L.own_io()

    def _state(self, route: str, rows: tuple[int, ...]):
        """The per-group table of the sequences ``rows`` on ``route`` (batch_launch.group_state), once a step."""
        got = self._states.get((route, rows))
        if got is None:
            toks = [self.opened[b] for b in rows]
            got = self._states[route, rows] = group_state([t.plans[0] for t in toks], GROUP_ROUTES[route], route,
                                                          [t.engine.launcher for t in toks],
                                                          [t.route_sizes[0] for t in toks])
        table, nwg_max = got
        return self.launcher.held(("state", route, len(rows)), table), nwg_max

    def commit(self) -> None:
        """Commit every sequence's token (every layer has attended).  The device scans' flags of every sequence are
        read first, so a refusal abandons them all before any commits."""
        if not self.is_open:
            raise EngineError("commit: this batch token is closed (committed or abandoned)")
        missing = self._missing()
        if missing is not None:
            raise EngineError(f"commit: {missing}; attend the rest, or abandon() the batch token")
        if self._device_stamps:
            refused = self.launcher.refused_rows(self._first_stamp, len(self.seqs))
            if refused:
                b = min(refused)
                stamp, what = refused[b]
                raise self._refused(b, EngineError(f"attend layer {self._device_stamps.get(stamp, '?')}: the device "
                                                   f"scan refused its arrays ({'; '.join(what)}; the last layer that "
                                                   f"flagged it)"))
        if self.launcher is not None:  # each token learns the batch's layer order
            for tok in self.opened:
                tok.next_layer = self.next_layer
        for b, tok in enumerate(self.opened):
            try:
                tok.check()
            except EngineError as e:
                raise self._refused(b, e) from e
        with interrupts.held_back():
            for tok in self.opened:
                tok.commit()
            self._saved = None
            self._close()


class BatchPrompt(_BatchOpen):
    """Several sequences' prompts, each its own length, stored layer by layer (Batch.prompt opens one)."""

    what = "prompt"

    def __init__(self, batch: Batch, lengths: dict[int, int]):
        if not isinstance(lengths, dict) or not lengths:
            raise EngineError(f"prompt: expected {{sequence: tokens}} for one or more sequences, got {lengths!r}")
        seqs = batch._ids(list(lengths), "prompt")
        super().__init__(batch, seqs)
        held = {s: batch.sequence(s).position for s in seqs if batch.sequence(s).position}
        if held:
            raise EngineError(f"prompt: sequence(s) {held} (id: position) already hold tokens; a prompt goes into an "
                              f"empty sequence (more tokens after it: token(n))")
        self.lengths = dict(lengths)
        self._open_each(lambda seq, eng: eng.prompt(lengths[seq]))

    def store(self, layer: int, kv: dict) -> None:
        """Every sequence's K/V at ``layer``: ``{seq: (k, v)}``, each [tokens, n_kv_heads, head_dim] of that sequence's
        length."""
        if not self.is_open:
            raise EngineError(f"store layer {layer!r}: this batch prompt is closed (committed or abandoned)")
        if not isinstance(kv, dict) or sorted(kv) != sorted(self.seqs):
            got = sorted(kv) if isinstance(kv, dict) else type(kv).__name__
            self.abandon()
            raise EngineError(f"store layer {layer}: expected K/V for sequences {sorted(self.seqs)}, got {got}; the "
                              f"prompts were abandoned")
        for b, (seq, pr) in enumerate(zip(self.seqs, self.opened)):
            try:
                pr.store(layer, *kv[seq])
            except EngineError as e:
                raise self._refused(b, e) from e
            except BaseException:
                self.abandon()
                raise

    def commit(self) -> None:
        """Every sequence's prompt goes in as its prefill (each was planned when it opened).  Should one still fail,
        the sequences already in are emptied again: a prompt opens only on an empty sequence."""
        if not self.is_open:
            raise EngineError("commit: this batch prompt is closed (committed or abandoned)")
        done = []
        with interrupts.held_back():
            try:
                for seq, pr in zip(self.seqs, self.opened):
                    pr.commit()
                    done.append(seq)
            except BaseException:
                for seq in done:
                    self.batch._empty(seq)
                self._abandon_opened()
                self._close()
                raise
            self._close()


def _one_token(a, shape: tuple[int, ...]):
    """[B, 1, heads, d] (one token a sequence, with the token axis) as the [B, heads, d] the kernels take."""
    if tuple(a.shape) == (shape[0], 1, *shape[1:]):
        return a.reshape(shape)
    return a


def stack(outs: list, like):
    """Per-sequence outputs as one [B, ...] array of ``like``'s kind."""
    kind = arrays.framework_of(like)
    if kind == "torch":
        import torch

        return torch.stack(outs)
    if kind == "mlx":
        import mlx.core as mx

        return mx.stack(outs)
    import numpy as np

    if kind == "numpy":
        return np.stack(outs)
    return arrays.like_input(np.stack([arrays.to_host("out", o) for o in outs]), like)


__all__ = ["Batch", "BatchPrompt", "BatchToken", "stack"]
