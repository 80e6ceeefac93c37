"""A Muse Glimmer with random weights, built with transformers' or mlx-lm's own model class: a model to run the
engine in where no checkpoint is at hand (nothing is downloaded; muser-model uses it).

    from muser_ti.random_glimmer import transformers_model, mlx_model
    model = transformers_model("glimmer.yaml", layers=4)    # MuseGlimmerForConditionalGeneration, eval mode
    model = mlx_model("glimmer.yaml", layers=4)             # mlx_lm.models.muse_glimmer.Model

The attention is the real model's, from a geometry (a ``Geometry`` or a config file, ``configs/glimmer.yaml`` by
default: 32 query heads over 2 KV heads, head_dim 128, window 2,048, three sliding layers with RoPE then one full
NoPE layer), with Glimmer's scaleless QK-norm times qk_scale_factor and its sigmoid gate, as each framework
builds them; ``layers`` keeps the first N layers of the pattern.  Only the width is cut (hidden 256, intermediate
512, vocabulary 1,000), and the transformers model's vision tower is one small layer that text-only input never
runs.  Random weights give near-flat logits, so the output head is widened (its weights times ``head_gain``)
until greedy choices mean something, and the per-block norms get a little spread, as a trained model's have.
float32 throughout.  The model has no tokenizer: feed it token ids below ``VOCAB``.
"""

from __future__ import annotations

from pathlib import Path

from .config import NOPE, Geometry, load_config
from .errors import ConfigError

HIDDEN, INTERMEDIATE, VOCAB = 256, 512, 1000
HEAD_GAIN = 50.0


def geometry_of(geometry: Geometry | str | Path, layers: int | None = None) -> Geometry:
    """The geometry to build: a Geometry, or a config file (a bare name resolves to configs/, as load_config's),
    cut to its first ``layers`` layers if given."""
    geom = geometry if isinstance(geometry, Geometry) else load_config(geometry)
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= geom.n_layers:
            raise ConfigError(f"layers={layers!r}: expected an integer in [1, {geom.n_layers}] ({geom.source})")
        geom = geom.with_overrides(n_layers=layers)
    return geom


def _text_fields(geometry: Geometry, hidden: int, intermediate: int, vocab: int) -> dict:
    """The text config's fields for ``geometry`` (its layer classes as layer_types, its window and heads)."""
    if abs(geometry.attention_scale - geometry.head_dim ** -0.5) > 1e-9 * geometry.attention_scale:
        raise ConfigError(f"{geometry.source}: Glimmer attends with scale 1/sqrt(head_dim); attention_scale "
                         f"{geometry.attention_scale} has no Glimmer model")
    return dict(hidden_size=hidden, intermediate_size=intermediate, vocab_size=vocab,
                num_hidden_layers=geometry.n_layers, num_attention_heads=geometry.n_heads,
                num_key_value_heads=geometry.n_kv_heads, head_dim=geometry.head_dim, sliding_window=geometry.window,
                max_position_embeddings=geometry.max_context,
                layer_types=["full_attention" if kind == NOPE else "sliding_attention" for kind in geometry.layer_kinds])


def transformers_model(geometry: Geometry | str | Path = "glimmer.yaml", layers: int | None = None, seed: int = 0,
                       hidden: int = HIDDEN, intermediate: int = INTERMEDIATE, vocab: int = VOCAB,
                       head_gain: float = HEAD_GAIN, attn: str = "sdpa"):
    """transformers' ``MuseGlimmerForConditionalGeneration`` (text-only input) with random weights from ``seed``,
    on ``geometry``'s attention (its first ``layers`` layers), in eval mode; ``attn`` is its attention to begin
    with (``model.set_attn_implementation("muser_ti")`` after ``integrations.transformers.register()`` moves
    it onto the engine).  Needs the ``hf`` extra."""
    import torch
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    text = _text_fields(geometry_of(geometry, layers), hidden, intermediate, vocab)
    text["layer_rope_theta"] = [0 if t == "full_attention" else 500000.0 for t in text["layer_types"]]
    text.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config = MuseGlimmerConfig(text_config=text, out_hidden_size=128, projector_hidden_size=64,
                               vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                                  num_attention_heads=2))
    torch.manual_seed(seed)
    model = MuseGlimmerForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                         layer.post_feedforward_layernorm):
                norm.weight.normal_(0.0, 0.1)
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * head_gain)
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, name, None)
    return model.eval()


def mlx_model(geometry: Geometry | str | Path = "glimmer.yaml", layers: int | None = None, seed: int = 0,
              hidden: int = HIDDEN, intermediate: int = INTERMEDIATE, vocab: int = VOCAB, head_gain: float = HEAD_GAIN):
    """mlx-lm's ``muse_glimmer.Model`` with random weights from ``seed``, on ``geometry``'s attention (its first
    ``layers`` layers).  Needs the ``mlx`` extra."""
    import mlx.core as mx
    from mlx_lm.models import muse_glimmer

    fields = _text_fields(geometry_of(geometry, layers), hidden, intermediate, vocab)
    mx.random.seed(seed)
    model = muse_glimmer.Model(muse_glimmer.ModelArgs(**fields))
    for layer in model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                     layer.post_feedforward_layernorm):
            norm.weight = 0.1 * mx.random.normal(norm.weight.shape)
    model.lm_head.weight = model.lm_head.weight * head_gain
    mx.eval(model.parameters())
    return model


__all__ = ["HEAD_GAIN", "HIDDEN", "INTERMEDIATE", "VOCAB", "geometry_of", "mlx_model", "transformers_model"]
