"""The engine as the decode attention of a transformers model, through transformers' own extension points.

    from muser_ti.integrations import transformers as mt_hf
    mt_hf.register()                                        # attn_implementation="muser_ti"
    model = MuseGlimmerForConditionalGeneration.from_pretrained(path, attn_implementation="muser_ti")
    cache = mt_hf.MuserCache(model.config, arch="auto")     # a transformers Cache backed by the engine's planes
    out = model.generate(input_ids, cache=cache)            # (past_key_values= is the deprecated name)

How a forward reaches the engine.  The model's attention calls ``cache.update(k, v, layer_idx)`` and then the
function registered as "muser_ti" with (module, q, k, v, mask, scaling=, sliding_window=).  The function is
not handed the cache: layer 0's ``update`` opens the forward on the engine (integrations/forward.py), which is
the current forward until its last layer commits, and every ``update`` hands its layer and the very k/v tensors
it returned to the function, which checks that the module, scaling and window are the ones the engine's
geometry says.  What it does depends on the forward, which layer 0's ``update`` decides:

* a multi-token forward on an empty cache (the prompt): the framework's own attention (sdpa) computes the
  prompt's outputs over the chunk's k/v with the causal or sliding mask transformers built, and the engine
  ingests the chunk's K/V layer by layer (``Engine.prompt``), committed after the last layer;
* a single token: layer 0 opens ``Engine.token()``, every layer attends on the engine, the last commits;
* several tokens after the prompt (an assisted-decoding verify pass, a continued conversation):
  ``Engine.token(n)``, each token over the cache and the chunk's earlier tokens.

A forward that raises between layers leaves its token open; the next call on the cache (the next forward's
layer 0, ``crop``, ``save``...) abandons it first, so the engine is exactly as before that forward.

Rollback (assisted decoding): ``crop(-r)`` is ``Engine.rewind(position - r)``.  ``MuserCache(config,
rollback=N)`` takes back up to N tokens at any point (integrations/forward.py says how the rings hold them; mlx-lm's
``make_cache(model, rollback=N)`` means the same).  A verify round takes back at most the draft's length,
``num_assistant_tokens`` (20 by default; the "heuristic" schedule adds 2 after every fully accepted round), so N
must cover the longest draft: pass ``num_assistant_tokens_schedule="constant"`` to the assistant's generation
config to bound it.

Many sequences: the first forward's batch size is the cache's.  A batch of B left-padded prompts (``generate``
with an attention mask) makes the cache a :class:`muser_ti.batch.Batch` of B sequences, each on its own engine
holding its own tokens only: the prompt's padding is read from its mask, and every later mask must hide exactly
each row's padding (right padding and custom masks are refused).  ``cache.batch`` holds them (``cache.engine`` is a
one-sequence cache's).  Beam search, and repeating sequences after the prompt, are refused.  The tensors go
to the engine as they are; muser_ti/arrays.py decides what it reads in place (a float32 CPU tensor; a CUDA
tensor on arch="cuda") and what it converts or copies (another dtype; a CUDA model with a Vulkan or CPU
engine).  Without a MuserCache (no cache, or another Cache
class), "muser_ti" is transformers' sdpa, so the same model still runs a plain forward.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import logging

from .. import Engine
from ..batch import Batch
from ..config import SWA
from ..errors import EngineError
from . import forward as fwd

ATTN_IMPLEMENTATION = "muser_ti"

logger = logging.get_logger(__name__)
_warned_without_cache = False


# ---- registration -----------------------------------------------------------------------------------
def register() -> str:
    """Make ``attn_implementation="muser_ti"`` available (AttentionInterface), with transformers' sdpa mask
    builder for its masks (AttentionMaskInterface: the prompt's attention runs sdpa, and the masks of later
    forwards are checked against what the engine attends).  Idempotent; returns the name."""
    if AttentionInterface._global_mapping.get(ATTN_IMPLEMENTATION) is not muser_attention:
        AttentionInterface.register(ATTN_IMPLEMENTATION, muser_attention)
    if AttentionMaskInterface._global_mapping.get(ATTN_IMPLEMENTATION) is not sdpa_mask:
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def muser_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                    **kwargs):
    """The attention function registered as "muser_ti": (module, q [1, H, n, D], k, v [1, KV, n, D], mask,
    scaling=, sliding_window=) -> (out [1, n, H, D], None), as transformers' sdpa returns it."""
    forward = fwd.current()
    if forward is None or forward.pending is None or not isinstance(forward.owner, MuserCache):
        global _warned_without_cache
        if not _warned_without_cache:
            _warned_without_cache = True
            logger.warning("attn_implementation='muser_ti' without a MuserCache: running transformers' sdpa "
                           "(pass cache=MuserCache(config) for the engine)")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    return forward.owner._attend(module, query, key, value, attention_mask, scaling, dropout, sliding_window)


# ---- the cache --------------------------------------------------------------------------------------
class MuserLayer(CacheLayerMixin):
    """One layer's view of a MuserCache (transformers' Cache is a list of layers): its class and the lengths
    the mask builder asks for; the rows live in the engine's planes."""

    is_compileable = False
    supports_early_init = False

    def __init__(self, cache: "MuserCache", layer: int, sliding: bool):
        super().__init__()
        self._cache, self.layer, self.is_sliding = cache, layer, sliding
        self.is_initialized = True

    @property
    def is_croppable(self) -> bool:
        return self._cache.is_croppable

    def __repr__(self):
        return f"MuserLayer({self.layer}, {'sliding' if self.is_sliding else 'full'})"

    @property
    def batch_size(self) -> int:
        return self._cache.batch_size

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache.update(key_states, value_states, self.layer, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) as transformers' dynamic layers give them: what a sliding layer's window and a
        full layer's whole past hold; the masks built on them are what the engine attends."""
        past = self._cache.get_seq_length()
        if not self.is_sliding:
            return past + query_length, 0
        window = self._cache.window
        return min(past, window - 1) + query_length, max(past - window + 1, 0)

    def get_max_length(self) -> int:
        return self._cache.geometry.max_context

    def reset(self) -> None:
        self._cache.reset()

    def crop(self, tokens_to_remove: int) -> None:
        self._cache.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx) -> None:
        self._cache.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        self._cache.batch_select_indices(indices)

    def offload(self):
        pass

    def prefetch(self):
        pass


class MuserCache(Cache):
    """A transformers ``Cache`` whose K/V live in a muser-ti Engine's planes (ring planes for the sliding
    layers, growing planes for the full ones), so a model's decode attention runs on the engine.

    ``config``: the model's config (multimodal or text; anything ``mt.geometry_from_model_config`` reads).
    ``arch``: the engine's backend (auto | cpu | cuda | vulkan | metal).  ``rollback``: the most tokens ``crop``
    takes back at any point (assisted decoding needs its longest draft; integrations/forward.py).
    ``max_context``: the longest sequence (default the config's max_position_embeddings).  ``engine``: an
    existing Engine to wrap instead of a new one (its geometry must be the config's).  Other keywords go to
    ``mt.Engine`` (pinned=, capacity=, ...).  The engine is ``cache.engine``.  ``batch_size``: the sequences the
    cache holds from the start (default: the first forward's batch size decides), each on its own engine
    (``cache.batch``).
    """

    is_compileable = False

    def __init__(self, config, arch: str = "auto", *, rollback: int = 0, max_context: int | None = None,
                 engine: Engine | None = None, batch_size: int | None = None, **engine_options):
        self._own_engine = engine is None  # a batch builds its own engines: only then
        engine = fwd.build_engine(config, arch, rollback, max_context, engine, engine_options, "MuserCache")
        self._engine_options = dict(engine_options)
        self._geometry = engine.cfg
        self.forward = fwd.Forward(engine, "MuserCache.update",
                                   f"build the model with attn_implementation='{ATTN_IMPLEMENTATION}', after register()",
                                   owner=self)
        self._checked_masks: dict = {}
        layers = [MuserLayer(self, i, kind == SWA) for i, kind in enumerate(engine.cfg.layer_kinds)]
        super().__init__(layers=layers)
        if batch_size is not None and int(batch_size) != 1:
            if int(batch_size) < 1:
                raise EngineError(f"MuserCache(batch_size={batch_size}): expected a positive number of sequences")
            self._start_batch(int(batch_size))

    # ---- what the engine holds -------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """The engine of a one-sequence cache (a batch's sequences each have one: ``cache.batch.sequence(seq)``)."""
        if self.is_batch:
            raise EngineError(f"MuserCache holds a batch of {self.batch_size} sequences, each on its own engine: "
                              f"cache.batch.sequence(seq) for seq in cache.batch.sequences")
        return self.forward.engine

    @property
    def is_batch(self) -> bool:
        return isinstance(self.forward, fwd.BatchForward)

    @property
    def batch(self) -> Batch | None:
        """The sequences of a batch (muser_ti/batch.py), row b of the model's batch ``batch.sequences[b]``; None for
        one sequence."""
        return self.forward.batch if self.is_batch else None

    @property
    def geometry(self):
        return self._geometry

    @property
    def window(self) -> int:
        return self._geometry.window

    @property
    def rollback(self) -> int:
        """The most tokens crop() is sure to take back (integrations/forward.py)."""
        return self.forward.rollback

    @property
    def rewinds(self) -> int:
        """crop() calls that dropped tokens (observable for tests and users)."""
        return self.forward.rewinds

    @property
    def tokens_rewound(self) -> int:
        return self.forward.tokens_rewound

    @property
    def is_croppable(self) -> bool:
        # crop(-r) up to rollback puts the cache back as it was; past it, it is refused with the cache unchanged
        return True

    @property
    def batch_size(self) -> int:
        return self.forward.size if self.is_batch else 1

    def __repr__(self):
        held = (f"{self.batch_size} sequences at positions {self.batch.positions()} (padded length {self.forward.position})"
                if self.is_batch else f"position {self.forward.position}")
        return (f"MuserCache({self._geometry.name}: {len(self.layers)} layers, {held}, arch {self._arch()}, "
                f"rollback {self.rollback})")

    def _arch(self) -> str:
        return self.batch.arch if self.is_batch else self.forward.engine.arch

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The tokens held (a left-padded batch: its padded length, as the model counts positions)."""
        return self.forward.position

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self._geometry.max_context

    # ---- the forward: update, then the attention function -------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Called by the model's attention before its attention function: layer 0 opens the forward on the
        engine; every layer hands (layer, k, v) to the attention function.  Returns k and v as they came (the
        prompt's sdpa attends them; the engine attends the rest)."""
        shape = tuple(key_states.shape)
        if len(shape) != 4 or tuple(value_states.shape) != shape:
            raise EngineError(f"MuserCache.update layer {layer_idx}: key {shape} and value "
                              f"{tuple(value_states.shape)}, expected both [batch, kv_heads, tokens, head_dim]")
        if shape[0] != self.batch_size:
            if layer_idx != 0:
                self.forward.recover()
                raise EngineError(f"MuserCache.update layer {layer_idx}: batch size {shape[0]}, the forward opened with "
                                  f"{self.batch_size}; the cache is as before this forward")
            self._start_batch(shape[0])
        if layer_idx == 0:
            self._checked_masks = {}
        self.forward.hand(layer_idx, shape[2], key_states, value_states)
        return key_states, value_states

    def _start_batch(self, size: int) -> None:
        """The model's first forward has ``size`` rows: an empty cache becomes a batch of that many sequences (a
        Batch on the cache's geometry and engine options); anything else is refused, the cache unchanged."""
        self.forward.recover()
        if self.forward.position != 0:
            raise EngineError(f"MuserCache holds {self.batch_size} sequence(s) at position {self.forward.position}: a "
                              f"forward of batch size {size} is not theirs (reset() the cache for a new batch)")
        if not self._own_engine:
            raise EngineError(f"MuserCache(engine=...) runs that one engine's sequence: batch size {size}, expected 1 "
                              f"(a batch builds its engines: MuserCache(config, ...) without engine=)")
        if size == 1:
            self.reset()
            return
        batch = Batch(self._geometry, size, arch=self._arch(), **self._engine_options)
        self.forward = fwd.BatchForward(batch, self.forward.cache_call, self.forward.route_hint, owner=self)

    def _attend(self, module, query, key, value, attention_mask, scaling, dropout, sliding_window):
        forward = self.forward
        layer = forward.pending[0]
        try:
            module_layer = getattr(module, "layer_idx", layer)
            if module_layer != layer:
                raise EngineError(f"muser_ti attention: the module is layer {module_layer} but the cache's last "
                                  f"update was layer {layer}")
            forward.take(layer, key, value, "muser_ti attention")
            self._check_call(layer, scaling, dropout, sliding_window)
            B, n = query.shape[0], query.shape[2]
            pads = self._check_mask(attention_mask, layer, n)
            if forward.mode == "prompt":
                out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                                                scaling=scaling)
                if self.is_batch:
                    forward.store(layer, key.transpose(1, 2), value.transpose(1, 2), [(p, n) for p in pads])
                else:
                    forward.store(layer, key[0].transpose(0, 1), value[0].transpose(0, 1))
            elif self.is_batch:
                got = forward.attend(layer, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
                out = got.to(dtype=query.dtype).reshape(B, n, query.shape[1], query.shape[3])
            else:
                got = forward.attend(layer, query[0].transpose(0, 1), key[0].transpose(0, 1),
                                     value[0].transpose(0, 1))
                out = got.to(dtype=query.dtype).reshape(1, n, query.shape[1], query.shape[3])
            forward.finish(layer)
            return out, None
        except BaseException:
            forward.recover()
            raise

    def _check_call(self, layer, scaling, dropout, sliding_window):
        cfg = self._geometry
        scale = (cfg.head_dim ** -0.5) if scaling is None else float(scaling)
        if not math.isclose(scale, cfg.attention_scale, rel_tol=1e-9):
            raise EngineError(f"muser_ti attention at layer {layer}: scaling={scale!r} but the engine applies "
                              f"attention_scale={cfg.attention_scale!r} (1/sqrt(head_dim)); the model's q must carry "
                              f"any other factor itself")
        expected = cfg.window if cfg.layer_kinds[layer] == SWA else None
        got = sliding_window
        if got is not None and expected is not None and got >= cfg.max_context:
            got = min(got, cfg.max_context)  # a window past max_context is the geometry's capped window
        if got != expected:
            kind = "a sliding-window" if expected is not None else "a full-context"
            raise EngineError(f"muser_ti attention at layer {layer}: sliding_window={sliding_window!r} but the "
                              f"engine's geometry makes it {kind} layer (window {expected!r})")
        if dropout:
            raise EngineError(f"muser_ti attention at layer {layer}: dropout={dropout!r}; the engine runs inference "
                              f"only (model.eval())")

    def _check_mask(self, mask, layer: int, n: int) -> list[int]:
        """The mask transformers built must hide nothing the engine attends but a batch's left padding (a custom
        mask, right padding: refused): the engine attends every token a sequence holds within the window.  Returns
        each row's padding (a batch prompt's is read from its mask: the positions no query sees).  Checked once
        per mask object and forward."""
        pads = [0] * self.batch_size if not self.is_batch or self.forward.mode == "prompt" else self.forward.pads
        if mask is None:
            return pads
        sliding = self.layers[layer].is_sliding
        key = (id(mask), sliding)
        if key in self._checked_masks:
            return self._checked_masks[key][1]
        if not isinstance(mask, torch.Tensor) or mask.ndim != 4:
            raise EngineError(f"muser_ti attention at layer {layer}: a {type(mask).__name__} attention mask; "
                              f"expected the boolean mask transformers' sdpa builder makes (call register())")
        kv_length, kv_offset = self.layers[layer].get_mask_sizes(n)
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        B = self.batch_size
        if tuple(allowed.shape[-2:]) != (n, kv_length) or allowed.shape[0] not in (1, B):
            raise EngineError(f"muser_ti attention at layer {layer}: attention mask of shape {tuple(mask.shape)}, "
                              f"expected [{B}, 1, {n}, {kv_length}]")
        if self.is_batch and self.forward.mode == "prompt":  # padding: the keys no query of the row sees
            seen = allowed[:, 0].any(dim=1)  # [rows, kv]
            pads = [int(kv_length - row.sum()) for row in seen] * (B if allowed.shape[0] == 1 else 1)
        q_pos = torch.arange(n, device=allowed.device)[:, None] + self.forward.position
        kv_pos = torch.arange(kv_length, device=allowed.device)[None, :] + kv_offset
        expected = kv_pos <= q_pos
        if sliding:
            expected &= kv_pos > q_pos - self.window
        pad = torch.tensor(pads, device=allowed.device)[:, None, None]
        expected = (expected[None] & (kv_pos[None] >= pad))[:, None]  # [B, 1, n, kv]
        if allowed.shape[0] == 1:
            expected = expected[:1]
        if not bool((allowed == expected).all()):
            raise EngineError(f"muser_ti attention at layer {layer}: the attention mask hides tokens the engine "
                              f"would attend (right padding or a custom mask); MuserCache runs sequences padded "
                              f"on the left only")
        self._checked_masks[key] = (mask, pads)  # the mask kept alive: its id stays its own for this forward
        return pads

    # ---- what generate calls between forwards --------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers >= 5.18 passes a count <= 0; 0 does
        nothing): ``Engine.rewind``.  Refused, with the cache unchanged, past what the rings hold."""
        self.forward.recover()
        tokens_to_remove = int(tokens_to_remove)
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. Please "
                             f"use a negative integer to remove that number of tokens from the cache instead.")
        r = -tokens_to_remove
        if r > self.get_seq_length():
            raise EngineError(f"MuserCache.crop({tokens_to_remove}): the cache holds {self.get_seq_length()} token(s)")
        self.forward.rewind(r, f"MuserCache.crop({tokens_to_remove})", "MuserCache(config, rollback=N)")

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        """generate's notice that it will crop up to ``recurrent_states_to_keep`` tokens a round (assisted
        decoding: the draft length).  The engine keeps what it keeps: refused here, before any forward,
        where the rings cannot roll back that far."""
        k = int(recurrent_states_to_keep or 0)
        if k > self.rollback and self._geometry.swa_layers:
            raise EngineError(f"MuserCache: generate will roll back up to {k} token(s) a round (assisted decoding's "
                              f"draft length) but the rings take back {self.rollback} (rollback={self.rollback}): "
                              f"build MuserCache(config, rollback={k}) or more (the assistant's 'heuristic' "
                              f"schedule lengthens drafts by 2 after each fully accepted round; "
                              f"num_assistant_tokens_schedule='constant' keeps them as they are)")

    def reset(self) -> None:
        """An empty cache: a fresh engine of the same geometry and options (a ring cannot rewind to 0)."""
        self.forward.recover()
        self.forward = fwd.Forward(Engine(self._geometry, arch=self._arch(), **self._engine_options),
                                   self.forward.cache_call, self.forward.route_hint, owner=self)

    def reorder_cache(self, beam_idx) -> None:
        raise EngineError("MuserCache: beam search (reorder_cache) is not supported: a beam's rows would be copied "
                          "between sequences every step")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if int(repeats) != 1:
            raise EngineError(f"MuserCache: cannot repeat its sequences {repeats} times after the prompt (contrastive "
                              f"search, beams); num_return_sequences repeats the prompt before it, which works")

    def batch_select_indices(self, indices) -> None:
        if [int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()] != list(range(self.batch_size)):
            raise EngineError(f"MuserCache: cannot select batch indices {indices} of its {self.batch_size} "
                              f"sequence(s)")

    def early_initialization(self, *args, **kwargs) -> None:
        pass

    # ---- snapshots ---------------------------------------------------------------------------------
    def save(self, path) -> None:
        """The engine's session to a safetensors file (Engine.save: atomic, bit-for-bit resumable); a batch's
        sequences are saved with ``cache.batch.save(folder)`` (the forward refuses, naming it)."""
        self.forward.save(path)

    @classmethod
    def from_snapshot(cls, config, path, arch: str = "auto", **engine_options) -> "MuserCache":
        """A MuserCache resuming the session saved by ``save`` (its geometry must be ``config``'s)."""
        return cls(config, engine=Engine.from_snapshot(path, arch=arch, **engine_options))


__all__ = ["ATTN_IMPLEMENTATION", "MuserCache", "MuserLayer", "muser_attention", "register"]
