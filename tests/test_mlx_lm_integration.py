"""mlx-lm's own Muse Glimmer with the engine as its KV cache and decode attention (issue 47, items 4 and 5).

The model is mlx-lm's ``muse_glimmer.Model`` at Glimmer's attention geometry and a cut width, random weights
from fixed seeds (tests/mlx_glimmer.py); nothing is downloaded.  The run: a prompt of the window less 8 tokens,
then ``DECODE`` greedy tokens, so the SWA rings wrap and the NoPE planes grow (window -> 2 x window rows) during
decode.  CI runs 8 layers (two groups of three sliding + one full) with a 256-token window: the prompt pass, the
suite's most expensive step, is what the window sets, and the wrap and the growth are the same events at 256 as
at Glimmer's 2,048.  The 52-layer model with Glimmer's own 2,048 window (a 2,040-token prompt) is marked slow.

mlx-cpu's own attention over the prompt is the expensive part, and the engine's prompt runs exactly that
attention (mlx's, over the chunk) while it ingests the K/V: so the session runs the prompt once, with the
engine's cache, and mirrors each layer's prompt K/V into mlx-lm's own caches through mlx-lm's own
``update_and_fetch`` (the ``_PromptMirror`` cache).  From there, three runs of mlx-lm's ``generate_step``
(or the same model calls, teacher-forced) go their own ways:

* ``ref``: mlx-lm's own caches and attention (f32 K/V), free-running greedy;
* ``ours``: the engine, free-running greedy, snapshots taken after the prompt and mid-generation;
* ``f16``: mlx-lm's own attention over K/V rounded to f16 exactly as the engine's planes hold them,
  teacher-forced on ``ref``'s tokens: what the f16 planes alone do to the logits.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx_lm.generate import generate_step, speculative_generate_step  # noqa: E402
from mlx_lm.models import base as mlx_base  # noqa: E402
from mlx_lm.models import muse_glimmer  # noqa: E402
from mlx_lm.models.cache import (KVCache, RotatingKVCache, can_trim_prompt_cache, save_prompt_cache,  # noqa: E402
                                 trim_prompt_cache)

from muser_ti import EngineError, tolerances  # noqa: E402
from muser_ti.config import NOPE, SWA  # noqa: E402
from muser_ti.integrations import mlx_lm as mt_mlx  # noqa: E402

from mlx_glimmer import VOCAB, build_draft, build_glimmer, prompt_tokens  # noqa: E402

RUNS = [pytest.param((8, 256), id="8layers"),  # (layers, window): the prompt is the window less 8 tokens
        pytest.param((52, 2048), id="52layers", marks=pytest.mark.slow)]  # Glimmer's own window
DECODE = 72  # >= 64 decoded tokens: positions window - 8 .. window + 63 cross the NoPE growth and the ring's wrap
ROLLBACK = 4  # tokens a trim takes back (rings of 3 rows' slack): speculative decoding below drafts 3 a round
NUM_DRAFT = 3
SNAP_AT = 24  # the mid-generation snapshot: after the logits of decode step SNAP_AT
ARCH = "cpu"


def _r16(a):
    return a.astype(mx.float16).astype(mx.float32)


class _F16Rotating(RotatingKVCache):
    """mlx-lm's ring with the engine's f16 storage: a sliding layer's splitk route stores the current token
    first and reads it back from the plane (f16) with the rest."""

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(_r16(keys), _r16(values))


class _F16Growing(KVCache):
    """mlx-lm's growing cache with the engine's f16 storage: a full layer's interleaved route reads the history
    from the plane (f16) and the current token from the f32 activations."""

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(_r16(keys), _r16(values))
        n = keys.shape[2]
        return (mx.concatenate([k[..., :-n, :], keys], axis=2), mx.concatenate([v[..., :-n, :], values], axis=2))


def _f16_copy(cache):
    """A copy of mlx-lm's cache after the prompt, its K/V rounded to f16 (what the engine's planes hold)."""
    if isinstance(cache, RotatingKVCache):
        keys, values, offset, keep, max_size, idx = cache.state
        c = _F16Rotating.from_state((_r16(keys), _r16(values), offset, keep, max_size, idx))
    else:
        keys, values, offset = cache.state
        c = _F16Growing.from_state((_r16(keys), _r16(values), offset))
    mx.eval(c.keys, c.values)
    return c


class _PromptMirror(mt_mlx.MuserKVCache):
    """The engine's layer cache that also hands the prompt's K/V to mlx-lm's own cache (its own update_and_fetch),
    so one prompt pass fills both.  Detached (mirror = None) before the first decode step."""

    mirror = None

    def update_and_fetch(self, keys, values):
        out = super().update_and_fetch(keys, values)
        if self.mirror is not None:
            assert keys.shape[2] > 1, "the mirror is for the prompt pass only"
            self.mirror.update_and_fetch(keys, values)
        return out


class _Recorder:
    """A logits processor for generate_step that keeps every step's logits (float32) and runs ``on_step(j)``."""

    def __init__(self, on_step=None):
        self.logits, self.on_step = [], on_step

    def __call__(self, tokens, logits):
        self.logits.append(np.array(logits[0].astype(mx.float32)))
        if self.on_step is not None:
            self.on_step(len(self.logits) - 1)
        return logits


def _margins(logits: np.ndarray) -> np.ndarray:
    top = np.sort(logits, axis=-1)
    return top[:, -1] - top[:, -2]


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per step: max |a - b| / max |b| (the tolerances' form)."""
    return np.abs(a - b).max(axis=-1) / np.abs(b).max(axis=-1)


def _engine_state(eng):
    """Everything a snapshot holds (planes' bits, origins, position, route counts), for exact comparison."""
    tensors, meta = eng.snapshot_contents()
    return {k: np.array(v, copy=True) for k, v in tensors.items()}, meta


def _same_state(a, b) -> bool:
    (ta, ma), (tb, mb) = a, b
    return ma == mb and ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)


# ---- the session's runs -------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=RUNS)
def glimmer(request, tmp_path_factory):
    n_layers, window = request.param
    tmp = tmp_path_factory.mktemp(f"mlx_glimmer{n_layers}")
    t0 = time.perf_counter()
    model = build_glimmer(n_layers, seed=0, sliding_window=window)
    prompt = prompt_tokens(window - 8, seed=0)
    R = SimpleNamespace(n_layers=n_layers, W=window, P=window - 8, model=model, prompt=prompt, tmp=tmp, times={},
                        snap_prompt=tmp / "after_prompt.safetensors", snap_mid=tmp / "mid.safetensors")

    # ours, free-running through mlx-lm's generate_step; the prompt pass also fills mlx-lm's own caches
    ours = mt_mlx.make_cache(model, arch=ARCH, rollback=ROLLBACK)
    eng = ours[0].engine
    mirrors = model.make_cache()
    for c, m in zip(ours, mirrors):
        c.__class__, c.mirror = _PromptMirror, m
    R.ours_cache, R.engine = ours, eng
    R.states, R.positions = [], []
    after_prompt = {}

    def progress(done, total):
        if done == total - 1 and not after_prompt:  # the prefill chunk is in; the first decode step is next
            R.times["prompt pass"] = time.perf_counter() - t0
            for c in ours:
                c.mirror = None
            after_prompt["position"] = eng.position
            after_prompt["f16"] = [_f16_copy(m) for m in mirrors]
            eng.save(R.snap_prompt)

    def on_step(j):
        R.positions.append(eng.position)
        R.states.append({kind: ps.state for kind, ps in eng.planes.items()})
        if j == SNAP_AT:
            mt_mlx.save_cache(ours, R.snap_mid)

    rec = _Recorder(on_step)
    R.ours_tokens = [tok for tok, _ in generate_step(prompt, model, prompt_cache=ours, max_tokens=DECODE,
                                                      logits_processors=[rec], prompt_progress_callback=progress)]
    R.ours_logits = np.stack(rec.logits)
    R.times["ours decode"] = time.perf_counter() - t0 - R.times["prompt pass"]
    R.after_prompt_position = after_prompt["position"]
    R.route_counts = eng.route_counts

    # ref: mlx-lm's own caches, continuing from the same prompt pass
    t = time.perf_counter()
    rec = _Recorder()
    R.ref_tokens = [tok for tok, _ in generate_step(prompt[-1:], model, prompt_cache=mirrors, max_tokens=DECODE,
                                                     logits_processors=[rec])]
    R.ref_logits = np.stack(rec.logits)
    R.times["ref decode"] = time.perf_counter() - t

    # f16: mlx-lm's attention over the planes' f16 values, teacher-forced on ref's tokens
    t = time.perf_counter()
    R.f16_logits = _teacher_forced(model, after_prompt["f16"], [int(prompt[-1].item())] + R.ref_tokens)
    R.times["f16 decode"] = time.perf_counter() - t

    # ours, teacher-forced on ref's tokens from the after-prompt snapshot
    t = time.perf_counter()
    tf_cache = mt_mlx.load_cache(model, R.snap_prompt, arch=ARCH)
    R.tf_logits = _teacher_forced(model, tf_cache, [int(prompt[-1].item())] + R.ref_tokens)
    R.times["ours teacher-forced"] = time.perf_counter() - t
    R.times["fixture total"] = time.perf_counter() - t0
    print(f"\n[{n_layers} layers] " + ", ".join(f"{k} {v:.1f} s" for k, v in R.times.items()))
    return R


def _teacher_forced(model, cache, inputs) -> np.ndarray:
    """The logits after each of ``inputs``, fed one token at a time (the calls generate_step makes)."""
    out = []
    for tok in inputs:
        logits = model(mx.array([[tok]], dtype=mx.uint32), cache=cache)[:, -1, :]
        out.append(np.array(logits[0].astype(mx.float32)))
    return np.stack(out)


def _bound(logits: np.ndarray, n_layers: int) -> np.ndarray:
    """Per step, the f16 planes' logit bound (tolerances.model_logit_rtol_f16_planes), in logits."""
    return tolerances.model_logit_rtol_f16_planes(n_layers) * np.abs(logits).max(axis=-1)


# ---- (a) teacher-forced logits ---------------------------------------------------------------------------


def test_teacher_forced_logits_within_the_f16_bound(glimmer):
    """The engine against mlx-lm's own cache and attention on the same tokens: every step's logits within the
    bound the f16 planes' rounding gives (tolerances.model_logit_rtol_f16_planes), and within
    tolerances.model_logit_rtol_f32_routes of mlx's own attention over the same f16 values, which shows the
    difference from f32 is the planes' storage and nothing else; the greedy token is the same wherever the
    reference's top two logits differ by more than the bound."""
    R = glimmer
    ours, ref, f16 = R.tf_logits, R.ref_logits, R.f16_logits
    assert ours.shape == ref.shape == (DECODE + 1, VOCAB)
    rel_ref, rel_f16, rel_storage = _rel(ours, ref), _rel(ours, f16), _rel(f16, ref)
    print(f"\n[{R.n_layers} layers] engine vs mlx f32: max rel {rel_ref.max():.3g} (mean {rel_ref.mean():.3g}); "
          f"engine vs mlx over f16 K/V: {rel_f16.max():.3g}; f16 K/V alone: {rel_storage.max():.3g}; "
          f"smallest top-2 margin / max|logit| {(_margins(ref) / np.abs(ref).max(-1)).min():.3g}; "
          f"{int((_margins(ref) > _bound(ref, R.n_layers)).sum())} of {DECODE + 1} steps decisive")
    f16_bound = tolerances.model_logit_rtol_f16_planes(R.n_layers)
    f32_bound = tolerances.model_logit_rtol_f32_routes(R.n_layers)
    bad = np.flatnonzero(rel_ref > f16_bound)
    assert bad.size == 0, f"steps {bad.tolist()} past the f16 bound: {rel_ref[bad]}"
    bad = np.flatnonzero(rel_f16 > f32_bound)
    assert bad.size == 0, f"steps {bad.tolist()} past the bound against mlx over the same f16 K/V: {rel_f16[bad]}"
    decisive = _margins(ref) > _bound(ref, R.n_layers)
    differ = np.flatnonzero(decisive & (ours.argmax(-1) != ref.argmax(-1)))
    assert differ.size == 0, f"greedy tokens differ at decisive steps {differ.tolist()}"
    assert decisive.sum() >= DECODE // 4, "too few decisive steps for the check to mean anything"


def test_ring_wraps_and_nope_plane_grows_during_decode(glimmer):
    """The run crosses both events while the engine decodes: the NoPE planes grow from the window's rows to twice
    that and the rings (window + ROLLBACK - 1 rows) wrap, and every layer took the engine's routes."""
    R = glimmer
    assert R.after_prompt_position == R.P - 1
    assert R.positions == list(range(R.P, R.P + DECODE + 1))
    nope = [s[NOPE] for s in R.states]
    swa = [s[SWA] for s in R.states]
    assert nope[0].capacity == R.W and nope[-1].capacity == 2 * R.W, (nope[0], nope[-1])
    assert nope[-1].len == R.P + DECODE
    assert swa[0].origin_logical == 0 and swa[-1].origin_logical > 0, (swa[0], swa[-1])
    assert swa[-1].len == swa[-1].capacity == R.W + ROLLBACK - 1
    n_swa = sum(1 for k in R.engine.cfg.layer_kinds if k == SWA)
    steps = DECODE + 1
    assert sum(R.route_counts.values()) == steps * R.n_layers
    assert R.route_counts["splitk"] + R.route_counts.get("llama_vec_swa", 0) == steps * n_swa


# ---- (b) free-running greedy ---------------------------------------------------------------------------------


def test_free_running_greedy_matches_mlx(glimmer):
    """mlx-lm's generate_step, greedy, from the same prompt: the engine's cache gives mlx-lm's own cache's
    tokens.  Free-running, two runs may part only where the reference's top two logits lie within the bound
    (a near-tie the f16 planes may break either way), and from there on they decode different text: so the
    tokens must match up to the first step where they differ, and that step must be a near-tie."""
    R = glimmer
    assert len(R.ours_tokens) == len(R.ref_tokens) == DECODE
    differ = [j for j in range(DECODE) if R.ours_tokens[j] != R.ref_tokens[j]]
    margins, bound = _margins(R.ref_logits), _bound(R.ref_logits, R.n_layers)
    print(f"\n[{R.n_layers} layers] free-running: {differ[0] if differ else DECODE} of {DECODE} tokens match before "
          f"any difference; near-ties (margin <= bound) at steps {np.flatnonzero(margins <= bound).tolist()}")
    if differ:
        j = differ[0]
        assert margins[j] <= bound[j], (f"step {j}: tokens {R.ours_tokens[j]} (engine) and {R.ref_tokens[j]} (mlx) "
                                       f"differ where the reference's margin {margins[j]:.4g} is past the bound "
                                       f"{bound[j]:.4g}")
    n = differ[0] if differ else DECODE
    # up to there free-running is teacher-forced on the reference's tokens: the same logits, bit for bit
    np.testing.assert_array_equal(R.ours_logits[:n + 1], R.tf_logits[:n + 1])


# ---- (c) snapshot and resume ------------------------------------------------------------------------------


def test_snapshot_mid_generation_resumes_bit_for_bit(glimmer):
    """save_cache (Engine.save) mid-generation, load_cache in a new engine, continue with mlx-lm's generate_step:
    the same logits, bit for bit, and the same tokens as the uninterrupted run."""
    R = glimmer
    cache = mt_mlx.load_cache(R.model, R.snap_mid, arch=ARCH)
    assert cache[0].engine is not R.engine
    assert cache[0].offset == R.P + SNAP_AT
    rec = _Recorder()
    rest = DECODE - SNAP_AT - 1
    tokens = [tok for tok, _ in generate_step(mx.array([R.ours_tokens[SNAP_AT]], dtype=mx.uint32), R.model,
                                              prompt_cache=cache, max_tokens=rest, logits_processors=[rec])]
    assert tokens == R.ours_tokens[SNAP_AT + 1:]
    np.testing.assert_array_equal(np.stack(rec.logits), R.ours_logits[SNAP_AT + 1:])
    assert cache[0].engine.position == R.P + DECODE


# ---- (d) speculative decoding -----------------------------------------------------------------------------


class _OracleDraft:
    """A draft model that knows the greedy continuation and gets every position in ``wrong`` wrong: the draft
    proposes full, partial and no acceptances in a fixed pattern.  Its cache is one mlx KVCache used as a
    position counter (trimmed by mlx-lm like any draft cache)."""

    def __init__(self, sequence, wrong):
        self.sequence, self.wrong = sequence, wrong
        self.layers = [None]

    def make_cache(self):
        return [KVCache()]

    def __call__(self, inputs, cache):
        n = inputs.shape[1]
        start = cache[0].offset
        cache[0].update_and_fetch(mx.zeros((1, 1, n, 1)), mx.zeros((1, 1, n, 1)))
        rows = np.full((n, VOCAB), -10.0, np.float32)
        for i in range(n):
            p = start + i + 1  # the position this row predicts
            tok = self.sequence[p] if p < len(self.sequence) else 0
            rows[i, (tok + 1) % VOCAB if p in self.wrong else tok] = 10.0
        return mx.array(rows)[None]


def _counting_rewinds(eng):
    calls = []
    real = eng.rewind

    def rewind(position):
        calls.append((eng.position, position))
        return real(position)

    eng.rewind = rewind
    return calls


@pytest.mark.parametrize("draft_kind", ["oracle", "tiny_glimmer"])
def test_speculative_decoding_equals_greedy(glimmer, draft_kind):
    """mlx-lm's own speculative loop (speculative_generate_step, what stream_generate runs with draft_model=)
    with the engine's cache for the model: rejected drafts reach Engine.rewind, and the tokens are plain
    greedy's.  Drafts: a tiny random Glimmer (4 layers, 8:2 heads, head_dim 64, the same vocabulary) on mlx's
    own cache, which is rejected nearly always; and an oracle that knows the greedy continuation and misses
    three positions in ten, for full, partial and no acceptances."""
    R = glimmer
    cache = mt_mlx.load_cache(R.model, R.snap_prompt, arch=ARCH)
    eng = cache[0].engine
    assert eng.position == R.P - 1 and cache[0].is_trimmable() and cache[0].session.rollback == ROLLBACK
    calls = _counting_rewinds(eng)
    if draft_kind == "oracle":
        sequence = [int(t) for t in np.array(R.prompt)] + R.ours_tokens
        rng = np.random.default_rng(7)  # not periodic: a period of NUM_DRAFT + 1 would fall on the target's own token
        draft = _OracleDraft(sequence, wrong={p for p in range(R.P, R.P + DECODE) if rng.random() < 0.3})
        draft_cache = draft.make_cache()
        draft_cache[0].update_and_fetch(mx.zeros((1, 1, R.P - 1, 1)), mx.zeros((1, 1, R.P - 1, 1)))
    else:
        draft = build_draft(seed=1)
        draft_cache = draft.make_cache()
        draft(R.prompt[None, -129:-1], cache=draft_cache)  # the draft's context: the prompt's last 128 tokens
    out = list(speculative_generate_step(R.prompt[-1:], R.model, draft, prompt_cache=cache + draft_cache,
                                         num_draft_tokens=NUM_DRAFT, max_tokens=DECODE))
    tokens = [int(t) for t, _, _ in out]
    from_draft = [d for _, _, d in out]
    assert tokens == R.ours_tokens
    session = cache[0].session
    assert session.rewinds > 0 and len(calls) == session.rewinds, (session.rewinds, len(calls))
    assert all(0 < before - after <= NUM_DRAFT for before, after in calls)
    assert session.tokens_rewound == sum(before - after for before, after in calls)
    if draft_kind == "oracle":
        assert any(from_draft) and not all(from_draft)
    print(f"\n[{R.n_layers} layers, {draft_kind}] {sum(from_draft)} of {len(tokens)} tokens from the draft, "
          f"{session.rewinds} rewinds ({session.tokens_rewound} tokens)")
    # the run's last trim leaves the engine holding the accepted tokens (the last one fed where it was a draft's)
    assert eng.position in (R.P - 1 + DECODE, R.P + DECODE)


def test_speculative_through_many_ring_wraps_equals_greedy():
    """The same loop where the rings wrap many times while drafts are rejected: a Glimmer with a 32-token window
    (4 layers), a 50-token prompt and 80 tokens.  The engine's cache gives greedy's tokens.  (mlx-lm 0.32.2's own
    caches do not: its RotatingKVCache says it cannot trim once its ring is full, trim_prompt_cache then trims no
    layer at all, silently, and the rejected drafts stay in the cache; on this run its tokens part from greedy's
    at the second token.)"""
    model = build_glimmer(4, seed=2, sliding_window=32)
    draft = build_draft(seed=3)
    prompt = prompt_tokens(50, seed=4)
    greedy = [t for t, _ in generate_step(prompt, model, prompt_cache=mt_mlx.make_cache(model, arch=ARCH),
                                          max_tokens=80)]
    cache = mt_mlx.make_cache(model, arch=ARCH, rollback=NUM_DRAFT)
    calls = _counting_rewinds(cache[0].engine)
    spec = [t for t, _, _ in speculative_generate_step(prompt, model, draft, prompt_cache=cache + draft.make_cache(),
                                                       num_draft_tokens=NUM_DRAFT, max_tokens=80)]
    assert spec == greedy
    ring = cache[0].engine.planes[SWA].state
    assert ring.capacity == 32 + NUM_DRAFT - 1 and ring.origin_logical > 2 * ring.capacity, ring  # wrapped twice or more
    assert len(calls) > 10


# ---- (e) atomic forwards, one sequence ---------------------------------------------------------------------


class _Boom(Exception):
    pass


class _RaisingLayer:
    """A decoder layer that raises when the forward reaches it (the model's own code failing between layers)."""

    def __init__(self, real, exc, layer):
        self.self_attn, self.exc, self.layer = real.self_attn, exc, layer  # the model reads self_attn for masks

    def __call__(self, *args, **kwargs):
        raise self.exc(f"injected in layer {self.layer}")


def _raising_layer(model, layer: int, exc=_Boom):
    layers = model.model.layers
    real = layers[layer]
    layers[layer] = _RaisingLayer(real, exc, layer)
    return lambda: layers.__setitem__(layer, real)


@pytest.mark.parametrize("inputs, layer, exc", [
    ("one", 5, _Boom),                 # a decode step (Engine.token)
    ("verify", 7, KeyboardInterrupt),  # a multi-token forward after the prompt (Engine.token(n)), Ctrl-C
], ids=["decode-step", "verify-ctrl-c"])
def test_exception_mid_forward_leaves_engine_as_before(glimmer, inputs, layer, exc):
    """An exception (or Ctrl-C) raised by the model between layers leaves the engine exactly as before the
    forward: planes' bits, position, routes; the next forward abandons the open token itself and gives the
    uninterrupted logits bit for bit."""
    R = glimmer
    model = R.model
    layer = min(layer, R.n_layers - 1)
    cache = mt_mlx.load_cache(model, R.snap_prompt, arch=ARCH)
    eng = cache[0].engine
    before = _engine_state(eng)
    x = mx.array([[int(R.prompt[-1].item())]] if inputs == "one" else [[int(R.prompt[-1].item())] + R.ours_tokens[:2]],
                 dtype=mx.uint32)
    restore = _raising_layer(model, layer, exc)
    try:
        with pytest.raises(exc):
            model(x, cache=cache)
    finally:
        restore()
    assert eng.open_token is not None and eng.position == R.P - 1
    cache[0].session.recover()
    assert eng.open_token is None and _same_state(_engine_state(eng), before)

    # again, and this time the next forward recovers by itself
    restore = _raising_layer(model, layer, exc)
    try:
        with pytest.raises(exc):
            model(x, cache=cache)
    finally:
        restore()
    logits = np.array(model(x, cache=cache)[0].astype(mx.float32))
    clean = mt_mlx.load_cache(model, R.snap_prompt, arch=ARCH)
    np.testing.assert_array_equal(logits, np.array(model(x, cache=clean)[0].astype(mx.float32)))
    assert eng.position == clean[0].engine.position == R.P - 1 + x.shape[1]
    if inputs == "one":
        np.testing.assert_array_equal(logits[-1], R.ours_logits[0])


def test_exception_in_the_prompt_pass_leaves_engine_empty(glimmer):
    """A prompt forward (Engine.prompt) cut by an exception stores nothing; the retried prompt gives the
    logits of a clean one, bit for bit."""
    model = glimmer.model
    prompt = prompt_tokens(40, seed=3)[None]
    cache = mt_mlx.make_cache(model, arch=ARCH)
    eng = cache[0].engine
    restore = _raising_layer(model, min(2, glimmer.n_layers - 1))
    try:
        with pytest.raises(_Boom):
            model(prompt, cache=cache)
    finally:
        restore()
    assert eng.position == 0 and cache[0].empty()
    got = np.array(model(prompt, cache=cache).astype(mx.float32))
    want = np.array(model(prompt, cache=mt_mlx.make_cache(model, arch=ARCH)).astype(mx.float32))
    np.testing.assert_array_equal(got, want)
    assert eng.position == 40 and eng.open_token is None


def test_a_make_cache_list_runs_one_sequence(glimmer):
    """A make_cache list is one sequence's: a batch of 2 through it is refused by name, naming what batches (mlx-lm's
    batch generation, a list per prompt), the engine unchanged (prompt and decode)."""
    R = glimmer
    cache = mt_mlx.load_cache(R.model, R.snap_prompt, arch=ARCH)
    eng = cache[0].engine
    before = _engine_state(eng)
    for x in (mx.zeros((2, 1), dtype=mx.uint32), mx.zeros((2, 5), dtype=mx.uint32)):
        with pytest.raises(EngineError, match=r"batch size 2, expected 1 \(mlx-lm's batch generation merges one list "
                                              r"per sequence"):
            R.model(x, cache=cache)
        assert eng.open_token is None and _same_state(_engine_state(eng), before)
    fresh = mt_mlx.make_cache(R.model, arch=ARCH)
    with pytest.raises(EngineError, match="batch size 2"):
        R.model(mx.zeros((2, 7), dtype=mx.uint32), cache=fresh)
    assert fresh[0].engine.position == 0 and fresh[0].engine.open_token is None


# ---- many sequences: mlx-lm's own batch generation ----------------------------------------------------------
BATCH_MAX_TOKENS = [24, 10, 16]  # the rows finish apart (mlx-lm filters each out as it ends)
JOIN_AT, JOIN_TOKENS = 4, 12  # a fourth sequence joins after this many steps (mlx-lm extends the batch)


BATCH_WINDOW = 64  # the batch runs' model: the module's layers at a 64-token window (mlx-cpu's own batch attention
# over the module's 256-token window took a minute; the ring's wrap is the same event at 64)


def _batch_prompts(R):
    """Past the window (its ring wraps in the prompt), short, in between; and the one that joins later."""
    lengths = [BATCH_WINDOW + 20, 12, 40, 30]
    return [prompt_tokens(n, seed=200 + i).tolist() for i, n in enumerate(lengths)]


def _batch_generate(model, prompts, caches):
    """mlx-lm's BatchGenerator, greedy: the first three prompts at once, the fourth inserted after JOIN_AT steps;
    (tokens per sequence, logits per sequence [steps, vocab])."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=None, prefill_step_size=4096)
    recs = [_Recorder() for _ in prompts]
    uids = gen.insert(prompts[:3], BATCH_MAX_TOKENS, caches=caches[:3] if caches else None,
                      logits_processors=[[r] for r in recs[:3]])
    tokens, steps = {}, 0
    while responses := gen.next_generated():
        for r in responses:
            tokens.setdefault(r.uid, []).append(r.token)
        steps += 1
        if steps == JOIN_AT:
            uids += gen.insert(prompts[3:], [JOIN_TOKENS], caches=caches[3:] if caches else None,
                               logits_processors=[[recs[3]]])
    gen.close()
    return [tokens[u] for u in uids], [np.stack(r.logits) for r in recs]


@pytest.fixture(scope="module")
def batch_runs(glimmer):
    R = glimmer
    prompts = _batch_prompts(R)
    t = time.perf_counter()
    model = build_glimmer(R.n_layers, seed=3, sliding_window=BATCH_WINDOW)
    ref = _batch_generate(model, prompts, None)
    caches = [mt_mlx.make_cache(model, arch=ARCH) for _ in prompts]
    ours = _batch_generate(model, prompts, caches)
    R.times["batch generate, mlx-lm and ours"] = time.perf_counter() - t
    return SimpleNamespace(ref=ref, ours=ours, caches=caches, prompts=prompts)


def test_batch_generation_gives_mlx_lms_own_tokens(glimmer, batch_runs):
    """mlx-lm's BatchGenerator over the engine: three prompts of different lengths (one past the window, one short)
    finishing at different steps and a fourth joining mid-way, against the same generator over mlx-lm's own batch
    caches: each sequence's logits within the f16 bound, and its greedy tokens equal until a near-tie."""
    R, B = glimmer, batch_runs
    rtol = tolerances.model_logit_rtol_f16_planes(R.n_layers)
    (ref_tokens, ref_logits), (our_tokens, our_logits) = B.ref, B.ours
    assert [len(t) for t in our_tokens] == BATCH_MAX_TOKENS + [JOIN_TOKENS] == [len(t) for t in ref_tokens]
    for i, (rt, ot, rl, ol) in enumerate(zip(ref_tokens, our_tokens, ref_logits, our_logits)):
        same = next((j for j, (a, b) in enumerate(zip(rt, ot)) if a != b), len(rt))
        if same < len(rt):
            margin = float(_margins(rl[same:same + 1])[0])
            assert margin <= rtol * float(np.abs(rl[same]).max()), f"sequence {i} parts at a decided step {same}"
        rel = _rel(ol[:same + 1], rl[:same + 1])
        assert float(rel.max()) <= rtol, f"sequence {i}: logits {float(rel.max()):.3g} > {rtol:.3g}"
        if R.n_layers == 8:
            assert same == len(rt), f"sequence {i}: every token (no near-tie in this run)"
    # every sequence ran on its own engine, which holds its prompt and its tokens (mlx-lm's generator computes a step
    # ahead, so a sequence's last token has been attended too, or not where it was filtered out first)
    for i, (prompt, cache) in enumerate(zip(B.prompts, B.caches)):
        assert cache[0].engine.position - len(prompt) in (len(our_tokens[i]) - 1, len(our_tokens[i])), i
    assert B.caches[0][0].engine.planes[SWA].state.is_wrapped and not B.caches[1][0].engine.planes[SWA].state.is_wrapped


def test_batch_cache_protocol(glimmer):
    """merge / filter / extend / extract / deepcopy keep each sequence on its own engine; a chunked padded prompt
    and a trim are refused by name."""
    import copy

    R = glimmer
    lists = [mt_mlx.make_cache(R.model, arch=ARCH) for _ in range(3)]
    merged = [lists[0][i].merge([c[i] for c in lists]) for i in range(R.n_layers)]
    assert all(isinstance(c, mt_mlx.MuserBatchKVCache) for c in merged)
    assert len({id(c.session) for c in merged}) == 1
    session = merged[0].session
    assert [e for e in session.engines] == [c[0].engine for c in lists]
    tokens = mx.array(np.random.default_rng(0).integers(0, VOCAB, (3, 9)), dtype=mx.uint32)
    for c in merged:
        c.prepare(lengths=[9, 4, 6], right_padding=[0, 5, 3])
    R.model(tokens, cache=merged)
    for c in merged:
        c.finalize()
    assert session.positions() == [9, 4, 6]
    assert [int(x) for x in merged[0].offset.tolist()] == [9, 4, 6]
    R.model(tokens[:, :1], cache=merged)
    assert session.positions() == [10, 5, 7]
    split = copy.deepcopy(merged)
    for c in merged:
        c.filter([0, 2])
    for c in split:
        c.filter([1])
    assert session.positions() == [10, 7] and split[0].session.positions() == [5]
    for c, o in zip(merged, split):
        c.extend(o)
    assert session.positions() == [10, 7, 5] and session.engines[2] is lists[1][0].engine
    one = [c.extract(1) for c in merged]
    assert one[0].engine is lists[2][0].engine and len({id(c.session) for c in one}) == 1
    with pytest.raises(EngineError, match="does not roll back"):
        merged[0].trim(1)
    for c in merged:
        c.prepare(lengths=[3, 3, 3], right_padding=[0, 0, 0])
    with pytest.raises(EngineError, match="padded batch prompt in one chunk"):
        R.model(tokens[:, :3], cache=merged)
    assert session.positions() == [10, 7, 5]


# ---- the cache protocol -----------------------------------------------------------------------------------


def test_trim_rewinds_once_and_refuses_past_the_rings(glimmer):
    """mlx-lm's trim_prompt_cache trims every layer by n: the shared engine rewinds once, by n.  Past what the
    rings hold (their slack, once full) it is refused, the cache unchanged."""
    R = glimmer
    cache = mt_mlx.load_cache(R.model, R.snap_mid, arch=ARCH)  # position P + 24: the rings are full
    eng = cache[0].engine
    calls = _counting_rewinds(eng)
    assert can_trim_prompt_cache(cache)
    start = eng.position
    assert trim_prompt_cache(cache, 2) == 2
    assert eng.position == start - 2 and calls == [(start, start - 2)]
    assert all(c.offset == start - 2 for c in cache)
    before = _engine_state(eng)
    with pytest.raises(EngineError, match=r"takes back 4 token\(s\) at any point; make_cache\(model, rollback=N\)"):
        trim_prompt_cache(cache, ROLLBACK)  # 2 already taken: 4 more is past the slack
    assert eng.position == start - 2 and _same_state(_engine_state(eng), before)
    assert cache[0].session.rewinds == 1
    # with no slack a cache says it cannot trim (mlx-lm's speculative loop refuses it at the start)
    plain = mt_mlx.make_cache(R.model, arch=ARCH)
    assert not can_trim_prompt_cache(plain)


def test_protocol_surface(glimmer, tmp_path):
    """offset, size, empty, nbytes, make_mask, and mlx-lm's save_prompt_cache refused with the way to save."""
    R = glimmer
    cache = mt_mlx.load_cache(R.model, R.snap_prompt, arch=ARCH)
    eng = cache[0].engine
    kinds = eng.cfg.layer_kinds
    assert all(c.offset == R.P - 1 for c in cache) and not cache[0].empty()
    assert [c.size() for c in cache] == [R.P - 1] * R.n_layers
    per_row = eng.cfg.n_kv_heads * eng.cfg.head_dim * 2 * 2
    assert [c.nbytes for c in cache] == [(R.W + ROLLBACK - 1 if k == SWA else R.W) * per_row for k in kinds]
    assert cache[0].make_mask(1, window_size=R.W) is None and cache[0].make_mask(4) is None
    fresh = mt_mlx.make_cache(R.model, arch=ARCH)
    assert fresh[0].empty() and fresh[0].offset == 0
    assert fresh[0].make_mask(16) == "causal"
    assert fresh[0].make_mask(3000, window_size=2048).shape == (3000, 3000)
    with pytest.raises(ValueError, match="save_cache"):
        save_prompt_cache(str(tmp_path / "p.safetensors"), cache)


def test_other_caches_run_mlx_lm_unchanged(glimmer):
    """The dispatcher calls mlx-lm's own attention for any cache that is not the engine's: mlx-lm's caches give
    the same logits, bit for bit, with it installed and without."""
    model = glimmer.model
    x = prompt_tokens(48, seed=5)[None]

    def run():
        cache = model.make_cache()
        out = [np.array(model(x, cache=cache)[0, -1])]
        for _ in range(3):
            out.append(np.array(model(mx.array([[int(out[-1].argmax())]]), cache=cache)[0, -1]))
        return np.stack(out)

    assert muse_glimmer.scaled_dot_product_attention is mt_mlx.scaled_dot_product_attention
    assert mlx_base.scaled_dot_product_attention is mt_mlx.scaled_dot_product_attention
    with_dispatcher = run()
    mt_mlx.uninstall()
    try:
        assert muse_glimmer.scaled_dot_product_attention is not mt_mlx.scaled_dot_product_attention
        without = run()
    finally:
        mt_mlx.install(model)
    np.testing.assert_array_equal(with_dispatcher, without)
