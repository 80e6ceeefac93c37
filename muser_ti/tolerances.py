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
