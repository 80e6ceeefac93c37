"""Accuracy bounds, in one place, with the reason each is what it is.

All bounds are on ``reference.relative_error`` = max|out - ref| / max|ref|, per step over all layers,
against the float64 reference that reads the same f16 planes (so f16 storage of K/V is not error).
"""

# Own routes (splitk, interleaved) accumulate in f32: a 128-term f32 dot per score (~sqrt(128) ulp),
# exp to ~1 ulp, at most 32-row blocks per online-softmax update and at most 32 partials in the merge.
# Observed here: <= ~1e-6 on normal, peaked and sink inputs at up to 131,072 keys (large-magnitude
# inputs: see F32_ROUTE_RTOL_LARGE).
# The bound keeps a 10x margin so a real indexing or merge bug (errors of 1e-3 and up) cannot pass.
F32_ROUTE_RTOL = 1e-5

# The same routes on "large" inputs (tests/sessions.py: K near the f16 range, x8000; V x16000; Q x1e-3):
# every score is a 64-256-term f32 dot of terms ~8 that cancel to a sum of order 10, so its rounding is
# set by the terms, not by the sum (~sqrt(D) * 8 * 2^-24 per score), and it moves the softmax weights of
# V rows 16,000 large.  Observed on one session hypothesis found (head_dim 256, one KV head per query
# head, a 31-row window, seed 800): 1.11e-5 on NVIDIA's Vulkan, 1.02e-5 on
# lavapipe and 1.01e-5 on the CPU route, every one past 1e-5.  5e-5 keeps a 20x margin against an
# indexing or merge bug (errors of 1e-3 and up).
F32_ROUTE_RTOL_LARGE = 5e-5

# f16 output variant of the splitk reducer: one final rounding to f16 (2^-11 relative) on top.
F16_OUTPUT_RTOL = 1e-3

# llama.cpp's CPU flash_attn_ext (the pinned rung off macOS) rounds Q to f16 and keeps its V accumulator
# in f16, rounded after every key (ggml-cpu ops.cpp).  Its error therefore scales with |V|, not with the
# output (an averaged output can be far smaller than V): bound max|out - ref| <= LLAMA_CPU_VTOL * max|V|.
# Observed: <= 1.4e-3 * max|V| at up to 2,048 rows.  Limit of ggml's own arithmetic: the f16 accumulator
# overflows to inf once sum_j exp(s_j - max) * v_j passes 65504 (e.g. flat attention over V = 1000 past
# ~65 rows); tests keep V modest on this rung for that reason.
LLAMA_CPU_VTOL = 3e-3

# ---- a whole model: logits with the engine as its cache and attention (muser_ti/integrations) ----------------------
# Bounds on max|logits - ref| / max|ref| per step, ref being the same model with the framework's own cache and
# attention (f32 K/V), fed the same tokens.  Unlike the bounds above, these are on a model's output, so they carry
# the model's gain: a relative error e in each of its L attentions moves its logits by about G * e * L relative to
# max|logit|.  Linear in L, not sqrt(L): a layer's rounding also moves every later layer's q, k and v through the
# residual stream, so the layers' errors compound rather than add in quadrature (measured below: from 8 to 52 layers
# the error grew 7.3-7.4x in both frameworks, against 52 / 8 = 6.5 and sqrt(52 / 8) = 2.5).
#
# The f16 planes: storing K and V as f16 rounds each element to nearest, relative error <= u = 2^-11, so e = u
# (V's rounding moves an output by <= u |V|; K's moves a score by scale * q.dk, rms u/sqrt(3) * qk_scale_factor
# after Glimmer's QK-norm, which keeps the weights' relative change of the same order).  G measured on the
# reduced-width random Glimmer (tests/mlx_glimmer.py, tests/hf_glimmer.py: widths cut, true attention geometry,
# output head x50, a 2,040-token prompt + 72 decoded) by rounding K/V to f16 inside the framework's own attention,
# exactly as the planes hold them, and with the engine itself (the same figures: the f16 storage is the whole
# difference): mlx-lm 8 layers 0.0061 (G = 1.56), 52 layers 0.0442 (G = 1.74); transformers 8 layers 0.0047
# (G = 1.20), 52 layers 0.0346 (G = 1.36).  The bound takes G = 4: 2.3x over the largest measured.
# Where a step's top two logits differ by less than the bound, the rounding may flip the greedy choice (transformers,
# 52 layers, one step with a gap of 0.0017), so free-running greedy runs agree up to such a near-tie, not past it.
F16_UNIT_ROUNDOFF = 2.0 ** -11
MODEL_LOGIT_GAIN_F16 = 4.0


def model_logit_rtol_f16_planes(n_layers: int) -> float:
    """The engine's logits against the framework's own f32 cache: MODEL_LOGIT_GAIN_F16 * 2^-11 * n_layers
    (0.0156 at 8 layers, 0.102 at 52)."""
    return MODEL_LOGIT_GAIN_F16 * F16_UNIT_ROUNDOFF * n_layers


# The same model and tokens, the framework's own attention reading K/V rounded to f16 as the planes hold them (and
# the current token where the engine's route reads it: the f16 plane for splitk, the f32 activations for
# interleaved): what remains is two f32 attentions over the same values, each within F32_ROUTE_RTOL of float64, so
# e = 2 * F32_ROUTE_RTOL and the bound is G * e * L.  Measured: mlx-lm 8.6e-5 (8 layers, G = 0.54) and 8.2e-4
# (52, G = 0.79); transformers 8.2e-5 (8) and 3.9e-4 (52).  G = 2 keeps 2.5x: a bug in what the engine attends (a row,
# the window, an origin) moves logits far more than this, while the f16 bound above alone could hide a small one.
MODEL_LOGIT_GAIN_F32 = 2.0


def model_logit_rtol_f32_routes(n_layers: int) -> float:
    """The engine's logits against the framework's own attention over the planes' f16 values:
    MODEL_LOGIT_GAIN_F32 * 2 * F32_ROUTE_RTOL * n_layers (3.2e-4 at 8 layers, 2.1e-3 at 52)."""
    return MODEL_LOGIT_GAIN_F32 * 2 * F32_ROUTE_RTOL * n_layers
