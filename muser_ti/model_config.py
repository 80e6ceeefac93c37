"""Attention geometry read from a model's own configuration (its ``config.json``), for Muse Glimmer.

``configs/glimmer.yaml`` states the chapter's geometry by hand; a checkpoint carries the same facts in
the configuration its clients read. ``geometry_from_model_config`` reads that configuration in the
three forms it comes in and returns a :class:`~muser_ti.config.Geometry` built through
``geometry_from_dict``, so every rule a YAML file must pass applies here too:

- transformers' multimodal ``MuseGlimmerConfig`` (``model_type: muse_glimmer``, the text fields nested
  in ``text_config``);
- transformers' text-only ``MuseGlimmerTextConfig`` (``model_type: muse_glimmer_text``, flat);
- mlx-community's conversions (flat, ``model_type: muse_glimmer``), which mlx-lm reads.

A field that is absent takes ``MuseGlimmerTextConfig``'s default, written out below (transformers is an
optional extra, so it is not imported for this). What the engine cannot compute is refused with a
``ConfigError`` naming the source, the field, its value and why, never read as something else.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from os import PathLike
from pathlib import Path
from typing import Any

from .config import NOPE, SWA, Geometry, geometry_from_dict
from .errors import ConfigError, shown

# MuseGlimmerTextConfig's defaults (transformers 5.25, configuration_muse_glimmer.py); mlx-lm's ModelArgs
# has the same values for every field read here.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 202_048,
    "hidden_size": 6656,
    "intermediate_size": 19968,
    "num_hidden_layers": 52,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 131_072,
    "sliding_window": 2048,
    "attention_bias": False,
}
WEIGHT_BYTES = 2  # bf16, the checkpoint's dtype: the stream a decoded token reads from unquantized weights
CONFIG_FILE = "config.json"
_MAX_FILE_BYTES = 16 << 20  # a config.json is kilobytes; a larger file is not one

_OUTER_TYPE = "muse_glimmer"
_TEXT_TYPE = "muse_glimmer_text"
_SLIDING = "sliding_attention"
_FULL = "full_attention"
_LAYER_CLASSES = {_SLIDING: SWA, _FULL: NOPE}

# Attention sinks: a learned per-head logit in the softmax's denominator. The engine's softmax runs over
# the visible keys alone.
_SINK_FIELDS = ("sinks", "attention_sinks", "use_sink", "use_sinks", "use_attention_sinks")
# Fields other models use to set the attention's own scale. Glimmer's attention (transformers'
# MuseGlimmerTextAttention.scaling and mlx-lm's Attention.scale) is head_dim ** -0.5 in code and reads
# none of these (qk_scale_factor multiplies q before attention, so the engine never sees it). A value that
# agrees with head_dim ** -0.5 is used; one that differs is refused: honouring it would disagree with both
# clients' attention, and ignoring it would disagree with the configuration's author.
_SCALE_FIELDS = {
    "query_pre_attn_scalar": lambda v: v ** -0.5,  # Gemma: scale = query_pre_attn_scalar ** -0.5
    "attention_multiplier": lambda v: v,  # Granite: the scale itself
    "attn_scale": lambda v: v,
    "attention_scale": lambda v: v,
    "softmax_scale": lambda v: v,
    "scaling": lambda v: v,
}
# The model-config field each geometry field comes from, to name it when geometry_from_dict refuses one
_GEOMETRY_SOURCES = {
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "n_layers": "num_hidden_layers",
    "layer_pattern": "layer_types",
    "window": "sliding_window",
    "max_context": "max_position_embeddings",
    "attention_scale": "head_dim",
    "weight_stream_bytes": "hidden_size/intermediate_size/vocab_size",
}


def default_layer_types(n_layers: int) -> list[str]:
    """transformers' default: full attention on every 4th layer counted backward from the last."""
    return [_FULL if (n_layers - 1 - i) % 4 == 0 else _SLIDING for i in range(n_layers)]


def weight_stream_bytes(hidden: int, intermediate: int, vocab: int, n_layers: int, n_heads: int,
                        n_kv_heads: int, head_dim: int, attention_bias: bool = False) -> int:
    """Bytes of weights one decoded token reads, at 2 bytes a parameter (bf16).

    With H = hidden_size, I = intermediate_size, V = vocab_size, L = num_hidden_layers, Q = n_heads *
    head_dim, K = n_kv_heads * head_dim::

        per layer = H*Q (q_proj) + 2*H*K (k_proj, v_proj) + Q*H (o_proj) + H*Q (the attention's gate_proj)
                  + 3*H*I (MLP gate_proj, up_proj, down_proj) + 4*H (the four centred RMSNorms)
                  [+ Q + 2*K + H (q, k, v, o biases) with attention_bias]
        bytes     = 2 * (L * per layer + H (final norm) + V*H (lm_head))

    The embedding table is not streamed (a token reads one row of it); lm_head is counted whole even
    where it is tied to the embeddings, since the logits read all of it. The QK-norm and the embedding
    norm have no weights. A quantized checkpoint streams less: override the figure
    (``geom.with_overrides(weight_stream_bytes=...)``).
    """
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + hidden * q + 3 * hidden * intermediate + 4 * hidden
    if attention_bias:
        per_layer += q + 2 * kv + hidden
    return WEIGHT_BYTES * (n_layers * per_layer + hidden + vocab * hidden)


def geometry_from_model_config(source: Any, *, max_context: int | None = None, swa_ring_slack: int = 0,
                               name: str | None = None) -> Geometry:
    """The attention geometry of a Muse Glimmer model, read from its own configuration.

    ``source`` is a dict; a path to a ``config.json``; a directory holding one; a transformers config
    object (anything with ``to_dict()``); or an mlx-lm ``ModelArgs`` dataclass. It reads:

    - layer classes from ``layer_types`` (``sliding_attention`` -> swa, ``full_attention`` -> nope),
      compressed to their shortest repeating period; where ``layer_rope_theta`` is given, a sliding layer
      must have RoPE (theta != 0) and a full one none (0): the engine's NoPE class is "full context, no
      rotary" (RoPE itself is applied by the model before q and k reach the engine);
    - window = ``sliding_window`` (capped at max_context, which changes nothing: a window past the
      context sees every token either way); n_heads = ``num_attention_heads``; n_kv_heads =
      ``num_key_value_heads``; head_dim = ``head_dim``; max_context = ``max_position_embeddings`` unless
      the keyword overrides it; attention_scale = head_dim ** -0.5, Glimmer's attention scale
      (qk_scale_factor multiplies q before attention);
    - weight_stream_bytes from the widths, at 2 bytes a parameter (see :func:`weight_stream_bytes`);
    - name = the ``name`` keyword, else ``_name_or_path``, else ``model_type``.

    Refused, each with a ConfigError naming the source and the field: other model types; attention
    sinks; ``attn_logit_softcapping`` (softcapping inside attention; ``final_logit_softcapping``, on
    the output logits, is accepted); chunked attention; unknown layer types; a window rule other than
    the engine's (``sliding_window_pattern`` or ``use_sliding_window`` contradicting ``layer_types``,
    ``max_window_layers``, no ``sliding_window`` while sliding layers exist); an attention scale other
    than head_dim ** -0.5; and whatever ``geometry_from_dict`` refuses (heads not a multiple of the KV
    heads, head_dim outside 64/128/256, ...).
    """
    text, outer, label = _read_source(source)
    return _Reader(text, outer, label).geometry(max_context, swa_ring_slack, name)


# ---- sources -------------------------------------------------------------------------------------


def _read_source(source: Any) -> tuple[dict, dict | None, str]:
    """(text fields, the outer multimodal mapping or None, the label errors name the source by)."""
    if isinstance(source, dict):
        raw, label = source, "<dict>"
    elif isinstance(source, (str, PathLike)):
        raw, label = _read_file(Path(source))
    elif callable(getattr(source, "to_dict", None)):  # before the dataclass test: transformers' configs are
        raw, label = source.to_dict(), f"<{type(source).__name__} object>"  # both, and to_dict adds model_type
        if not isinstance(raw, dict):
            raise ConfigError(f"{label}: to_dict() returned {type(raw).__name__}, not a mapping")
    elif dataclasses.is_dataclass(source) and not isinstance(source, type):
        raw, label = dataclasses.asdict(source), f"<{type(source).__name__} dataclass>"
    else:
        raise TypeError(f"geometry_from_model_config: source must be a dict, a path to {CONFIG_FILE} or its "
                        f"directory, a transformers config or an mlx-lm ModelArgs; got {type(source).__name__}")

    model_type = raw.get("model_type")
    if model_type not in (None, _OUTER_TYPE, _TEXT_TYPE):
        raise ConfigError(f"{label}: field 'model_type': got {shown(model_type)}; expected {_OUTER_TYPE!r} or "
                          f"{_TEXT_TYPE!r} (absent fields default to Muse Glimmer's, so another model's "
                          f"configuration would be misread)")
    if "text_config" not in raw:  # transformers' text-only form, mlx-community's flat form, a plain dict
        return raw, None, label
    if model_type == _TEXT_TYPE:
        raise ConfigError(f"{label}: field 'text_config': a {_TEXT_TYPE!r} configuration is the text config "
                          f"itself and nests none")
    text = raw["text_config"]
    if text is None:  # transformers builds the default text config
        text = {}
    if not isinstance(text, dict):
        raise ConfigError(f"{label}: field 'text_config': got {shown(text)}; expected a mapping")
    if text.get("model_type") not in (None, _TEXT_TYPE):
        raise ConfigError(f"{label}: field 'text_config.model_type': got {shown(text.get('model_type'))}; "
                          f"expected {_TEXT_TYPE!r}")
    return text, raw, label


def _read_file(path: Path) -> tuple[dict, str]:
    if path.is_dir():
        path = path / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (a model configuration is a {CONFIG_FILE} or the directory "
                          f"holding one)")
    size = path.stat().st_size
    if size > _MAX_FILE_BYTES:
        raise ConfigError(f"{path}: {size:,} bytes; a {CONFIG_FILE} is at most {_MAX_FILE_BYTES:,}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level, got {type(raw).__name__}")
    return raw, str(path)


# ---- reading ------------------------------------------------------------------------------------


class _Reader:
    def __init__(self, text: dict, outer: dict | None, label: str):
        self.text, self.outer, self.label = text, outer, label
        self.prefix = "text_config." if outer is not None else ""
        # transformers' forms fill layer_rope_theta by its index rule; mlx-lm (a flat "muse_glimmer") and a
        # hand-written dict from layer_types
        self.transformers_form = outer is not None or text.get("model_type") == _TEXT_TYPE

    def fail(self, key: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{self.label}: field '{self.prefix}{key}': got {shown(value)}; {why}")

    def get(self, key: str) -> Any:
        return self.text.get(key, TEXT_DEFAULTS.get(key))

    def int_field(self, key: str) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(key, value, "expected a positive integer")
        return value

    # -- what the engine cannot compute
    def refuse_unsupported(self) -> None:
        scopes = [(self.text, self.prefix)] + ([(self.outer, "")] if self.outer is not None else [])
        for mapping, prefix in scopes:
            for key in _SINK_FIELDS:
                if mapping.get(key):
                    raise ConfigError(f"{self.label}: field '{prefix}{key}': got {shown(mapping[key])}; attention "
                                      f"sinks add a learned logit to the softmax's denominator, and the engine's "
                                      f"softmax runs over the visible keys alone")
            if mapping.get("attn_logit_softcapping") is not None:
                raise ConfigError(f"{self.label}: field '{prefix}attn_logit_softcapping': got "
                                  f"{shown(mapping['attn_logit_softcapping'])}; the engine's attention applies no "
                                  f"tanh softcap to its scores (final_logit_softcapping, on the output logits, "
                                  f"is fine)")
            if mapping.get("attention_chunk_size") is not None:
                raise ConfigError(f"{self.label}: field '{prefix}attention_chunk_size': got "
                                  f"{shown(mapping['attention_chunk_size'])}; chunked attention (keys of the "
                                  f"query's chunk only) is not a window the engine's planes address")
            if mapping.get("max_window_layers") is not None:
                raise ConfigError(f"{self.label}: field '{prefix}max_window_layers': got "
                                  f"{shown(mapping['max_window_layers'])}; a window rule by layer count is not "
                                  f"Glimmer's, whose windows come from layer_types alone")
        # mlx-lm merges top-level fields under text_config's, transformers reads text_config alone: where
        # the two differ the clients would build different models
        if self.outer is not None:
            for key in sorted(TEXT_DEFAULTS.keys() | {"layer_types", "layer_rope_theta"}):
                if key in self.outer and self.outer[key] != self.text.get(key, TEXT_DEFAULTS.get(key)):
                    raise ConfigError(f"{self.label}: field '{key}': got {shown(self.outer[key])} at the top level "
                                      f"and {shown(self.text.get(key, TEXT_DEFAULTS.get(key)))} in text_config; "
                                      f"transformers reads text_config's, mlx-lm the top level's")

    # -- layers
    def layer_types(self, n_layers: int) -> list[str]:
        if "layer_types" not in self.text or self.text["layer_types"] is None:
            if n_layers % 4 and not self.transformers_form:
                # mlx-lm's default repeats [sliding x3, full] from the first layer; transformers' counts back from
                # the last. They agree only when the layer count is a multiple of 4.
                raise ConfigError(f"{self.label}: field '{self.prefix}layer_types': absent, and "
                                  f"num_hidden_layers={n_layers} is not a multiple of 4, so transformers and mlx-lm "
                                  f"place the full-attention layers differently by default; give layer_types")
            return default_layer_types(n_layers)
        types = self.text["layer_types"]
        if not isinstance(types, (list, tuple)) or len(types) != n_layers:
            raise self.fail("layer_types", types, f"expected a list of num_hidden_layers={n_layers} layer types")
        for i, t in enumerate(types):
            if t == "chunked_attention":
                raise self.fail(f"layer_types[{i}]", t, "chunked attention (keys of the query's chunk only) is not "
                                "a window the engine's planes address")
            if t not in _LAYER_CLASSES:
                raise self.fail(f"layer_types[{i}]", t, f"expected one of {list(_LAYER_CLASSES)}")
        return list(types)

    def check_window_rule(self, types: list[str], window: Any) -> None:
        sliding = [i for i, t in enumerate(types) if t == _SLIDING]
        if sliding and window is None:
            raise self.fail("sliding_window", None, f"layer {sliding[0]} is {_SLIDING!r} and needs a window")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise self.fail("sliding_window", window, "expected a positive integer or null")
        if "use_sliding_window" in self.text and self.text["use_sliding_window"] is not None:
            if not self.text["use_sliding_window"] and sliding:
                raise self.fail("use_sliding_window", self.text["use_sliding_window"],
                                f"it turns sliding windows off, but layer_types[{sliding[0]}] is {_SLIDING!r}")
        pattern = self.text.get("sliding_window_pattern")
        if pattern is None:
            return
        # Gemma's integer rule: layer i slides unless (i + 1) is a multiple of it. A list (Glimmer's reference
        # form [w, w, w, 0]) repeats from the first layer, a non-zero entry being that layer's window.
        if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
            wanted = [(i + 1) % pattern != 0 for i in range(len(types))]
        elif isinstance(pattern, (list, tuple)) and pattern and all(
                isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in pattern):
            wanted = [pattern[i % len(pattern)] != 0 for i in range(len(types))]
            for w in pattern:
                if w and w != window:
                    raise self.fail("sliding_window_pattern", pattern,
                                    f"a window of {w} where sliding_window={window}: the engine has one window")
        else:
            raise self.fail("sliding_window_pattern", pattern, "expected a positive integer or a list of windows")
        for i, (t, slides) in enumerate(zip(types, wanted)):
            if (t == _SLIDING) != slides:
                raise self.fail("sliding_window_pattern", pattern,
                                f"it makes layer {i} {'sliding' if slides else 'full'}, but layer_types[{i}] "
                                f"is {t!r}")

    def check_rope(self, types: list[str]) -> None:
        thetas = self.text.get("layer_rope_theta")
        given = thetas is not None
        if not given:
            if not self.transformers_form:
                return  # mlx-lm derives it from layer_types: RoPE on sliding layers only
            # transformers' default, by index: NoPE on every 4th layer counted back from the last, the global
            # theta elsewhere
            rope = self.text.get("rope_parameters")
            theta = rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else self.text.get("rope_theta", 10000.0)
            thetas = [0 if t == _FULL else theta for t in default_layer_types(len(types))]
        if not isinstance(thetas, (list, tuple)) or len(thetas) != len(types):
            raise self.fail("layer_rope_theta", thetas, f"expected a list of num_hidden_layers={len(types)} numbers")
        for i, (t, theta) in enumerate(zip(types, thetas)):
            if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta):
                raise self.fail(f"layer_rope_theta[{i}]", theta, "expected a finite number (0: no RoPE)")
            why = "" if given else " (layer_rope_theta absent: transformers' default, by layer index)"
            if t == _SLIDING and theta == 0:
                raise self.fail(f"layer_rope_theta[{i}]", theta, f"layer_types[{i}] is {_SLIDING!r}, and the "
                                f"engine's SWA class is a rotary layer; a sliding layer without RoPE is not a class "
                                f"it has{why}")
            if t == _FULL and theta != 0:
                raise self.fail(f"layer_rope_theta[{i}]", theta, f"layer_types[{i}] is {_FULL!r}, and the engine's "
                                f"NoPE class is full context with no rotary; a full layer with RoPE is not a class "
                                f"it has{why}")

    def check_scale(self, head_dim: int) -> float:
        scale = head_dim ** -0.5
        for mapping, prefix in [(self.text, self.prefix)] + ([(self.outer, "")] if self.outer is not None else []):
            for key, to_scale in _SCALE_FIELDS.items():
                value = mapping.get(key)
                if value is None:
                    continue
                ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0
                      and math.isclose(to_scale(value), scale, rel_tol=1e-9))
                if not ok:
                    raise ConfigError(f"{self.label}: field '{prefix}{key}': got {shown(value)}; Glimmer's attention "
                                      f"scale is head_dim ** -0.5 = {scale:.9g} (qk_scale_factor multiplies q "
                                      f"before attention), and a config asking for another is not Glimmer's")
        return scale

    # -- the geometry
    def geometry(self, max_context: int | None, swa_ring_slack: int, name: str | None) -> Geometry:
        self.refuse_unsupported()
        n_layers = self.int_field("num_hidden_layers")
        n_heads = self.int_field("num_attention_heads")
        n_kv_heads = self.int_field("num_key_value_heads")
        hidden = self.int_field("hidden_size")
        # Both clients default head_dim to 128 where it is absent (transformers' class default, mlx-lm's
        # ModelArgs); hidden_size // num_attention_heads would give Glimmer 208, which neither uses
        head_dim = self.int_field("head_dim")
        types = self.layer_types(n_layers)
        window = self.get("sliding_window")
        self.check_window_rule(types, window)
        self.check_rope(types)
        self.check_scale(head_dim)

        if max_context is None:
            max_context = self.int_field("max_position_embeddings")
            context_field = self.prefix + "max_position_embeddings"
        else:
            context_field = "max_context (keyword)"
        classes = [_LAYER_CLASSES[t] for t in types]
        # a window at or past the context sees every token either way: capped so the engine's window <= context
        if isinstance(max_context, int) and not isinstance(max_context, bool) and max_context >= 1:
            window = max_context if window is None else min(window, max_context)
        elif window is None:
            window = max_context  # the geometry refuses max_context below
        if name is None:
            name = self._name()
        raw = {
            "name": name,
            "n_heads": n_heads,
            "n_kv_heads": n_kv_heads,
            "head_dim": head_dim,
            "n_layers": n_layers,
            "layer_pattern": _period(classes),
            "window": window,
            "max_context": max_context,
            # "auto" is 1/sqrt(head_dim), glimmer.yaml's: head_dim ** -0.5 (the clients' expression) can differ from
            # it in the last bit, and the geometry of one model should not depend on which file stated it
            "attention_scale": "auto",
            "weight_stream_bytes": weight_stream_bytes(
                hidden, self.int_field("intermediate_size"), self.int_field("vocab_size"), n_layers, n_heads,
                n_kv_heads, head_dim, bool(self.get("attention_bias"))),
            "swa_ring_slack": swa_ring_slack,
        }
        origins = {g: self.prefix + m for g, m in _GEOMETRY_SOURCES.items()}
        origins.update(max_context=context_field, swa_ring_slack="swa_ring_slack (keyword)",
                       name="name (keyword), _name_or_path or model_type")
        try:
            return geometry_from_dict(raw, self.label)
        except ConfigError as exc:  # name the model-config field the refused geometry field came from
            match = re.search(r"field '(\w+)", str(exc))
            if not match or match.group(1) not in origins:
                raise
            raise ConfigError(f"{exc} [from the model config's {origins[match.group(1)]}]") from None

    def _name(self) -> Any:
        for mapping in ([self.outer] if self.outer is not None else []) + [self.text]:
            path = mapping.get("_name_or_path")
            if isinstance(path, str) and path:
                return path
        for mapping in ([self.outer] if self.outer is not None else []) + [self.text]:
            model_type = mapping.get("model_type")
            if isinstance(model_type, str) and model_type:
                return model_type
        return _OUTER_TYPE


def _period(classes: list[str]) -> list[str]:
    """The shortest prefix that, repeated, gives every layer's class (Geometry.layer_kinds repeats it)."""
    n = len(classes)
    for p in range(1, n + 1):
        if all(classes[i] == classes[i % p] for i in range(n)):
            return classes[:p]
    return classes
