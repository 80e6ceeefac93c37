"""A model's forward pass on the engine, framework-free: what both integrations share.

A framework calls, per layer, its cache (transformers' ``Cache.update``, mlx-lm's ``update_and_fetch``) and then
its attention function.  :class:`Forward` owns the forward's life on one engine:

* layer 0's cache call **opens** it: a prompt (several tokens on an empty engine: the framework's own attention
  computes the prompt, the engine ingests its K/V layer by layer, ``Engine.prompt``) or a token (one token, or
  several after the prompt: a speculative verify pass, ``Engine.token(n)``);
* every layer's cache call **hands** (layer, k, v) to its attention call, which must come next with those very
  arrays; the attention call attends (or stores) and the last layer **commits**;
* a forward that raised **recovers**: the next call on the cache abandons what it left open, so the engine is
  exactly as before that forward;
* between forwards, **rewind** takes tokens back (speculative decoding's rejected drafts).

The forward in flight is also the *current* forward (:func:`current`) from layer 0's cache call to its commit
or recovery: a context variable scoped to that one forward, for an attention function that is not handed the
cache (transformers' ``AttentionInterface``), as vLLM's forward context is set around one forward.

``rollback``, the same in both integrations: the most tokens a rewind is sure to take back at any point.  A
full sliding-window ring takes back one token without slack (the next token at that position needs only what
the ring holds); N tokens need N - 1 rows of slack beyond the window (``swa_ring_slack``).
"""

from __future__ import annotations

import contextvars

from .. import Engine, geometry_from_model_config
from ..errors import EngineError

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("muser_ti_forward", default=None)

GEOMETRY_FIELDS = ("n_heads", "n_kv_heads", "head_dim", "n_layers", "layer_kinds", "window", "attention_scale")


def current():
    """The forward in flight in this context (between layer 0's cache call and its commit), or None."""
    return _CURRENT.get()


def slack_for(rollback: int) -> int:
    """The rings' slack beyond the window that lets a rewind take back ``rollback`` tokens at any point."""
    rollback = int(rollback)
    if rollback < 0:
        raise EngineError(f"rollback={rollback}: expected the number of tokens a rewind may take back (>= 0)")
    return max(rollback - 1, 0)


def build_engine(config, arch: str, rollback: int, max_context, engine, options: dict, who: str) -> Engine:
    """A new Engine on the geometry of a model's config (anything geometry_from_model_config reads), or ``engine``
    checked against it.  ``who`` names the caller in messages ("MuserCache", "make_cache")."""
    if engine is None:
        geometry = geometry_from_model_config(config, max_context=max_context, swa_ring_slack=slack_for(rollback))
        return Engine(geometry, arch=arch, **options)
    if options or max_context is not None or rollback:
        raise EngineError(f"{who}(engine=...): the engine brings its own geometry and options; pass rollback=, "
                          f"max_context= and engine options only for a new engine")
    want = geometry_from_model_config(config, max_context=engine.cfg.max_context,
                                      swa_ring_slack=engine.cfg.swa_ring_slack)
    diff = [f"{f} {getattr(engine.cfg, f)!r} (model: {getattr(want, f)!r})" for f in GEOMETRY_FIELDS
            if getattr(engine.cfg, f) != getattr(want, f)]
    if diff:
        raise EngineError(f"{who}: the engine's geometry is not the model's: " + "; ".join(diff))
    return engine


class Forward:
    """One engine and the forward in flight on it.  ``cache_call`` names the framework's cache call in messages
    (e.g. "MuserCache.update"); ``route_hint`` says what routes a model's attention through the engine, for the
    message when a layer's attention never arrived; ``owner``: the framework's object the attention function
    reaches through :func:`current`."""

    def __init__(self, engine: Engine, cache_call: str, route_hint: str, owner=None):
        self.engine = engine
        self.owner = owner  # the framework's side (a MuserCache, an mlx-lm session): what an attention function reaches
        self.cache_call, self.route_hint = cache_call, route_hint
        self.opened = None  # the Token or Prompt layer 0 opened
        self.mode = None  # "prompt" | "token"
        self.pending = None  # (layer, k, v) the cache call handed on, for the attention call to take
        self.rewinds = 0  # rewinds that dropped tokens, and how many they dropped (observable)
        self.tokens_rewound = 0

    # ---- what the engine holds -------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.engine.cfg.n_layers

    @property
    def rollback(self) -> int:
        """The most tokens a rewind is sure to take back: the rings' slack + 1 (growing planes alone: all)."""
        cfg = self.engine.cfg
        return cfg.swa_ring_slack + 1 if cfg.swa_layers else self.engine.position

    @property
    def position(self) -> int:
        return self.engine.position

    # ---- a forward ---------------------------------------------------------------------------------------
    def hand(self, layer: int, n: int, k, v) -> None:
        """The cache call of ``layer`` with the forward's ``n`` tokens: layer 0 opens the forward; every layer's
        (k, v) wait for its attention call.  Out of order, or a layer whose attention never came: refused, the
        engine as before this forward."""
        if not 0 <= layer < self.n_layers:
            raise EngineError(f"{self.cache_call} layer {layer}: the engine has layers 0..{self.n_layers - 1}")
        if layer == 0:
            self.recover()
            eng = self.engine
            if n > 1 and eng.position == 0:
                self.mode, self.opened = "prompt", eng.prompt(n)
            else:
                self.mode, self.opened = "token", eng.token(n)
            _CURRENT.set(self)
        else:
            problem = self._out_of_order(layer, n)
            if problem is not None:
                self.recover()
                raise EngineError(f"{self.cache_call}: {problem}; the engine is as before this forward")
        self.pending = (layer, k, v)

    def _progress(self) -> tuple[int, int] | None:
        """(the layer next, the forward's tokens) while a forward is open, else None."""
        opened = self.opened
        return (opened.next_layer, opened.n) if opened is not None and opened.is_open else None

    def _out_of_order(self, layer: int, n: int) -> str | None:
        progress = self._progress()
        if progress is None:
            return (f"layer {layer} arrived with no forward open (layer 0 opens it): layers must run "
                    f"0..{self.n_layers - 1} in order")
        if self.pending is not None:
            return (f"layer {self.pending[0]}'s attention did not run through the engine ({self.route_hint}), so the "
                    f"engine never saw it")
        next_layer, opened_n = progress
        if layer != next_layer:
            return f"layer {layer} arrived where layer {next_layer} was next"
        if n != opened_n:
            return f"layer {layer} has {n} token(s), the forward opened with {opened_n}"
        return None

    def take(self, layer: int, k, v, who: str) -> None:
        """The attention call of ``layer`` takes what its cache call handed on: the same layer, the very k and v."""
        pending, self.pending = self.pending, None
        if pending is None or pending[0] != layer or pending[1] is not k or pending[2] is not v:
            raise EngineError(f"{who} at layer {layer}: called without this layer's {self.cache_call} just before it "
                              f"(or with other keys/values than it returned)")

    def attend(self, layer: int, q, k, v):
        """A token forward's attention at ``layer`` on the engine: q [n, heads, d] or [heads, d], k/v likewise."""
        return self.opened.attend(layer, q, k, v)

    def store(self, layer: int, k, v) -> None:
        """A prompt forward's K/V at ``layer`` into the engine (the framework's attention computed its outputs)."""
        self.opened.store(layer, k, v)

    def finish(self, layer: int) -> None:
        """After ``layer``'s attention: the last layer commits the forward."""
        if layer == self.n_layers - 1:
            opened, self.opened, self.mode = self.opened, None, None
            self._release()
            opened.commit()

    def recover(self) -> None:
        """Abandon what a forward that raised left open: the engine goes back to before that forward."""
        self.pending = None
        self._release()
        opened, self.opened, self.mode = self.opened, None, None
        if opened is not None and opened.is_open:
            opened.abandon()

    def _release(self) -> None:
        # cleared only where this forward is the current one: a stale forward recovered late (its cache cropped
        # after another cache's forward opened) must not clear the other's
        if _CURRENT.get() is self:
            _CURRENT.set(None)

    # ---- between forwards --------------------------------------------------------------------------------
    def rewind(self, n: int, who: str, option: str) -> int:
        """Take back the last ``n`` tokens (at most the tokens held): Engine.rewind, refused with the engine unchanged
        past what the rings hold; ``option`` names how the caller builds a cache that holds more (e.g.
        "make_cache(model, rollback=N)").  Returns the tokens taken back."""
        self.recover()
        position = self.engine.position
        n_eff = min(int(n), position)
        if n_eff <= 0:
            return 0
        try:
            self.engine.rewind(position - n_eff)
        except EngineError as e:
            raise EngineError(f"{who} at position {position}: {e} (this cache takes back {self.rollback} token(s) at "
                              f"any point; {option} takes back N: build it with N covering the longest draft)") from e
        self.rewinds += 1
        self.tokens_rewound += n_eff
        return n_eff

    def save(self, path) -> None:
        """The engine's session to a safetensors file (Engine.save), a forward left open abandoned first."""
        self.recover()
        self.engine.save(path)


class BatchForward(Forward):
    """A batch's forward on a :class:`~muser_ti.batch.Batch`: what :class:`Forward` does for one engine, for the
    left-padded batch a framework's ``generate`` runs (row b of every tensor is sequence ``seqs[b]``).

    The framework's tensors are padded: a row's first ``pads[b]`` positions are padding that its mask hides.  The
    batch holds each sequence's real tokens only, so sequence b's position is the padded length less ``pads[b]``
    (``position`` here is the padded length, as the framework counts it).  The prompt's padding is known from
    its mask at layer 0's attention (``store(..., pads)``), so a batch prompt opens there, not at the cache call."""

    def __init__(self, batch, cache_call: str, route_hint: str, owner=None):
        super().__init__(None, cache_call, route_hint, owner)  # no one engine: the batch's sequences have theirs
        self.batch = batch
        self.seqs = batch.sequences or [batch.join() for _ in range(batch.max_sequences)]
        self.pads = [0] * len(self.seqs)
        self.spans = None
        self.held = 0  # the padded length committed: the framework's count of positions
        self.n = 0  # the forward's tokens and the layer next: a batch prompt opens at layer 0's attention, not before
        self.next_layer = 0

    @property
    def n_layers(self) -> int:
        return self.batch.cfg.n_layers

    @property
    def size(self) -> int:
        return len(self.seqs)

    @property
    def empty(self) -> bool:
        return all(p == 0 for p in self.batch.positions(self.seqs))

    @property
    def position(self) -> int:
        """The padded length committed: every row's padding and tokens (the same for every row)."""
        return self.held

    @property
    def rollback(self) -> int:
        cfg = self.batch.cfg
        return cfg.swa_ring_slack + 1 if cfg.swa_layers else min(self.batch.positions(self.seqs))

    def hand(self, layer: int, n: int, k, v) -> None:
        """As Forward.hand; a token forward opens every sequence's token at layer 0, a prompt waits for its mask."""
        if not 0 <= layer < self.n_layers:
            raise EngineError(f"{self.cache_call} layer {layer}: the engine has layers 0..{self.n_layers - 1}")
        if tuple(k.shape)[0] != self.size:
            self.recover()
            raise EngineError(f"{self.cache_call} layer {layer}: batch size {tuple(k.shape)[0]}, but this cache holds "
                              f"{self.size} sequences (a cache serves one batch: reset() it, or build another)")
        if layer == 0:
            self.recover()
            if n > 1 and self.empty:
                self.mode = "prompt"
            else:
                self.mode, self.opened = "token", self.batch.token(self.seqs, n)
            self.n, self.next_layer = n, 0
            _CURRENT.set(self)
        else:
            problem = self._out_of_order(layer, n)
            if problem is not None:
                self.recover()
                raise EngineError(f"{self.cache_call}: {problem}; the batch is as before this forward")
        self.pending = (layer, k, v)

    def _progress(self) -> tuple[int, int] | None:
        if self.mode is None or (self.opened is not None and not self.opened.is_open):
            return None
        return self.next_layer, self.n

    def attend(self, layer: int, q, k, v):
        """A token forward's attention at ``layer``: q [B, n, heads, d] or [B, heads, d], k/v likewise."""
        out = self.opened.attend(layer, q, k, v)
        self.next_layer += 1
        return out

    def store(self, layer: int, k, v, spans: list[tuple[int, int]]) -> None:
        """A prompt forward's K/V at ``layer``, [B, tokens, kv_heads, d], row b's tokens ``spans[b]`` = (start, stop)
        (left padding, known from the mask: (pad, n); right padding: (0, length)): layer 0 opens each sequence's
        prompt with its own length (a row with none stays empty)."""
        spans = [(int(a), int(b)) for a, b in spans]
        if layer == 0:
            self.spans = spans
            self.pads = [a for a, _ in spans]
            self.opened = self.batch.prompt({seq: b - a for seq, (a, b) in zip(self.seqs, spans) if b > a})
        elif spans != self.spans:
            raise EngineError(f"{self.cache_call} layer {layer}: the prompt's rows hold tokens {spans}, layer 0's "
                              f"{self.spans}")
        self.opened.store(layer, {seq: (k[b, lo:hi], v[b, lo:hi])
                                  for b, (seq, (lo, hi)) in enumerate(zip(self.seqs, spans)) if hi > lo})
        self.next_layer += 1

    def finish(self, layer: int) -> None:
        if layer == self.n_layers - 1:
            opened, self.opened, self.mode = self.opened, None, None
            self._release()
            opened.commit()
            self.held += self.n

    def save(self, path) -> None:
        raise EngineError(f"save: this cache holds {self.size} sequences, each on its own engine: save them with "
                          f"batch.save(folder), or one by one with batch.sequence(seq).save(path)")

    def rewind(self, n: int, who: str, option: str) -> int:
        """Every sequence takes back its last ``n`` tokens (Batch.rewind_each: all or none)."""
        self.recover()
        n_eff = min(int(n), min(self.batch.positions(self.seqs)))
        if n_eff <= 0:
            return 0
        try:
            self.batch.rewind_each(n_eff)
        except EngineError as e:
            raise EngineError(f"{who}: {e} (this cache takes back {self.rollback} token(s) at any point; {option} "
                              f"takes back N)") from e
        self.held -= n_eff
        self.rewinds += 1
        self.tokens_rewound += n_eff
        return n_eff


__all__ = ["BatchForward", "Forward", "build_engine", "current", "slack_for"]
