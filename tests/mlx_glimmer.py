"""A reduced-width Muse Glimmer built from mlx-lm's own model class, with random weights (nothing downloaded).

The attention geometry is the real model's (32 query heads over 2 KV heads, head_dim 128, window 2,048,
three sliding layers then one full NoPE layer, scaleless QK-norm times qk_scale_factor, the sigmoid gate);
only the width is cut (hidden 256, intermediate 512, vocab 1,000).  Random weights give near-flat logits,
so the output head is widened (its weights multiplied) until greedy choices mean something: with the
head x ``HEAD_GAIN`` the logits spread over several units before the model's softcap of 20.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import muse_glimmer

HIDDEN, INTERMEDIATE, VOCAB = 256, 512, 1000
HEAD_GAIN = 50.0


def glimmer_args(n_layers: int, **overrides) -> muse_glimmer.ModelArgs:
    """ModelArgs with Glimmer's attention geometry and the cut width; ``n_layers`` a multiple of 4 keeps
    the pattern whole (three sliding, one full)."""
    fields = dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, vocab_size=VOCAB,
                  num_hidden_layers=n_layers, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                  sliding_window=2048)
    fields.update(overrides)
    return muse_glimmer.ModelArgs(**fields)


def build_glimmer(n_layers: int = 8, seed: int = 0, head_gain: float = HEAD_GAIN, **overrides) -> muse_glimmer.Model:
    """mlx-lm's own ``muse_glimmer.Model`` with random weights from ``seed`` and the output head widened."""
    mx.random.seed(seed)
    model = muse_glimmer.Model(glimmer_args(n_layers, **overrides))
    # The per-block norms are CenteredRMSNorm (scale 1 + weight) initialised to 0: give them a little
    # spread as a trained model has, so no norm is an identity the test could not see through.
    for layer in model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm,
                     layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm):
            norm.weight = 0.1 * mx.random.normal(norm.weight.shape)
    model.lm_head.weight = model.lm_head.weight * head_gain
    mx.eval(model.parameters())
    return model


def build_draft(seed: int = 1, head_gain: float = HEAD_GAIN) -> muse_glimmer.Model:
    """A tiny Glimmer (one group of three sliding + one full layer, 8 query heads over 2 KV heads, head_dim
    64, hidden 64) sharing the vocabulary: a draft model for speculative decoding."""
    return build_glimmer(4, seed=seed, head_gain=head_gain, hidden_size=64, intermediate_size=128,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64)


def prompt_tokens(n: int, seed: int = 0) -> mx.array:
    """A fixed random prompt of ``n`` token ids."""
    import numpy as np

    return mx.array(np.random.default_rng(seed).integers(0, VOCAB, size=n), dtype=mx.uint32)
