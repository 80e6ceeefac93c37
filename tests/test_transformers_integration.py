"""The engine as the decode attention of transformers' own Muse Glimmer (issue 47 items 4 and 5).

The model is ``MuseGlimmerForConditionalGeneration`` built by tests/hf_glimmer.py: the real attention geometry
(32:2 heads, head_dim 128, three sliding + one full NoPE layer, QK-norm, gate), the width cut, random weights
from a fixed seed, float32, nothing downloaded.  The run: a prompt of the window less 8 tokens, then NEW decoded
tokens, so the sliding rings wrap (at the window's position) and the NoPE planes grow during decode.  CI runs 8
layers with a 256-token window (the prompt passes, the module's most expensive work, are what the window sets;
the wrap and the growth are the same events at 256 as at Glimmer's 2,048); the 52-layer model with Glimmer's
own 2,048 window (a 2,040-token prompt) is marked slow.  The engine
runs on the CPU; ``--arch`` names others (a GPU machine: ``--arch cuda`` runs the model on the GPU and hands its
torch CUDA tensors to the engine as they are, ``--arch vulkan`` keeps the model and its tensors on the CPU).

Every reference run is built once per module (fixtures), for 8 layers in the default run and 52 marked slow:

* ``reference``: transformers' own greedy ``generate`` (DynamicCache, sdpa), with its logits;
* ``reference_f16``: transformers' own attention teacher-forced on those tokens over K/V rounded to f16 as the
  engine's planes hold them (hf_glimmer.F16PlanesCache);
* ``teacher``: MuserCache + "muser_ti" teacher-forced on the reference's tokens (a snapshot saved mid-run);
* ``engine_greedy``: ``generate`` with a MuserCache, free-running;
* ``assisted``: ``generate(assistant_model=draft)`` with a MuserCache whose rings roll back.

The checks: (a) the teacher-forced logits within tolerances.model_logit_rtol_f16_planes(L) of the reference's
at every step (the planes' f16 rounding), within model_logit_rtol_f32_routes(L) of transformers' attention over
the same f16 values, and the same greedy token wherever the reference's top two differ by more than the f16
bound; (b) free-running greedy gives the reference's tokens (a near-tie, a top-two gap within the bound, may
go either way, and the runs part there); (c) a snapshot resumed continues bit for bit; (d) assisted decoding,
its rejections reaching Engine.rewind, gives greedy's tokens; (e) an exception or Ctrl-C mid-forward leaves
the engine as before (the next step has the uninterrupted run's bits), register() is
idempotent, a wrong scaling or window is refused naming it; (f) a left-padded batch of two prompts (one past the
window, one short) through ``generate`` gives transformers' own batch's tokens where decided and logits within the
f16 bound, rows finishing apart included; right padding and a batch of another size are refused.
"""

from __future__ import annotations

import inspect
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AttentionInterface, DynamicCache, MuseGlimmerForConditionalGeneration  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

from hf_glimmer import F16PlanesCache, build_draft, build_glimmer, prompt_ids  # noqa: E402
from muser_ti import EngineError, backend, tolerances  # noqa: E402
from muser_ti.config import NOPE, SWA  # noqa: E402
from muser_ti.integrations import transformers as mt_hf  # noqa: E402

# the forward's and generate's name for the cache: transformers 5.2x renamed past_key_values to cache (the old name
# warns there); the lent GPU machine's image has an earlier transformers
CACHE = ("cache" if "cache" in inspect.signature(MuseGlimmerForConditionalGeneration.forward).parameters else
         "past_key_values")

RUNS = [pytest.param((8, 256), id="8layers"),  # (layers, window): the prompt is the window less 8 tokens, so the
        pytest.param((52, 2048), id="52layers", marks=pytest.mark.slow)]  # ring wraps 8 tokens into decode
NEW = 72  # decoded tokens (>= 64)
SNAP = 40  # the teacher-forced run saves a snapshot before its SNAP-th decode forward
DRAFT_TOKENS = 4  # assisted decoding: tokens the draft proposes a round (constant schedule)
TIMINGS: dict[str, float] = {}  # fixture wall times, printed at the module's end (pytest -s)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module", autouse=True)
def _no_grad_and_timings():
    mt_hf.register()
    with torch.no_grad():
        yield
    if TIMINGS:
        print("\ntransformers integration, wall times: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items()))


class timed:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        TIMINGS[self.name] = time.perf_counter() - self.t0


def pytest_generate_tests(metafunc):
    """The engine's backend: the CPU unless --arch names others (on a GPU machine, --arch cuda runs the model on
    the GPU with torch CUDA tensors handed to the engine as they are; --arch vulkan keeps the model on the CPU)."""
    if "hf_arch" in metafunc.fixturenames:
        metafunc.parametrize("hf_arch", metafunc.config.getoption("arch") or ["cpu"], indirect=True, scope="module")


@pytest.fixture(scope="module")
def hf_arch(request):
    try:
        backend.activate(request.param)
    except backend.BackendError as exc:
        pytest.skip(f"{request.param} backend unavailable on this machine: {exc}")
    return request.param


def _device(arch: str) -> str:
    return "cuda" if arch == "cuda" else "cpu"


@pytest.fixture(scope="module", params=RUNS)
def model(request, hf_arch):
    n_layers, window = request.param
    with timed(f"build {n_layers} layers"):
        m = build_glimmer(n_layers, sliding_window=window).to(_device(hf_arch))
    m.muser_arch = hf_arch  # the engine arch the tests' caches use
    m.window, m.prompt_len = window, window - 8
    return m


def _ids(model, n: int) -> torch.Tensor:
    return prompt_ids(n).to(model.device)


@pytest.fixture(scope="module")
def ids(model):
    return _ids(model, model.prompt_len)


def _layers_of(model) -> int:
    return model.config.text_config.num_hidden_layers


def _attn(model, name):
    model.set_attn_implementation(name)
    return model


@pytest.fixture(scope="module")
def reference(model, ids):
    """transformers' own greedy generation (DynamicCache, sdpa): tokens [NEW] and logits [NEW, vocab]."""
    with timed(f"reference generate ({_layers_of(model)} layers)"):
        out = _attn(model, "sdpa").generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True,
                                            return_dict_in_generate=True)
    return out.sequences[0, model.prompt_len:].cpu(), torch.cat(out.logits).float().cpu()


@pytest.fixture(scope="module")
def reference_f16(model, ids, reference):
    """transformers' own attention over K/V rounded to f16 as the planes hold them, teacher-forced on the
    reference's tokens: logits [NEW, vocab]."""
    tokens, _ = reference
    cache = F16PlanesCache(config=model.config)
    _attn(model, "sdpa")
    with timed(f"reference over f16 K/V ({_layers_of(model)} layers)"):
        logits = [model(input_ids=ids, **{CACHE: cache}, logits_to_keep=1).logits[0, -1].float().cpu()]
        logits += _decode(model, cache, tokens[:-1])
    return torch.stack(logits)


def _cache(model, **kw):
    return mt_hf.MuserCache(model.config, arch=model.muser_arch, **kw)


def _decode(model, cache, tokens):
    """Teacher-forced single-token forwards: the logits after each of ``tokens``."""
    return [model(input_ids=t.view(1, 1).to(model.device), **{CACHE: cache}).logits[0, -1].float().cpu() for t in tokens]


@pytest.fixture(scope="module")
def teacher(model, ids, reference, tmp_path_factory):
    """MuserCache + "muser_ti" on the reference's tokens: the logits of every step, the planes' states after
    the prompt and at the end, and a snapshot taken before decode forward SNAP."""
    tokens, _ = reference
    path = tmp_path_factory.mktemp("hf") / "mid.safetensors"
    cache = _cache(model)
    _attn(model, "muser_ti")
    with timed(f"engine teacher-forced ({_layers_of(model)} layers)"):
        logits = [model(input_ids=ids, **{CACHE: cache}, logits_to_keep=1).logits[0, -1].float().cpu()]
        after_prompt = {kind: ps.state for kind, ps in cache.engine.planes.items()}
        logits += _decode(model, cache, tokens[:SNAP - 1])
        cache.save(path)
        logits += _decode(model, cache, tokens[SNAP - 1:-1])
    return dict(logits=torch.stack(logits), path=path, after_prompt=after_prompt, cache=cache,
                at_end={kind: ps.state for kind, ps in cache.engine.planes.items()})


@pytest.fixture(scope="module")
def engine_greedy(model, ids):
    cache = _cache(model)
    with timed(f"engine generate ({_layers_of(model)} layers)"):
        out = _attn(model, "muser_ti").generate(ids, max_new_tokens=NEW, do_sample=False, **{CACHE: cache},
                                                output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, model.prompt_len:].cpu(), torch.cat(out.logits).float().cpu(), cache


def _assisted(model, ids, draft, name):
    """transformers' assisted generation: ``draft`` proposes DRAFT_TOKENS a round, the model verifies them in
    one multi-token forward on the engine (Engine.token(n)) and crop() rewinds the rejected ones."""
    draft.generation_config.num_assistant_tokens = DRAFT_TOKENS
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # draft all DRAFT_TOKENS, however unsure
    cache = _cache(model, rollback=DRAFT_TOKENS)  # crop takes back up to the draft's length
    forwards = []
    hook = model.register_forward_pre_hook(lambda mod, args, kw: forwards.append(kw["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        with timed(f"engine assisted generate, {name} ({_layers_of(model)} layers)"):
            out = _attn(model, "muser_ti").generate(ids, max_new_tokens=NEW, do_sample=False, **{CACHE: cache},
                                                    assistant_model=draft, output_logits=True,
                                                    return_dict_in_generate=True)
    finally:
        hook.remove()
    return out.sequences[0, model.prompt_len:].cpu(), torch.cat(out.logits).float().cpu(), cache, forwards


@pytest.fixture(scope="module")
def assisted(model, ids):
    """A tiny random Glimmer drafts (hf_glimmer.build_draft): it is almost never right, so rounds rewind."""
    return _assisted(model, ids, build_draft().to(model.device), "tiny random draft")


@pytest.fixture(scope="module")
def assisted_exact(model, ids):
    """The model's own weights, in float32 with transformers' own cache and sdpa, draft: every draft is accepted
    unless the planes' f16 rounding flips a near-tie, so the verify passes' every row is used."""
    draft = build_glimmer(_layers_of(model), sliding_window=model.window).to(model.device)
    return _assisted(model, ids, draft, "exact draft")


def _resumed(model, teacher):
    """A MuserCache resumed from the teacher-forced run's snapshot (before decode forward SNAP)."""
    return mt_hf.MuserCache.from_snapshot(model.config, teacher["path"], arch=model.muser_arch)


# ---- (a) teacher-forced logits against transformers' own attention -------------------------------------
def _relative(got, ref):
    """max |got - ref| / max |ref| per step."""
    return (got - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1)


def _gap(logits):
    top2 = logits.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def test_teacher_forced_logits_within_the_f16_bound(model, reference, teacher):
    tokens, ref = reference
    got = teacher["logits"]
    assert got.shape == ref.shape
    # step 0 is the prompt's forward: transformers' own sdpa in both runs, bit for bit
    assert torch.equal(got[0], ref[0])
    rtol = tolerances.model_logit_rtol_f16_planes(_layers_of(model))
    rel = _relative(got, ref)
    worst = int(rel.argmax())
    assert float(rel.max()) <= rtol, f"step {worst}: {float(rel[worst]):.4g} > model_logit_rtol_f16_planes {rtol:.4g}"
    decided = _gap(ref) > rtol * ref.abs().amax(dim=-1)
    # not vacuous: 65 of 72 steps are decided at 8 layers, 17 at 52 (the bound grows with the layers)
    assert int(decided.sum()) >= 10, "too few steps with a clear greedy choice: widen the head"
    assert torch.equal(got.argmax(-1)[decided], ref.argmax(-1)[decided])
    assert torch.equal(ref.argmax(-1), tokens)
    print(f"\nteacher-forced against f32: max relative {float(rel.max()):.3g} (bound {rtol:.3g}), "
          f"{int(decided.sum())}/{NEW} steps decided")


def test_teacher_forced_logits_match_attention_over_the_same_f16_values(model, reference_f16, teacher):
    got, want = teacher["logits"], reference_f16
    rtol = tolerances.model_logit_rtol_f32_routes(_layers_of(model))
    rel = _relative(got, want)
    worst = int(rel.argmax())
    assert float(rel.max()) <= rtol, f"step {worst}: {float(rel[worst]):.4g} > model_logit_rtol_f32_routes {rtol:.4g}"
    print(f"\nteacher-forced against f16 K/V in transformers' attention: max relative {float(rel.max()):.3g} "
          f"(bound {rtol:.3g})")


def test_decode_wraps_the_ring_and_grows_the_nope_plane(teacher):
    before, after = teacher["after_prompt"], teacher["at_end"]
    P, W = before[SWA].len, after[SWA].capacity
    assert before[SWA].origin_physical == 0 and P + 8 == W  # the prompt: the window less 8 tokens
    assert after[SWA].len == W and after[SWA].origin_physical == (P + NEW - 1) % W
    assert after[NOPE].len == P + NEW - 1 and after[NOPE].capacity > before[NOPE].capacity
    routes = teacher["cache"].engine.route_counts
    assert set(routes) == {"splitk", "interleaved"}, routes


# ---- (b) free-running greedy generation ---------------------------------------------------------------
def _same_tokens_until_a_tie(got, want, want_logits, rtol):
    """``got`` equals ``want`` (a greedy run whose logits are ``want_logits``), except that from a step whose
    top-two gap in ``want_logits`` is within ``rtol`` x max|logit| (a near-tie the bound cannot decide) the runs
    may part.  Returns the number of steps compared."""
    differ = (got != want).nonzero().flatten()
    if not len(differ):
        return len(want)
    i = int(differ[0])
    gap, allowed = float(_gap(want_logits[i:i + 1])[0]), rtol * float(want_logits[i].abs().max())
    assert gap <= allowed, f"the runs part at step {i} where the top-two gap {gap:.4g} exceeds the bound {allowed:.4g}"
    return i


def test_free_running_greedy_matches_transformers(model, reference, engine_greedy):
    tokens, _, cache = engine_greedy
    same = _same_tokens_until_a_tie(tokens, reference[0], reference[1],
                                    tolerances.model_logit_rtol_f16_planes(_layers_of(model)))
    if _layers_of(model) == 8:
        assert same == NEW  # no near-tie in this run: every token
    assert cache.get_seq_length() == model.prompt_len + NEW - 1  # the last token is generated, not yet attended
    print(f"\nfree-running greedy: the first {same} of {NEW} tokens are transformers' own")


# ---- (c) snapshot mid-generation, resume, continue ----------------------------------------------------
def test_snapshot_resume_continues_bit_for_bit(model, reference, teacher):
    tokens, _ = reference
    cache = _resumed(model, teacher)
    assert cache.get_seq_length() == model.prompt_len + SNAP - 1
    got = torch.stack(_decode(_attn(model, "muser_ti"), cache, tokens[SNAP - 1:-1]))
    assert torch.equal(got, teacher["logits"][SNAP:])


# ---- (d) assisted (speculative) decoding --------------------------------------------------------------
def test_assisted_decoding_equals_greedy_with_rewinds(model, engine_greedy, assisted):
    """Every draft rejected: each round rewinds the draft's tokens; the verify pass's first row decides."""
    tokens, _, cache, forwards = assisted
    greedy, greedy_logits, _ = engine_greedy
    # the same planes, the same f16 values: what differs is f32 arithmetic (a verify pass's n-row matmuls)
    same = _same_tokens_until_a_tie(tokens, greedy, greedy_logits,
                                    tolerances.model_logit_rtol_f32_routes(_layers_of(model)))
    assert same == NEW or _layers_of(model) != 8
    verify = [n for n in forwards[1:] if n > 1]
    # the prompt with the first draft, then verify passes of the last token and a draft (shorter at the end)
    assert forwards[0] == model.prompt_len + DRAFT_TOKENS and max(verify) == DRAFT_TOKENS + 1, forwards
    assert cache.rewinds > 0 and cache.tokens_rewound >= cache.rewinds  # rejections reached Engine.rewind
    print(f"\nassisted, tiny random draft: {len(forwards)} target forwards for {NEW} tokens ({len(verify)} verify "
          f"passes of {sorted(set(verify))} tokens), {cache.rewinds} rewinds of {cache.tokens_rewound} tokens in all; "
          f"{same} tokens compared")


def test_assisted_decoding_with_accepted_drafts_equals_greedy(model, engine_greedy, assisted_exact):
    """Drafts accepted: the verify passes' later rows pick tokens, and rounds crop nothing."""
    tokens, _, cache, forwards = assisted_exact
    greedy, greedy_logits, _ = engine_greedy
    same = _same_tokens_until_a_tie(tokens, greedy, greedy_logits,
                                    tolerances.model_logit_rtol_f32_routes(_layers_of(model)))
    assert same == NEW or _layers_of(model) != 8
    assert len(forwards) <= NEW // DRAFT_TOKENS + 2, forwards  # DRAFT_TOKENS + 1 tokens a forward
    print(f"\nassisted, exact draft: {len(forwards)} target forwards for {NEW} tokens, {cache.rewinds} rewinds of "
          f"{cache.tokens_rewound} tokens; {same} tokens compared")


def test_assisted_decoding_refuses_a_draft_longer_than_the_rollback(model):
    cache = _cache(model, rollback=3)
    with pytest.raises(EngineError, match=r"roll back up to 4 token\(s\).*take back 3 .*rollback=4\)"):
        cache.activate_past_recording(recurrent_states_to_keep=4)
    cache.activate_past_recording(recurrent_states_to_keep=3)


# ---- (e) atomic forwards, refusals --------------------------------------------------------------------
def _layers(model):
    return model.model.language_model.layers


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_exception_mid_forward_leaves_the_engine_as_before(model, reference, teacher, exc):
    tokens, _ = reference
    cache = _resumed(model, teacher)
    eng = cache.engine
    position, routes = eng.position, dict(eng.route_counts)
    layer = 2 * len(_layers(model)) // 3

    def boom(*args):
        raise exc("injected")

    hook = _layers(model)[layer].mlp.register_forward_pre_hook(boom)
    try:
        with pytest.raises(exc, match="injected"):
            _attn(model, "muser_ti")(input_ids=tokens[SNAP - 1].view(1, 1).to(model.device), **{CACHE: cache})
    finally:
        hook.remove()
    assert eng.open_token is not None and eng.open_token.next_layer == layer + 1  # left open by the raise
    assert cache.get_seq_length() == position
    # the next forward abandons it first: the step has the uninterrupted run's bits
    got = _decode(model, cache, tokens[SNAP - 1:SNAP + 1])
    assert torch.equal(torch.stack(got), teacher["logits"][SNAP:SNAP + 2])
    assert eng.position == position + 2
    assert sum(eng.route_counts.values()) == sum(routes.values()) + 2 * len(_layers(model))


def test_crop_abandons_a_token_left_open(model, reference, teacher):
    tokens, _ = reference
    cache = _resumed(model, teacher)
    hook = _layers(model)[1].mlp.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
    try:
        with pytest.raises(RuntimeError):
            _attn(model, "muser_ti")(input_ids=tokens[SNAP - 1].view(1, 1).to(model.device), **{CACHE: cache})
    finally:
        hook.remove()
    cache.crop(0)
    assert cache.engine.open_token is None and cache.get_seq_length() == model.prompt_len + SNAP - 1


@pytest.mark.parametrize("attr, layer_of, value, match", [
    ("scaling", lambda L: 2, 0.1, r"scaling=0\.1 but the engine applies attention_scale=0\.0883"),
    ("sliding_window", lambda L: 1, 100, r"sliding_window=100 .* sliding-window layer \(window (256|2048)\)"),
    ("sliding_window", lambda L: 3, 256, r"sliding_window=256 .* full-context layer \(window None\)"),
])
def test_wrong_scaling_or_window_is_refused_naming_it(model, reference, teacher, attr, layer_of, value, match):
    tokens, _ = reference
    cache = _resumed(model, teacher)
    attn = _layers(model)[layer_of(len(_layers(model)))].self_attn
    saved = getattr(attn, attr)
    setattr(attn, attr, value)
    try:
        with pytest.raises(EngineError, match=match):
            _attn(model, "muser_ti")(input_ids=tokens[SNAP - 1].view(1, 1).to(model.device), **{CACHE: cache})
    finally:
        setattr(attn, attr, saved)
    assert cache.engine.open_token is None  # abandoned on the spot
    got = _decode(model, cache, tokens[SNAP - 1:SNAP])
    assert torch.equal(got[0], teacher["logits"][SNAP])


def test_crop_rewinds_and_refuses_past_the_rings(model, reference, teacher):
    tokens, _ = reference
    cache = _resumed(model, teacher)  # rollback 0, rings full
    position = cache.get_seq_length()
    with pytest.raises(EngineError, match=r"this cache takes back 1 token\(s\) at any point; MuserCache\(config, "
                                          r"rollback=N\) takes back N"):
        cache.crop(-2)
    with pytest.raises(ValueError, match="positive value"):
        cache.crop(3)
    assert cache.get_seq_length() == position
    cache.crop(-1)  # a full ring gives one token back
    assert cache.get_seq_length() == position - 1 and (cache.rewinds, cache.tokens_rewound) == (1, 1)
    got = _decode(_attn(model, "muser_ti"), cache, tokens[SNAP - 2:SNAP])
    assert torch.equal(torch.stack(got), teacher["logits"][SNAP - 1:SNAP + 1])


# ---- (f) a left-padded batch through generate --------------------------------------------------------
NEW_BATCH = 24  # tokens each row decodes


def _left_padded(model, lengths, seeds=None):
    """Prompts of ``lengths`` (fixed random ids from ``seeds``, one a row), left-padded: (ids [B, P], attention_mask)."""
    P = max(lengths)
    ids = torch.zeros((len(lengths), P), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, P - n:], mask[b, P - n:] = prompt_ids(n, seed=seeds[b] if seeds else 100 + b)[0], 1
    return ids.to(model.device), mask.to(model.device)


@pytest.fixture(scope="module")
def batch_runs(model):
    """transformers' own batch generate (sdpa, DynamicCache) and the same batch on a MuserCache: two prompts of
    different lengths, one past the window (its ring wraps in the prompt) and one short, greedy, with logits;
    then the same with an end-of-sequence token the first row reaches early, so the rows finish apart."""
    lengths, seeds = [12, model.window + 20], [101, 100]  # the padded row first: the cache counts positions as the
    ids, mask = _left_padded(model, lengths, seeds)  # model does, whatever row 0's padding
    kw = dict(attention_mask=mask, max_new_tokens=NEW_BATCH, do_sample=False, output_logits=True,
              return_dict_in_generate=True, pad_token_id=0)
    runs = {"lengths": lengths, "seeds": seeds, "P": ids.shape[1]}
    with timed(f"batch of 2 generate, sdpa and engine ({_layers_of(model)} layers)"):
        runs["sdpa"] = _attn(model, "sdpa").generate(ids, **kw)
        cache = _cache(model)
        runs["engine"] = _attn(model, "muser_ti").generate(ids, **{CACHE: cache}, **kw)
        runs["cache"] = cache
        eos = int(runs["sdpa"].sequences[0, ids.shape[1] + 5])  # row 0's sixth token ends it
        runs["eos"] = eos
        runs["sdpa_eos"] = _attn(model, "sdpa").generate(ids, eos_token_id=eos, **kw)
        runs["engine_eos"] = _attn(model, "muser_ti").generate(ids, **{CACHE: _cache(model)}, eos_token_id=eos, **kw)
    return runs


def _rows_agree(model, want, got, P):
    """Each row: the same tokens until a near-tie of ``want``'s logits, and logits within the f16 bound up to
    there.  Returns the steps compared per row."""
    rtol = tolerances.model_logit_rtol_f16_planes(_layers_of(model))
    want_logits, got_logits = torch.stack(want.logits).float().cpu(), torch.stack(got.logits).float().cpu()
    compared = []
    for b in range(want.sequences.shape[0]):
        wl = want_logits[:, b]
        same = _same_tokens_until_a_tie(got.sequences[b, P:].cpu(), want.sequences[b, P:].cpu(), wl, rtol)
        rel = _relative(got_logits[:same + 1, b], wl[:same + 1]) if same < len(wl) else _relative(got_logits[:, b], wl)
        assert float(rel.max()) <= rtol, f"row {b}: logits {float(rel.max()):.4g} > model_logit_rtol_f16_planes {rtol:.4g}"
        compared.append(same)
    return compared


def test_a_left_padded_batch_generates_what_transformers_does(model, batch_runs):
    """Row by row, greedy tokens equal to transformers' own batch where decided, logits within the f16 bound; each
    sequence holds its own tokens only (no padding), its ring wrapped or not by its own length."""
    P, lengths = batch_runs["P"], batch_runs["lengths"]
    compared = _rows_agree(model, batch_runs["sdpa"], batch_runs["engine"], P)
    if _layers_of(model) == 8:
        assert compared == [NEW_BATCH, NEW_BATCH]
    cache = batch_runs["cache"]
    assert cache.batch_size == 2 and cache.get_seq_length() == P + NEW_BATCH - 1
    assert cache.batch.positions() == [n + NEW_BATCH - 1 for n in lengths]
    short_seq, long_seq = (cache.batch.sequence(s) for s in cache.batch.sequences)
    assert long_seq.plane_state(0).is_wrapped and not short_seq.plane_state(0).is_wrapped
    with pytest.raises(EngineError, match="cache.batch.sequence"):
        cache.engine


def test_batch_rows_finish_apart(model, batch_runs):
    """Row 0 ends at its sixth token (the end-of-sequence id), row 1 runs on: both as transformers' own batch."""
    P, eos = batch_runs["P"], batch_runs["eos"]
    want, got = batch_runs["sdpa_eos"], batch_runs["engine_eos"]
    assert int(want.sequences[0, P + 5]) == eos and want.sequences.shape[1] > P + 6
    _rows_agree(model, want, got, P)
    assert torch.equal(got.sequences[0, P + 6:].cpu(), torch.zeros_like(got.sequences[0, P + 6:].cpu()))


def test_a_batch_each_row_alone(model, batch_runs):
    """Each row's tokens are the ones its prompt gives alone, on a one-sequence MuserCache, where decided."""
    P, rtol = batch_runs["P"], tolerances.model_logit_rtol_f16_planes(_layers_of(model))
    ids, mask = _left_padded(model, batch_runs["lengths"], batch_runs["seeds"])
    b = 0  # the short row (the long one is the teacher run's kind of sequence)
    alone = _attn(model, "muser_ti").generate(ids[b:b + 1, P - batch_runs["lengths"][b]:], **{CACHE: _cache(model)},
                                               max_new_tokens=NEW_BATCH, do_sample=False, output_logits=True,
                                               return_dict_in_generate=True)
    want = batch_runs["sdpa"]
    _same_tokens_until_a_tie(alone.sequences[0, batch_runs["lengths"][b]:].cpu(),
                             batch_runs["engine"].sequences[b, P:].cpu(), torch.stack(want.logits).float().cpu()[:, b],
                             rtol)


def test_batch_refusals_leave_the_cache_as_it_was(model):
    """Right padding, a batch of another size on a cache that holds a batch, beam search: refused naming why."""
    cache = _cache(model)
    ids, mask = _left_padded(model, [10, 6])
    right = mask.flip(-1)
    with pytest.raises(EngineError, match="padded on the left only"):
        _attn(model, "muser_ti")(input_ids=ids, attention_mask=right, **{CACHE: cache})
    assert cache.get_seq_length() == 0 and all(p == 0 for p in cache.batch.positions())
    _attn(model, "muser_ti")(input_ids=ids, attention_mask=mask, **{CACHE: cache})
    assert cache.batch.positions() == [10, 6] and cache.get_seq_length() == 10
    with pytest.raises(EngineError, match=r"holds 2 sequence\(s\) at position 10: a forward of batch size 3"):
        _attn(model, "muser_ti")(input_ids=ids[:1].expand(3, -1), **{CACHE: cache})
    assert cache.batch.positions() == [10, 6]
    with pytest.raises(EngineError, match="beam search"):
        cache.reorder_cache(torch.tensor([1, 0]))
    with pytest.raises(EngineError, match="cannot repeat its sequences 2 times"):
        cache.batch_repeat_interleave(2)


def test_padding_is_refused(model):
    cache = _cache(model)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]], device=model.device)
    with pytest.raises(EngineError, match="padding"):
        _attn(model, "muser_ti")(input_ids=_ids(model, 6), attention_mask=mask, **{CACHE: cache})
    assert cache.get_seq_length() == 0 and cache.engine.open_token is None


def test_a_model_without_muser_attention_is_refused(model):
    cache = _cache(model)
    with pytest.raises(EngineError, match=r"attention did not run through the engine \(build the model with "
                                          r"attn_implementation='muser_ti'"):
        _attn(model, "sdpa")(input_ids=_ids(model, 6), **{CACHE: cache})
    assert cache.get_seq_length() == 0 and cache.engine.open_token is None


def test_without_a_muser_cache_muser_ti_is_sdpa(model):
    ids6 = _ids(model, 6)
    want = _attn(model, "sdpa")(input_ids=ids6, **{CACHE: DynamicCache(config=model.config)}).logits
    got = _attn(model, "muser_ti")(input_ids=ids6, **{CACHE: DynamicCache(config=model.config)}).logits
    assert torch.equal(got, want)


def test_register_is_idempotent():
    assert mt_hf.register() == mt_hf.register() == "muser_ti"
    assert AttentionInterface._global_mapping["muser_ti"] is mt_hf.muser_attention
    assert AttentionMaskInterface._global_mapping["muser_ti"] is sdpa_mask
