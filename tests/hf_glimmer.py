"""A reduced-width Muse Glimmer built from transformers' own model class, with random weights (nothing downloaded).

``MuseGlimmerForConditionalGeneration`` (the class transformers generates with; text-only input here) with the
real model's attention geometry: 32 query heads over 2 KV heads, head_dim 128, window 2,048, three sliding
layers (RoPE) then one full layer (NoPE), scaleless QK-norm times qk_scale_factor 3.87, the sigmoid gate.
Only the width is cut (hidden 256, intermediate 512, vocab 1,000) and the vision tower is one small layer
that text-only input never runs.  Random weights give near-flat logits (std ~0.06), so the output head is
widened (its weights multiplied by ``HEAD_GAIN``) until greedy choices mean something: the logits spread over
several units, below the model's softcap of 20.  Float32 throughout.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

HIDDEN, INTERMEDIATE, VOCAB = 256, 512, 1000
HEAD_GAIN = 50.0
TINY_VISION = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2)


def glimmer_config(n_layers: int, attn: str = "sdpa", **text_overrides) -> MuseGlimmerConfig:
    """The multimodal config with Glimmer's attention geometry and the cut width; ``n_layers`` a multiple of 4
    keeps the pattern whole (transformers counts it from the last layer, which is full)."""
    text = dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, vocab_size=VOCAB, num_hidden_layers=n_layers,
                num_attention_heads=32, num_key_value_heads=2, head_dim=128, sliding_window=2048,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    text.update(text_overrides)
    config = MuseGlimmerConfig(text_config=text, vision_config=dict(TINY_VISION), out_hidden_size=128,
                               projector_hidden_size=64)
    config._attn_implementation = attn
    return config


def build_glimmer(n_layers: int = 8, seed: int = 0, head_gain: float = HEAD_GAIN, attn: str = "sdpa",
                  **text_overrides) -> MuseGlimmerForConditionalGeneration:
    """transformers' own ``MuseGlimmerForConditionalGeneration`` with random weights from ``seed`` (float32,
    eval mode) and the output head widened."""
    torch.manual_seed(seed)
    config = glimmer_config(n_layers, attn, **text_overrides)
    model = MuseGlimmerForConditionalGeneration._from_config(config, attn_implementation=attn,
                                                             dtype=torch.float32)
    with torch.no_grad():
        # The per-block norms are centered RMSNorms (scale 1 + weight) initialised to 0: give them a little
        # spread as a trained model has, so no norm is an identity the test could not see through.
        for layer in model.model.language_model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm,
                         layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm):
                norm.weight.normal_(0.0, 0.1)
        # its own tensor: widening must not touch the (tied) input embedding
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * head_gain)
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model.eval()


def build_draft(seed: int = 1, head_gain: float = HEAD_GAIN, attn: str = "sdpa") -> MuseGlimmerForConditionalGeneration:
    """A tiny Glimmer sharing the vocabulary (one group of three sliding + one full layer, 8 query heads over
    2 KV heads, head_dim 64, hidden 64): the draft for assisted decoding."""
    return build_glimmer(4, seed=seed, head_gain=head_gain, attn=attn, hidden_size=64, intermediate_size=128,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64)


def prompt_ids(n: int, seed: int = 0) -> torch.Tensor:
    """A fixed random prompt of ``n`` token ids, [1, n]."""
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _f16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(t.dtype)


class F16PlanesCache(DynamicCache):
    """transformers' own DynamicCache holding K and V as the engine's planes do: rounded to f16 (kept in f32
    tensors), so transformers' own attention reads exactly the values the engine reads.  A forward's attention
    sees its own tokens as the engine's routes do: a prompt in f32 (transformers' sdpa attends it before the
    engine stores it); a decoded token on a sliding layer from the plane (splitk stores it, then reads it), on
    a full layer from the f32 activations (interleaved).  What is left between this and the engine is their
    f32 arithmetic."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if key_states.shape[-2] == 1 and self.is_sliding[layer_idx]:
            key_states, value_states = _f16(key_states), _f16(value_states)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        layer.keys, layer.values = _f16(layer.keys), _f16(layer.values)  # what stays is f16
        return keys, values
