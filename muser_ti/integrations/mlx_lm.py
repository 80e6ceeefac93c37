"""The engine as the attention and KV cache of an mlx-lm model (Muse Glimmer), through mlx-lm's own cache protocol.

    from mlx_lm import load, generate, stream_generate
    from muser_ti.integrations import mlx_lm as mt_mlx

    model, tokenizer = load("mlx-community/...")                 # or muse_glimmer.Model(ModelArgs(...))
    cache = mt_mlx.make_cache(model, arch="auto")                # in place of model.make_cache()
    text = generate(model, tokenizer, prompt, prompt_cache=cache)
    cache[0].engine                                              # the Engine: routes, route_counts, planes

    # speculative decoding (mlx-lm's own draft-and-verify loop): the rings must roll back a draft's length
    cache = mt_mlx.make_cache(model, rollback=8) + draft_model.make_cache()
    stream_generate(model, tokenizer, prompt, draft_model=draft_model, num_draft_tokens=4, prompt_cache=cache)

How a forward reaches the engine.  mlx-lm has no attention registry: the model module calls the name
``scaled_dot_product_attention`` it imported from ``mlx_lm.models.base``, after ``cache.update_and_fetch``.
``make_cache`` (or :func:`install`) puts a dispatcher under that name, in ``mlx_lm.models.base`` and in every
loaded ``mlx_lm.models`` module that imported it; the dispatcher calls the original for any cache that is not
a :class:`MuserKVCache`, so other models and mlx-lm's own caches run exactly as before.  For ours, layer 0's
``update_and_fetch`` decides what the forward is:

* several tokens on an empty cache (the prompt): mlx's own attention computes the prompt's outputs over the
  chunk's k/v with the mask the model built, and the engine ingests the chunk's K/V layer by layer
  (``Engine.prompt``), committed after the last layer;
* one token: layer 0 opens ``Engine.token()``, every layer attends on the engine, the last layer commits;
* several tokens after the prompt (a speculative verify pass, a second prompt chunk): ``Engine.token(n)``,
  each token over the cache and the chunk's earlier tokens.

The engine's work runs when the model's Python reaches each layer (mlx builds graphs lazily; the engine reads
q, k and v at once, so a forward on our cache evaluates layer by layer).  mlx arrays cross on the CPU through
the buffer protocol: at most one copy in (a layout change), one copy out.

A forward that raises between layers leaves its token open; the next call on the cache (the next forward's
layer 0, ``trim``, :func:`save_cache`) abandons it first, so the engine is exactly as before that forward.

Rollback.  ``trim(n)`` is ``Engine.rewind(position - n)``; mlx-lm trims every layer's cache by the same n, and
the shared engine rewinds once.  ``make_cache(model, rollback=N)`` takes back up to N tokens at any point
(integrations/forward.py says how the rings hold them; transformers' ``MuserCache(config, rollback=N)`` means the
same); mlx-lm's speculative loop trims at most ``num_draft_tokens`` a round.  ``is_trimmable()`` is a property of
the cache, not of the moment: True where it was built with ``rollback > 0`` (or the model has no sliding layers).  It never
turns False mid-generation because mlx-lm's ``trim_prompt_cache`` silently skips a cache that says it cannot
trim (mlx-lm's own RotatingKVCache does that once its ring is full, and a speculative run then keeps the
rejected draft tokens); a trim past what the rings hold is refused with EngineError, the cache unchanged.

Saving.  mlx-lm's ``save_prompt_cache`` stores each cache's ``state`` as mlx arrays and rebuilds caches by
class name from ``mlx_lm.models.cache``; the engine's planes are neither, so it is refused with a message
naming :func:`save_cache` / :func:`load_cache` (``Engine.save``: atomic, bit-for-bit resumable).

Many sequences: mlx-lm's batch generation (``batch_generate``, ``BatchGenerator``) takes a cache list per
prompt, ``prompt_caches=[make_cache(model) for _ in prompts]``, and merges them layer by layer (``merge``) into a
:class:`MuserBatchKVCache` a layer over one :class:`MuserBatchSession`: the sequences' own engines, attended
together layer by layer (muser_ti/batch.py), filtered when a sequence ends and extended when one joins, as
mlx-lm's ``BatchKVCache`` is.  The prompts arrive right-padded in one chunk (each engine takes its row's own
tokens; ``prefill_step_size`` at least the longest prompt).  The engines are the sequences' own, so the lists
passed in follow the batch (mlx-lm's own caches are copied when merged).  A make_cache list itself runs one
sequence.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models import base as _mlx_base
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from .. import Engine
from ..batch import Batch
from ..config import NOPE, SWA
from ..errors import EngineError
from . import forward as fwd

__all__ = ["MuserBatchKVCache", "MuserBatchSession", "MuserKVCache", "MuserSession", "install", "load_cache", "make_cache", "save_cache",
           "scaled_dot_product_attention", "uninstall"]


# ---- the dispatcher ----------------------------------------------------------------------------------

def _find_original():
    fn = _mlx_base.scaled_dot_product_attention
    return getattr(fn, "_muser_original", fn)


_ORIGINAL = _find_original()  # mlx-lm's own scaled_dot_product_attention


def scaled_dot_product_attention(queries, keys, values, cache=None, scale=None, mask=None, sinks=None, **kwargs):
    """mlx-lm's ``scaled_dot_product_attention`` with the engine behind a :class:`MuserKVCache`: any other cache
    (or none) goes to mlx-lm's own function unchanged."""
    if isinstance(cache, (MuserKVCache, MuserBatchKVCache)):
        if kwargs:
            raise EngineError(f"muser_ti attention, layer {cache.layer}: arguments {sorted(kwargs)} are not supported")
        return cache.session._attend(cache.layer, queries, keys, values, scale, mask, sinks)
    if sinks is not None:
        kwargs["sinks"] = sinks
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)


scaled_dot_product_attention._muser_original = _ORIGINAL
_NAME = "scaled_dot_product_attention"


def _model_modules():
    """mlx_lm.models.base and every loaded mlx_lm.models module holding mlx-lm's own function."""
    found = [_mlx_base]
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and module is not None and module is not _mlx_base:
            if getattr(module, _NAME, None) in (_ORIGINAL, scaled_dot_product_attention):
                found.append(module)
    return found


def install(model=None) -> None:
    """Put the dispatcher where mlx-lm's model modules look the attention up (idempotent; ``make_cache`` calls
    it).  ``model``: also its own module, wherever it was loaded from.  Caches other than ours are untouched."""
    modules = _model_modules()
    if model is not None:
        module = sys.modules.get(type(model).__module__)
        if module is not None and module not in modules:
            have = getattr(module, _NAME, None)
            if have is None:
                raise EngineError(f"{type(model).__module__}: the model module has no '{_NAME}' to route through the "
                                  f"engine (mlx-lm's model modules import it from mlx_lm.models.base)")
            if have not in (_ORIGINAL, scaled_dot_product_attention):
                raise EngineError(f"{type(model).__module__}.{_NAME} is neither mlx-lm's nor muser_ti's; refusing to "
                                  f"replace it")
            modules.append(module)
    for module in modules:
        setattr(module, _NAME, scaled_dot_product_attention)


def uninstall() -> None:
    """Put mlx-lm's own function back everywhere :func:`install` put the dispatcher."""
    for name, module in list(sys.modules.items()):
        if module is not None and (name.startswith("mlx_lm.") or module is _mlx_base):
            if getattr(module, _NAME, None) is scaled_dot_product_attention:
                setattr(module, _NAME, _ORIGINAL)


# ---- the shared session --------------------------------------------------------------------------------

class _Unserializable:
    """What ``state`` holds: mlx.core.eval skips it (mlx-lm evaluates every cache's state after a prompt chunk),
    and mlx-lm's save_prompt_cache refuses it, printing this repr."""

    def __repr__(self) -> str:
        return ("<muser_ti engine cache: its K/V live in the engine's planes, which mlx-lm's save_prompt_cache "
                "cannot hold; save with muser_ti.integrations.mlx_lm.save_cache(cache, path) (Engine.save) and resume "
                "with load_cache(model, path)>")


_UNSERIALIZABLE = _Unserializable()


class MuserSession(fwd.Forward):
    """One engine shared by a model's per-layer caches, and the forward in flight on it (integrations/forward.py),
    with mlx-lm's side: the dispatcher's attention call and the per-layer trims of a round."""

    def __init__(self, engine: Engine, model_args=None, trimmable: bool = True):
        super().__init__(engine, "MuserKVCache.update_and_fetch",
                         f"the model module's '{_NAME}' is not the one install() puts there")
        self.owner = self
        self.model_args = model_args
        self.trimmable = trimmable or not engine.cfg.swa_layers  # what is_trimmable() says (MuserKVCache)
        self._trim_round = None  # (n, position after the rewind, layers that have trimmed, tokens taken back)

    def __repr__(self) -> str:
        return (f"<MuserSession: {self.n_layers} layers at position {self.engine.position}, arch {self.engine.arch}, "
                f"rollback {self.rollback}>")

    # ---- a forward ---------------------------------------------------------------------------------------
    def _update(self, layer: int, keys, values):
        shape = tuple(keys.shape)
        if len(shape) != 4 or tuple(values.shape)[:3] != shape[:3]:
            self.recover()
            raise EngineError(f"MuserKVCache.update_and_fetch layer {layer}: keys {shape} and values "
                              f"{tuple(values.shape)}, expected both [batch, kv_heads, tokens, head_dim]")
        if shape[0] != 1:
            self.recover()
            raise EngineError(f"a make_cache list runs one sequence: batch size {shape[0]}, expected 1 (mlx-lm's batch "
                              f"generation merges one list per sequence: prompt_caches=[make_cache(model) for each "
                              f"prompt]); the engine is as before this forward")
        self._trim_round = None
        self.hand(layer, shape[2], keys, values)
        return keys, values

    def _attend(self, layer, queries, keys, values, scale, mask, sinks):
        if queries.shape[0] != 1:
            self.recover()
            raise EngineError(f"muser_ti's mlx-lm cache runs one sequence: batch size {queries.shape[0]}, expected 1")
        return _attend_through(self, self.engine.cfg, layer, queries, keys, values, scale, mask, sinks)

    # ---- between forwards --------------------------------------------------------------------------------
    def _trim(self, layer: int, n: int) -> int:
        """One layer's trim(n): the first layer of a round rewinds the engine, the others find it done."""
        self.recover()
        n = int(n)
        if n < 0:
            raise EngineError(f"MuserKVCache.trim({n}): expected a count >= 0")
        rnd = self._trim_round
        if rnd is not None and rnd[0] == n and rnd[1] == self.engine.position and layer not in rnd[2]:
            rnd[2].add(layer)
            if len(rnd[2]) == self.n_layers:
                self._trim_round = None
            return rnd[3]
        n_eff = self.rewind(n, f"MuserKVCache.trim({n})", "make_cache(model, rollback=N)")
        self._trim_round = (n, self.engine.position, {layer}, n_eff) if self.n_layers > 1 else None
        return n_eff


def _attend_through(forward, cfg, layer, queries, keys, values, scale, mask, sinks, spans=None):
    """The dispatcher's call for a cache of ours: ``forward`` (integrations/forward.py) takes the layer's k/v its
    cache call handed on; a prompt runs mlx's own attention over the chunk and the engine stores the K/V, a token
    attends on the engine.  ``spans``: a batch's (each row's tokens in the prompt; None: one sequence, row 0)."""
    try:
        forward.take(layer, keys, values, "muser_ti attention")
        if sinks is not None:
            raise EngineError(f"muser_ti attention, layer {layer}: attention sinks are not supported by the engine")
        if scale is None or abs(float(scale) - cfg.attention_scale) > 1e-6 * cfg.attention_scale:
            raise EngineError(f"muser_ti attention, layer {layer}: scale {scale!r}, but the engine's geometry "
                              f"applies {cfg.attention_scale!r} (1/sqrt(head_dim)); the model is not the one "
                              f"the cache was made for")
        B, H, n, D = queries.shape
        if forward.mode == "prompt":
            out = _ORIGINAL(queries, keys, values, cache=None, scale=scale, mask=mask)
            k, v = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)  # [B, tokens, kv heads, d]
            if spans is None:
                forward.store(layer, k[0], v[0])
            else:
                forward.store(layer, k, v, spans)
        else:
            q, k, v = (x[:, :, 0, :] if n == 1 else x.transpose(0, 2, 1, 3) for x in (queries, keys, values))
            got = forward.attend(layer, q[0], k[0], v[0]) if spans is None else forward.attend(layer, q, k, v)
            out = got.reshape(B, n, H, D).transpose(0, 2, 1, 3)
            if out.dtype != queries.dtype:
                out = out.astype(queries.dtype)
        forward.finish(layer)
        return out
    except BaseException:
        forward.recover()
        raise


# ---- the per-layer caches --------------------------------------------------------------------------------

class MuserKVCache(_BaseCache):
    """One layer's view of the shared engine, with mlx-lm's cache protocol (what generate, stream_generate,
    generate_step and speculative_generate_step touch).  ``engine`` and ``session`` are shared by every layer."""

    def __init__(self, session: MuserSession, layer: int):
        self.session = session
        self.engine = session.engine
        self.layer = layer
        self.kind = session.engine.cfg.layer_kinds[layer]

    def __repr__(self) -> str:
        return f"<MuserKVCache layer {self.layer} ({self.kind}) at offset {self.offset}>"

    @property
    def offset(self) -> int:
        """Tokens committed to the engine (the position of the next token): the RoPE offset the model reads
        before update_and_fetch.  (mlx's own caches count a chunk at each layer's update; between forwards,
        where generate reads it, the two agree.)"""
        return self.engine.position

    @offset.setter
    def offset(self, value) -> None:
        raise EngineError("MuserKVCache.offset is the engine's position: roll back with trim(n)")

    def update_and_fetch(self, keys, values):
        """keys/values [1, n_kv_heads, n, head_dim] of this layer for the forward's n tokens; returns them as they
        came (the prompt's own attention attends them; the engine attends the rest)."""
        return self.session._update(self.layer, keys, values)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        """The mask the model hands the attention.  The prompt (position 0) runs mlx's own attention over the
        chunk: mlx's causal (and sliding) mask.  Everything else runs on the engine, whose masking is addressing
        (tokens outside the window are never read): no mask."""
        if N == 1 or self.engine.position > 0:
            return None
        if return_array or (window_size is not None and N > window_size):
            return create_causal_mask(N, 0, window_size=window_size)
        return "causal"

    # ---- state and size ----------------------------------------------------------------------------------
    @property
    def state(self):
        return [_UNSERIALIZABLE]

    @state.setter
    def state(self, v):
        raise EngineError("a MuserKVCache is not rebuilt from mlx arrays: resume with "
                          "muser_ti.integrations.mlx_lm.load_cache(model, path)")

    @property
    def meta_state(self):
        return ""

    def is_trimmable(self) -> bool:
        """True where the cache was built to roll back (make_cache(model, rollback=N), N > 0; a resumed session:
        rings with slack), so mlx-lm's speculative loop refuses a plain cache at its start."""
        return self.session.trimmable

    def trim(self, n: int) -> int:
        return self.session._trim(self.layer, n)

    def size(self) -> int:
        """Tokens this layer's plane holds (a ring: at most its capacity)."""
        return self.engine.planes[self.kind].state.len

    def empty(self) -> bool:
        return self.engine.position == 0

    @property
    def nbytes(self) -> int:
        """This layer's share of the engine's planes: rows allocated x K and V x f16."""
        cfg = self.engine.cfg
        return self.engine.planes[self.kind].state.capacity * cfg.n_kv_heads * cfg.head_dim * 2 * 2

    @classmethod
    def from_state(cls, state):
        raise EngineError("a MuserKVCache is not rebuilt from mlx arrays: resume with "
                          "muser_ti.integrations.mlx_lm.load_cache(model, path)")

    @classmethod
    def merge(cls, caches) -> "MuserBatchKVCache":
        """mlx-lm's batch generation merges the sequences' own caches, layer by layer, into one batch cache a layer
        (``_merge_caches``): here, the sequences' engines into one :class:`MuserBatchSession` that every layer's
        merge of the same caches shares."""
        caches = list(caches)
        if not caches or not all(isinstance(c, MuserKVCache) for c in caches):
            kinds = sorted({type(c).__name__ for c in caches})
            raise EngineError(f"MuserKVCache.merge: expected muser_ti caches of one layer, got {kinds}")
        layer = caches[0].layer
        if any(c.layer != layer for c in caches):
            raise EngineError(f"MuserKVCache.merge: caches of layers {sorted({c.layer for c in caches})}, expected one")
        sessions = [c.session for c in caches]
        key = tuple(id(x) for x in sessions)
        owner = sessions[0]
        found = getattr(owner, "_merged", None)
        if found is None or found[0] != key or layer in found[2]:  # a new merge (layer 0's, or another batch's)
            for x in sessions:
                x.recover()
            found = owner._merged = (key, MuserBatchSession([x.engine for x in sessions], owner.model_args), set())
        found[2].add(layer)
        return MuserBatchKVCache(found[1], layer)


# ---- many sequences: mlx-lm's batch generation ------------------------------------------------------------

class MuserBatchSession:
    """The sequences of one of mlx-lm's generation batches, each on its own engine (a ``make_cache`` list's, merged by
    :meth:`MuserKVCache.merge`), and the batch's forward in flight (integrations/forward.BatchForward on
    muser_ti/batch.py).  mlx-lm calls ``filter``, ``extend``, ``prepare`` and ``finalize`` on every layer's cache in
    turn: the first layer's call does it for the batch, the others find it done (a round, as trims are)."""

    ROUTE_HINT = f"the model module's '{_NAME}' is not the one install() puts there"

    def __init__(self, engines: list, model_args=None):
        self.engines = list(engines)
        self.model_args = model_args
        self.lengths = None  # prepare(lengths=...): each row's tokens in the right-padded prompt to come
        self._round = None  # (what, layers done, result)
        self._extracted: dict[int, MuserSession] = {}
        self._rebuild()

    def _rebuild(self) -> None:
        self.forward = fwd.BatchForward(Batch.of(self.engines), "MuserBatchKVCache.update_and_fetch", self.ROUTE_HINT,
                                        owner=self) if self.engines else None

    def __repr__(self) -> str:
        return f"<MuserBatchSession: {len(self.engines)} sequences at positions {self.positions()}>"

    @property
    def n_layers(self) -> int:
        return self.engines[0].cfg.n_layers if self.engines else 0

    def positions(self) -> list[int]:
        return [e.position for e in self.engines]

    def _once(self, layer: int, what, do):
        """``do()`` once for the batch: the first layer of a round runs it, the other layers find it done."""
        rnd = self._round
        if rnd is not None and rnd[0] == what and layer not in rnd[1]:
            rnd[1].add(layer)
            if len(rnd[1]) == self.n_layers:
                self._round = None
            return rnd[2]
        if self.forward is not None:
            self.forward.recover()
        result = do()
        self._round = (what, {layer}, result) if self.n_layers > 1 else None
        return result

    # ---- a forward ---------------------------------------------------------------------------------------
    def _update(self, layer: int, keys, values):
        shape = tuple(keys.shape)
        if len(shape) != 4 or tuple(values.shape)[:3] != shape[:3]:
            self.forward.recover()
            raise EngineError(f"MuserBatchKVCache.update_and_fetch layer {layer}: keys {shape} and values "
                              f"{tuple(values.shape)}, expected both [batch, kv_heads, tokens, head_dim]")
        if layer == 0 and shape[2] > 1 and self.lengths is not None and not self.forward.empty:
            self.forward.recover()
            raise EngineError(f"muser_ti's batch cache takes a padded batch prompt in one chunk, but a chunk of "
                              f"{shape[2]} tokens came after the first: pass prefill_step_size at least the longest "
                              f"prompt")
        self._round = None
        self.forward.hand(layer, shape[2], keys, values)
        return keys, values

    def _attend(self, layer, queries, keys, values, scale, mask, sinks):
        # mlx's own attention takes the prompt over the chunk; right padding sits after each row's tokens, which the
        # causal mask keeps out of them, and each engine takes its row's own tokens
        lengths = self.lengths if self.lengths is not None else [queries.shape[2]] * queries.shape[0]
        return _attend_through(self.forward, self.engines[0].cfg, layer, queries, keys, values, scale, mask, sinks,
                               spans=[(0, int(m)) for m in lengths])

    # ---- what mlx-lm's batch does between forwards ---------------------------------------------------------
    def _filter(self, layer: int, keep) -> None:
        keep = [int(i) for i in (keep.tolist() if hasattr(keep, "tolist") else keep)]

        def do():
            bad = [i for i in keep if not 0 <= i < len(self.engines)]
            if bad:
                raise EngineError(f"MuserBatchKVCache.filter: rows {bad} of a batch of {len(self.engines)}")
            self.engines = [self.engines[i] for i in keep]
            self._rebuild()

        self._once(layer, ("filter", tuple(keep)), do)

    def _extend(self, layer: int, other: "MuserBatchSession") -> None:
        def do():
            if other.forward is not None:
                other.forward.recover()
            self.engines = self.engines + other.engines
            self._rebuild()

        self._once(layer, ("extend", id(other)), do)

    def _prepare(self, layer: int, left_padding=None, lengths=None, right_padding=None) -> None:
        def do():
            if left_padding is not None and any(int(p) for p in _as_list(left_padding)):
                raise EngineError("MuserBatchKVCache.prepare: left padding is not taken (mlx-lm's batch generation "
                                  "right-pads its prompts)")
            self.lengths = _as_list(lengths) if lengths is not None else None

        self._once(layer, ("prepare", id(lengths), id(right_padding)), do)

    def _finalize(self, layer: int) -> None:
        def do():
            self.lengths = None

        self._once(layer, ("finalize",), do)

    def _extract(self, layer: int, idx: int) -> MuserKVCache:
        """Sequence ``idx`` as a one-sequence cache (its own engine), one session for all its layers."""
        engine = self.engines[idx]
        session = self._extracted.get(id(engine))
        if session is None or session.engine is not engine:
            session = self._extracted[id(engine)] = MuserSession(engine, self.model_args, trimmable=False)
        return MuserKVCache(session, layer)

    def _copy(self) -> "MuserBatchSession":
        if self.forward is not None:
            self.forward.recover()
        return MuserBatchSession(self.engines, self.model_args)


def _as_list(values) -> list[int]:
    return [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


class MuserBatchKVCache(_BaseCache):
    """One layer's view of a batch of sequences (mlx-lm's ``BatchKVCache`` protocol: ``merge``, ``prepare``,
    ``finalize``, ``filter``, ``extend``, ``extract``), every sequence on its own engine.  mlx-lm's batch keeps
    padding in its caches; here each sequence holds its own tokens only, and ``offset`` (the RoPE position mlx-lm's
    model reads) is each row's own position."""

    def __init__(self, session: MuserBatchSession, layer: int):
        self.session = session
        self.layer = layer
        self.kind = session.engines[0].cfg.layer_kinds[layer]

    def __repr__(self) -> str:
        return f"<MuserBatchKVCache layer {self.layer} ({self.kind}): {self.session}>"

    def __deepcopy__(self, memo):
        """mlx-lm splits a batch by copying it whole, then filtering the copy and the original to disjoint rows: the
        copy shares the sequences' engines (each ends up in one of the two)."""
        key = ("muser_batch_session", id(self.session))
        if key not in memo:
            memo[key] = self.session._copy()
        return MuserBatchKVCache(memo[key], self.layer)

    @property
    def offset(self):
        return mx.array(self.session.positions(), dtype=mx.int32)

    def update_and_fetch(self, keys, values):
        return self.session._update(self.layer, keys, values)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        """The prompt runs mlx's own attention over the chunk (causal, sliding where the layer is); decode runs on
        the engine, whose masking is addressing: no mask."""
        if N == 1 or not self.empty():
            return None
        if return_array or (window_size is not None and N > window_size):
            return create_causal_mask(N, 0, window_size=window_size)
        return "causal"

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        self.session._prepare(self.layer, left_padding, lengths, right_padding)

    def finalize(self):
        self.session._finalize(self.layer)

    def filter(self, batch_indices):
        self.session._filter(self.layer, batch_indices)

    def extend(self, other):
        if not isinstance(other, MuserBatchKVCache):
            raise EngineError(f"MuserBatchKVCache.extend: a {type(other).__name__}; a batch on the engine extends with "
                              f"another such batch (every sequence's cache from make_cache)")
        self.session._extend(self.layer, other.session)

    def extract(self, idx):
        return self.session._extract(self.layer, int(idx))

    @property
    def state(self):
        return [_UNSERIALIZABLE]

    @state.setter
    def state(self, v):
        raise EngineError("a MuserBatchKVCache is not rebuilt from mlx arrays")

    @property
    def meta_state(self):
        return ""

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        raise EngineError("MuserBatchKVCache.trim: a batch on the engine does not roll back (speculative decoding "
                          "runs one sequence: make_cache(model, rollback=N))")

    def size(self) -> int:
        return max(self.session.positions(), default=0)

    def empty(self) -> bool:
        return all(p == 0 for p in self.session.positions())

    @property
    def nbytes(self) -> int:
        if not self.session.engines:
            return 0
        cfg = self.session.engines[0].cfg
        return sum(e.planes[self.kind].state.capacity for e in self.session.engines) * cfg.n_kv_heads * cfg.head_dim * 4


# ---- building one --------------------------------------------------------------------------------------

def _layer_kinds_match(model, geometry) -> None:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise EngineError(f"{type(model).__name__}: no 'layers' (an mlx-lm model's list of decoder layers)")
    if len(layers) != geometry.n_layers:
        raise EngineError(f"{type(model).__name__} has {len(layers)} layers, the geometry {geometry.n_layers}")
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        sliding = getattr(attn, "is_sliding", None)
        if sliding is not None and (SWA if sliding else NOPE) != geometry.layer_kinds[i]:
            raise EngineError(f"layer {i}: the model's attention is {'sliding' if sliding else 'full'}, the geometry "
                              f"says {geometry.layer_kinds[i]}")


def _caches(model, engine: Engine, trimmable: bool) -> list[MuserKVCache]:
    _layer_kinds_match(model, engine.cfg)
    install(model)
    session = MuserSession(engine, getattr(model, "args", None), trimmable)
    return [MuserKVCache(session, i) for i in range(engine.cfg.n_layers)]


def make_cache(model, arch: str = "auto", *, rollback: int = 0, max_context: int | None = None,
               engine: Engine | None = None, **engine_options) -> list[MuserKVCache]:
    """The per-layer cache list mlx-lm's generate / stream_generate / generate_step take as ``prompt_cache``, in
    place of ``model.make_cache()``: one Engine, built from the model's own args (``model.args``), shared by
    every layer.

    ``arch``: the engine's backend (auto | cpu | cuda | vulkan | metal).  ``rollback``: the most tokens a trim
    takes back at any point (integrations/forward.py; MuserCache's means the same); speculative decoding needs
    at least its ``num_draft_tokens``.  ``max_context``: the context the NoPE planes may grow to (default: the model's
    ``max_position_embeddings``).  ``engine``: an existing Engine to wrap instead (its geometry must be the
    model's).  Other keywords go to ``mt.Engine`` (pinned=, capacity=, ...).  Installs the dispatcher
    (:func:`install`) for the model's module.
    """
    args = getattr(model, "args", None)
    if args is None:
        raise EngineError(f"{type(model).__name__}: no 'args' (an mlx-lm model's ModelArgs) to read the geometry from")
    trimmable = rollback > 0 if engine is None else engine.cfg.swa_ring_slack > 0
    return _caches(model, fwd.build_engine(args, arch, rollback, max_context, engine, engine_options, "make_cache"),
                   trimmable)


def save_cache(cache, path) -> None:
    """The engine's session behind ``cache`` (a make_cache list, or one of its layers) to a safetensors file:
    Engine.save (atomic; load_cache resumes it bit for bit).  A forward left open by an exception is abandoned
    first."""
    _session_of(cache).save(path)


def load_cache(model, path, arch: str = "auto", **engine_options) -> list[MuserKVCache]:
    """A make_cache list resuming the session ``save_cache`` wrote (Engine.from_snapshot; its geometry must be the
    model's)."""
    return make_cache(model, engine=Engine.from_snapshot(path, arch=arch, **engine_options))


def _session_of(cache) -> MuserSession:
    if isinstance(cache, MuserKVCache):
        return cache.session
    ours = [c for c in cache if isinstance(c, MuserKVCache)] if isinstance(cache, (list, tuple)) else []
    if not ours:
        raise EngineError("expected a cache list from muser_ti.integrations.mlx_lm.make_cache (or one of its layers)")
    sessions = {id(c.session): c.session for c in ours}
    if len(sessions) > 1:
        raise EngineError("the cache list holds layers of several engines (a speculative run's model + draft "
                          "caches?): pass the model's part, cache[:len(model.layers)]")
    return ours[0].session
