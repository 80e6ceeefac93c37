"""The engine as the decode attention of a transformers model, through transformers' own extension points.

    from muser_ti.integrations import transformers as mt_hf
    mt_hf.register()                                        # attn_implementation="muser_ti"
    model = MuseGlimmerForConditionalGeneration.from_pretrained(path, attn_implementation="muser_ti")
    cache = mt_hf.MuserCache(model.config, arch="auto")     # a transformers Cache backed by the engine's planes
    out = model.generate(input_ids, cache=cache)            # (past_key_values= is the deprecated name)

How a forward reaches the engine.  The model's attention calls ``cache.update(k, v, layer_idx)`` and then the
function registered as "muser_ti" with (module, q, k, v, mask, scaling=, sliding_window=).  The function is
not handed the cache, so ``update`` leaves the layer it was given where the function finds it (the layer
index and the very k tensor it returned), and the function checks that the module, scaling and window are
the ones the engine's geometry says.  What it does depends on the forward, which layer 0's ``update`` decides:

* a multi-token forward on an empty cache (the prompt): the framework's own attention (sdpa) computes the
  prompt's outputs over the chunk's k/v with the causal or sliding mask transformers built, and the engine
  ingests the chunk's K/V layer by layer (``Engine.prompt``), committed after the last layer;
* a single token: layer 0 opens ``Engine.token()``, every layer attends on the engine, the last commits;
* several tokens after the prompt (an assisted-decoding verify pass, a continued conversation):
  ``Engine.token(n)``, each token over the cache and the chunk's earlier tokens.

A forward that raises between layers leaves its token open; the next call on the cache (the next forward's
layer 0, ``crop``, ``save``...) abandons it first, so the engine is exactly as before that forward.

Rollback (assisted decoding): ``crop(-r)`` is ``Engine.rewind(position - r)``.  A full sliding-window ring
holds its window and nothing older, so it takes back one token (the next token at that position needs only
what the ring holds) and no more, unless the geometry gives it slack: ``MuserCache(config, rollback=N)``
builds rings with N rows of slack (``swa_ring_slack=N``) that take back N + 1.  A verify round takes back at
most the draft's length, ``num_assistant_tokens`` (20 by default; the "heuristic" schedule adds 2 after every
fully accepted round), so N + 1 must cover the longest draft: pass ``num_assistant_tokens_schedule="constant"``
to the assistant's generation config to bound it.

One sequence: batch size 1 (a larger batch, beam search, num_return_sequences > 1 are refused).  Torch
tensors on the CPU go to the engine through numpy (no copy for float32 contiguous ones); on arch="cuda" a
CUDA tensor is handed over as it is (zero-copy both ways); elsewhere (a CUDA model with a Vulkan or CPU
engine) it is copied to the host and the output back.  Without a MuserCache (no cache, or another Cache
class), "muser_ti" is transformers' sdpa, so the same model still runs a plain forward.
"""

from __future__ import annotations

import math
import threading

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import logging

from .. import Engine, geometry_from_model_config
from ..config import SWA
from ..errors import EngineError

ATTN_IMPLEMENTATION = "muser_ti"

logger = logging.get_logger(__name__)
_local = threading.local()  # the cache whose update() ran last on this thread, for the attention function


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
    cache = getattr(_local, "cache", None)
    if cache is None or cache._pending is None:
        if not getattr(_local, "warned", False):
            _local.warned = True
            logger.warning("attn_implementation='muser_ti' without a MuserCache: running transformers' sdpa "
                           "(pass cache=MuserCache(config) for the engine)")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    _local.cache = None
    return cache._attend(module, query, key, value, attention_mask, scaling, dropout, sliding_window)


# ---- the cache --------------------------------------------------------------------------------------
class MuserLayer(CacheLayerMixin):
    """One layer's view of a MuserCache (transformers' Cache is a list of layers): its class and the lengths
    the mask builder asks for; the rows live in the engine's planes."""

    is_compileable = False
    supports_early_init = False
    batch_size = 1

    def __init__(self, cache: "MuserCache", layer: int, sliding: bool):
        super().__init__()
        self._cache, self.layer, self.is_sliding = cache, layer, sliding
        self.is_initialized = True

    @property
    def is_croppable(self) -> bool:
        return self._cache.is_croppable

    def __repr__(self):
        return f"MuserLayer({self.layer}, {'sliding' if self.is_sliding else 'full'})"

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
    ``arch``: the engine's backend (auto | cpu | cuda | vulkan | metal).  ``rollback``: the rings' slack,
    so ``crop`` can take back rollback + 1 tokens once they are full (assisted decoding needs its longest
    draft).  ``max_context``: the longest sequence (default the config's max_position_embeddings).
    ``engine``: an existing Engine to wrap instead of a new one (its geometry must be the config's).  Other
    keywords go to ``mt.Engine`` (pinned=, capacity=, ...).  The engine is ``cache.engine``.
    """

    is_compileable = False

    def __init__(self, config, arch: str = "auto", *, rollback: int = 0, max_context: int | None = None,
                 engine: Engine | None = None, **engine_options):
        if engine is None:
            geometry = geometry_from_model_config(config, max_context=max_context, swa_ring_slack=rollback)
            engine = Engine(geometry, arch=arch, **engine_options)
        else:
            if engine_options or max_context is not None or rollback:
                raise EngineError("MuserCache(engine=...): the engine brings its own geometry and options; pass "
                                  "rollback=, max_context= and engine options only for a new engine")
            _check_same_geometry(engine.cfg, geometry_from_model_config(config, max_context=engine.cfg.max_context,
                                                                        swa_ring_slack=engine.cfg.swa_ring_slack))
        self.engine = engine
        self._arch_request, self._engine_options = arch, dict(engine_options)
        self._pending = None  # (layer, key, value) update() gave the attention function, not yet consumed
        self._open = None  # the Token or Prompt this cache opened for the forward in flight
        self._mode = None  # "prompt" | "token" for the forward in flight
        self._checked_masks: dict = {}
        self.rewinds = 0  # crops that dropped tokens, and how many they dropped (observable for tests)
        self.tokens_rewound = 0
        layers = [MuserLayer(self, i, kind == SWA) for i, kind in enumerate(engine.cfg.layer_kinds)]
        super().__init__(layers=layers)

    # ---- what the engine holds -------------------------------------------------------------------
    @property
    def geometry(self):
        return self.engine.cfg

    @property
    def window(self) -> int:
        return self.engine.cfg.window

    @property
    def rollback(self) -> int:
        """The rings' slack beyond the window: crop() takes back rollback + 1 tokens once they are full."""
        return self.engine.cfg.swa_ring_slack

    @property
    def max_crop(self) -> int:
        """The most tokens crop() is sure to take back (a full ring: its slack, and the one token a ring can always
        give back; growing planes alone: all of them)."""
        return self.rollback + 1 if self.engine.cfg.swa_layers else self.engine.position

    @property
    def is_croppable(self) -> bool:
        # crop(-r) up to max_crop puts the cache back as it was; past it, it is refused with the cache unchanged
        return True

    @property
    def batch_size(self) -> int:
        return 1

    def __repr__(self):
        return (f"MuserCache({self.engine.cfg.name}: {len(self.layers)} layers, position {self.engine.position}, "
                f"arch {self.engine.arch}, rollback {self.rollback})")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.engine.position

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.engine.cfg.max_context

    # ---- the forward: update, then the attention function -------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Called by the model's attention before its attention function: layer 0 opens the forward's token
        (or prompt) on the engine; every layer leaves (layer, k, v) for the attention function.  Returns
        k and v as they came (the prompt's sdpa attends them; the engine attends the rest)."""
        L = len(self.layers)
        if not 0 <= layer_idx < L:
            raise EngineError(f"MuserCache.update layer {layer_idx}: the engine has layers 0..{L - 1}")
        shape = tuple(key_states.shape)
        if len(shape) != 4 or tuple(value_states.shape) != shape:
            raise EngineError(f"MuserCache.update layer {layer_idx}: key {shape} and value "
                              f"{tuple(value_states.shape)}, expected both [batch, kv_heads, tokens, head_dim]")
        batch, n = shape[0], shape[2]
        if batch != 1:
            self._recover()
            raise EngineError(f"MuserCache runs one sequence: batch size {batch}, expected 1 (batching is not "
                              f"supported yet; beam search and num_return_sequences > 1 need it too)")
        if layer_idx == 0:
            self._recover()
            self._open_forward(n)
        else:
            problem = None
            if self._open is None or not self._open.is_open:
                problem = (f"layer {layer_idx} arrived with no forward open (layer 0 opens it): layers must run "
                           f"0..{L - 1} in order")
            elif self._pending is not None:
                problem = (f"layer {self._pending[0]}'s attention did not run through attn_implementation="
                           f"'{ATTN_IMPLEMENTATION}' (build the model with it, after register()), so the engine "
                           f"never saw it")
            elif layer_idx != self._open.next_layer:
                problem = f"layer {layer_idx} arrived where layer {self._open.next_layer} was next"
            elif n != self._open.n:
                problem = f"layer {layer_idx} has {n} token(s), the forward opened with {self._open.n}"
            if problem is not None:
                self._recover()
                raise EngineError(f"MuserCache.update: {problem}; the engine is as before this forward")
        self._pending = (layer_idx, key_states, value_states)
        _local.cache = self
        return key_states, value_states

    def _open_forward(self, n: int) -> None:
        eng = self.engine
        self._checked_masks = {}
        if n > 1 and eng.position == 0:
            self._mode, self._open = "prompt", eng.prompt(n)
        else:
            self._mode, self._open = "token", eng.token(n)

    def _recover(self) -> None:
        """Abandon what a forward that raised left open (the engine goes back to before that forward)."""
        self._pending = None
        if getattr(_local, "cache", None) is self:
            _local.cache = None
        opened, self._open, self._mode = self._open, None, None
        if opened is not None and opened.is_open:
            opened.abandon()

    def _attend(self, module, query, key, value, attention_mask, scaling, dropout, sliding_window):
        layer, k_stored, v_stored = self._pending
        self._pending = None
        try:
            self._check_call(layer, module, key, value, k_stored, v_stored, scaling, dropout, sliding_window)
            n = query.shape[2]
            self._check_mask(attention_mask, layer, n)
            opened = self._open
            if self._mode == "prompt":
                out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                                                scaling=scaling)
                opened.store(layer, self._to_engine(key[0].transpose(0, 1)),
                             self._to_engine(value[0].transpose(0, 1)))
            else:
                got = opened.attend(layer, self._to_engine(query[0].transpose(0, 1)),
                                    self._to_engine(key[0].transpose(0, 1)), self._to_engine(value[0].transpose(0, 1)))
                if not isinstance(got, torch.Tensor):
                    got = torch.from_numpy(got)
                out = got.to(device=query.device, dtype=query.dtype).reshape(1, n, query.shape[1], query.shape[3])
            if layer == len(self.layers) - 1:
                opened.commit()
                self._open, self._mode = None, None
            return out, None
        except BaseException:
            self._recover()
            raise

    def _check_call(self, layer, module, key, value, k_stored, v_stored, scaling, dropout, sliding_window):
        cfg = self.engine.cfg
        module_layer = getattr(module, "layer_idx", layer)
        if module_layer != layer:
            raise EngineError(f"muser_ti attention: the module is layer {module_layer} but the cache's last update "
                              f"was layer {layer}")
        if key is not k_stored or value is not v_stored:
            raise EngineError(f"muser_ti attention at layer {layer}: the key/value it was given are not the ones "
                              f"MuserCache.update returned (the model changed them between the two)")
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

    def _check_mask(self, mask, layer: int, n: int) -> None:
        """The mask transformers built must hide nothing the engine attends (padding, a custom mask): the
        engine attends every token it holds within the window.  Checked once per mask object and forward."""
        if mask is None:
            return
        sliding = self.layers[layer].is_sliding
        key = (id(mask), sliding)
        if key in self._checked_masks:
            return
        if not isinstance(mask, torch.Tensor) or mask.ndim != 4:
            raise EngineError(f"muser_ti attention at layer {layer}: a {type(mask).__name__} attention mask; "
                              f"expected the boolean mask transformers' sdpa builder makes (call register())")
        kv_length, kv_offset = self.layers[layer].get_mask_sizes(n)
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        if tuple(allowed.shape[-2:]) != (n, kv_length) or allowed.shape[0] != 1:
            raise EngineError(f"muser_ti attention at layer {layer}: attention mask of shape {tuple(mask.shape)}, "
                              f"expected [1, 1, {n}, {kv_length}]")
        q_pos = torch.arange(n, device=allowed.device)[:, None] + self.engine.position
        kv_pos = torch.arange(kv_length, device=allowed.device)[None, :] + kv_offset
        expected = kv_pos <= q_pos
        if sliding:
            expected &= kv_pos > q_pos - self.window
        if not bool((allowed == expected).all()):
            raise EngineError(f"muser_ti attention at layer {layer}: the attention mask hides tokens the engine "
                              f"would attend (padding or a custom mask); MuserCache runs one unpadded sequence")
        self._checked_masks[key] = mask  # kept alive: its id stays its own for this forward

    def _to_engine(self, t):
        """One layer's [n, heads, head_dim] torch tensor as the engine takes it: a CUDA tensor as it is on
        arch="cuda"; otherwise a float32 numpy array (the tensor's own memory when it is float32 contiguous)."""
        t = t.detach()
        if t.is_cuda and self.engine.arch == "cuda":
            return t
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype != torch.float32:
            t = t.float()
        return t.contiguous().numpy()

    # ---- what generate calls between forwards --------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers >= 5.18 passes a count <= 0; 0 does
        nothing): ``Engine.rewind``.  Refused, with the cache unchanged, past what the rings hold."""
        self._recover()
        tokens_to_remove = int(tokens_to_remove)
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. Please "
                             f"use a negative integer to remove that number of tokens from the cache instead.")
        if tokens_to_remove == 0:
            return
        r = -tokens_to_remove
        position = self.engine.position
        if r > position:
            raise EngineError(f"MuserCache.crop({tokens_to_remove}): the cache holds {position} token(s)")
        try:
            self.engine.rewind(position - r)
        except EngineError as e:
            raise EngineError(f"MuserCache.crop({tokens_to_remove}) at position {position}: {e} (MuserCache("
                              f"rollback={self.rollback}) takes back {self.rollback + 1} token(s) once the rings are "
                              f"full: build it with a rollback that covers the longest draft)") from e
        self.rewinds += 1
        self.tokens_rewound += r

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        """generate's notice that it will crop up to ``recurrent_states_to_keep`` tokens a round (assisted
        decoding: the draft length).  The engine keeps what it keeps: refused here, before any forward,
        where the rings cannot roll back that far."""
        k = int(recurrent_states_to_keep or 0)
        if k > self.rollback + 1 and self.engine.cfg.swa_layers:
            raise EngineError(f"MuserCache: generate will roll back up to {k} token(s) a round (assisted decoding's "
                              f"draft length) but the rings take back {self.rollback + 1} (rollback={self.rollback}): "
                              f"build MuserCache(config, rollback={k - 1}) or more (the assistant's 'heuristic' "
                              f"schedule lengthens drafts by 2 after each fully accepted round; "
                              f"num_assistant_tokens_schedule='constant' keeps them as they are)")

    def reset(self) -> None:
        """An empty cache: a fresh engine of the same geometry and options (a ring cannot rewind to 0)."""
        self._recover()
        self.engine = Engine(self.engine.cfg, arch=self.engine.arch, **self._engine_options)

    def reorder_cache(self, beam_idx) -> None:
        raise EngineError("MuserCache runs one sequence: beam search (reorder_cache) is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if int(repeats) != 1:
            raise EngineError(f"MuserCache runs one sequence: cannot repeat it {repeats} times (num_return_sequences "
                              f"or beams > 1)")

    def batch_select_indices(self, indices) -> None:
        if [int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()] != [0]:
            raise EngineError(f"MuserCache runs one sequence: cannot select batch indices {indices}")

    def early_initialization(self, *args, **kwargs) -> None:
        pass

    # ---- snapshots ---------------------------------------------------------------------------------
    def save(self, path) -> None:
        """The engine's session to a safetensors file (Engine.save: atomic, bit-for-bit resumable)."""
        self._recover()
        self.engine.save(path)

    @classmethod
    def from_snapshot(cls, config, path, arch: str = "auto", **engine_options) -> "MuserCache":
        """A MuserCache resuming the session saved by ``save`` (its geometry must be ``config``'s)."""
        return cls(config, engine=Engine.from_snapshot(path, arch=arch, **engine_options))


def _check_same_geometry(have, want) -> None:
    fields = ("n_heads", "n_kv_heads", "head_dim", "n_layers", "layer_kinds", "window", "attention_scale")
    diff = [f"{f} {getattr(have, f)!r} (config: {getattr(want, f)!r})" for f in fields
            if getattr(have, f) != getattr(want, f)]
    if diff:
        raise EngineError("MuserCache: the engine's geometry is not the model config's: " + "; ".join(diff))


__all__ = ["ATTN_IMPLEMENTATION", "MuserCache", "MuserLayer", "muser_attention", "register"]
