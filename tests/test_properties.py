"""Property tests (hypothesis): random geometries, random token streams with rewinds, snapshots and
restores; every step against the float64 reference; the ladder's choice against an independent
statement of the chapter's predicates; no NaN ever leaves a tiny session.

Geometries draw head ratios and head_dim from the combinations the rest of the suite already
compiles (a new (head_dim, heads_per_kv, n_kv) costs a 30-55 s kernel compile on the CPU the first
time), and windows, slack, layer patterns, plane capacities (including below 32) and max_context
freely.  Example counts are modest so the default run stays short; ``-m slow`` runs a longer sweep.
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import muser_ti as mt
from muser_ti import EngineError, ladder
from muser_ti.planes import PlaneState
from sessions import DISTRIBUTIONS, GEOMETRIES, Session, geometry
from test_snapshot import assert_live_equal, live

HEADS = ["gqa4-d64", "gqa4-d64", "gqa4-d64", "gqa16-d128", "mha-d256"]  # d64 mostly: cheap and already compiled
EXAMPLES = {"cpu": 40, "vulkan": 6}  # per arch; lavapipe is slow
SLOW_EXAMPLES = 200


def derandomized(arch) -> bool:
    """The same examples every run off the CPU: each drawn geometry (window, layer pattern) is a new one-dispatch
    step kernel to compile there, minutes on lavapipe for a run whose draws are all new, seconds for one whose
    kernels are in the cache.  The CPU's kernels depend on the head shape alone, so it draws afresh every run."""
    return arch != "cpu"


def examples(arch, slow=False):
    return SLOW_EXAMPLES if slow else EXAMPLES.get(arch, 6)


# ---- the ladder, stated independently of muser_ti.ladder ---------------------------------------------
def expected_route(kind: str, len_: int, capacity: int, origin_physical: int, pinned: bool, strict: bool) -> str:
    """Chapter §16.0 in one place: the vec kernel may read a plane iff a library (or the strict switch)
    is there, the plane holds something, has at least one 32-row block of allocation, and its rows are
    one contiguous span (never wrapped, or wrapped but full); SWA additionally needs whole 32-row blocks."""
    contiguous = origin_physical == 0 or len_ == capacity
    rows_ok = (pinned or strict) and len_ >= 1 and capacity >= 32 and contiguous
    if kind == "swa":
        return "llama_vec_swa" if rows_ok and len_ % 32 == 0 else "splitk"
    return "llama_vec_nope" if rows_ok else "interleaved"


@st.composite
def plane_states(draw):
    capacity = draw(st.integers(1, 300))
    len_ = draw(st.integers(0, capacity))
    origin_physical = draw(st.integers(0, capacity - 1))
    origin_logical = draw(st.integers(0, 10**6))
    return PlaneState(len=len_, capacity=capacity, origin_logical=origin_logical, origin_physical=origin_physical)


@settings(max_examples=2000, deadline=None)
@given(kind=st.sampled_from(["swa", "nope"]), plane=plane_states(), pinned=st.booleans(), strict=st.booleans())
def test_ladder_matches_an_independent_statement(kind, plane, pinned, strict):
    want = expected_route(kind, plane.len, plane.capacity, plane.origin_physical, pinned, strict)
    assert ladder.choose_route(kind, plane, pinned, strict) == want
    assert ladder.select(kind, plane, pinned, strict, None, 0) == want
    vec = "llama_vec_swa" if kind == "swa" else "llama_vec_nope"
    own = "splitk" if kind == "swa" else "interleaved"
    assert ladder.route_allowed(vec, kind, plane, pinned, strict) == (want == vec)
    assert ladder.route_allowed(own, kind, plane, pinned, strict)
    if want != vec:
        with pytest.raises(ladder.RouteError, match="predicate fails"):
            ladder.select(kind, plane, pinned, strict, vec, 0)


# ---- random sessions -----------------------------------------------------------------------------
@st.composite
def sessions(draw, arch, tiny=False, pinned=None):
    heads = GEOMETRIES[draw(st.sampled_from(HEADS))]
    n_layers = draw(st.integers(1, 4))
    pattern = draw(st.lists(st.sampled_from(["swa", "nope"]), min_size=1, max_size=3))
    window = draw(st.sampled_from([1, 2, 5, 16, 31, 32, 33, 40, 48, 64]) if not tiny else st.integers(1, 31))
    if tiny or draw(st.booleans()):  # a per-session capacity, below 32 for a "deliberately tiny" session
        capacity = draw(st.integers(max(window, 1), 31 if (tiny or window <= 31) else window + 10))
    else:
        capacity = None
    max_context = draw(st.one_of(st.sampled_from([400, 257, 160]), st.integers(window, 400)))
    slack = draw(st.integers(0, min(20, max_context)))
    cfg = geometry(**heads, window=window, slack=slack, n_layers=n_layers, pattern=tuple(pattern),
                   max_context=max_context)
    if pinned is None:
        pinned = draw(st.sampled_from(["off", "on"])) if mt.pinned_library_status(arch)[0] else "off"
    graph = draw(st.sampled_from(["teacher", "serving"])) if pinned == "on" and cfg.swa_layers else "teacher"
    # (sessions.Session aims "peaked"/"sink" queries at a past token inside the window; with window 1
    # there is none, so those two need window >= 2)
    # The pinned CPU rung is llama.cpp's ggml kernel, which accumulates V in f16: with |V| near the f16
    # range a sum of a few rows overflows to inf (llama.cpp's own behaviour, so test_llama_rung.py leaves
    # "large" out too); tiny sessions never reach that rung, so they keep "large".
    dists = [d for d in DISTRIBUTIONS if (window > 1 or d in ("normal", "large"))
             and (d != "large" or pinned == "off" or tiny)]
    dist = draw(st.sampled_from(dists))
    first = [("prefill", draw(st.integers(0, 150)))]  # reach wrapped and grown planes early
    ops = first + draw(st.lists(st.one_of(
        st.tuples(st.just("step"), st.integers(1, 6)),
        st.tuples(st.just("step"), st.integers(7, 40)),
        st.tuples(st.just("prefill"), st.integers(0, 40)),
        st.tuples(st.just("rewind"), st.integers(0, 24)),
        st.tuples(st.just("save"), st.just(0)),
        st.tuples(st.just("restore"), st.just(0)),
    ), min_size=1, max_size=14))
    return dict(cfg=cfg, capacity=capacity, pinned=pinned, graph=graph, dist=dist, ops=ops,
                seed=draw(st.integers(0, 2**31)))


class Driver:
    """Applies ops; checks every step against the reference and the ladder, refusals against the
    rules, and restores by replaying what was done since the save, bit for bit."""

    def __init__(self, eng, spec, path):
        self.eng, self.cfg, self.path = eng, eng.cfg, path
        self.s = Session(eng, seed=spec["seed"], dist=spec["dist"])
        self.log = None  # ops since the last save: (op, inputs, output)
        self.saved = None

    def planes(self):
        return {kind: ps.state for kind, ps in self.eng.planes.items()}

    def step(self, q=None, k=None, v=None):
        eng, cfg = self.eng, self.cfg
        if q is None:
            q, k, v = self.s.token()
        p = eng.position
        before = live(eng)
        nope = eng.planes.get("nope")
        must_refuse = p >= cfg.max_context or (nope is not None and nope.state.len + 1 > nope.cap)
        try:
            out = eng.step(q, k, v)
        except EngineError:
            assert must_refuse, f"step at {p} refused though the planes can take it"
            assert_live_equal(before, live(eng))
            return (q, k, v), None
        assert not must_refuse, f"step at {p} accepted past the limits"
        assert np.isfinite(out).all(), "a NaN or Inf left the engine"
        # the ladder, evaluated on the planes after the append, against the independent statement
        strict = ladder.strict_attention()
        for layer, kind in enumerate(cfg.layer_kinds):
            st_ = eng.planes[kind].state
            assert eng.routes[layer] == expected_route(kind, st_.len, st_.capacity, st_.origin_physical,
                                                       eng.pinned_loaded, strict), (layer, st_)
        self.s.record(k, v)
        self.s.verify(out, q, k, v)
        return (q, k, v), out

    def prefill(self, n, kv=None):
        eng, cfg = self.eng, self.cfg
        if kv is None:
            kv = self.s.rows(n)
        n = len(kv[0])
        before = live(eng)
        nope = eng.planes.get("nope")
        must_refuse = n and (eng.position + n > cfg.max_context or (nope is not None and nope.state.len + n > nope.cap))
        try:
            eng.prefill(*kv)
        except EngineError:
            assert must_refuse, "prefill refused though the planes can take it"
            assert_live_equal(before, live(eng))
            return kv, False
        assert not must_refuse, "prefill accepted past the limits"
        self.s.record_rows(*kv)
        return kv, True

    def rewind(self, target):
        eng, cfg = self.eng, self.cfg
        before = live(eng)
        swa = eng.planes.get("swa")
        # A ring holds tokens [origin_logical, position); the next token at target needs
        # [max(0, target + 1 - window), target) of them.  NoPE planes hold everything.
        must_refuse = swa is not None and swa.state.origin_logical > max(0, target + 1 - cfg.window)
        try:
            eng.rewind(target)
        except EngineError:
            assert must_refuse, f"rewind to {target} refused though the rings hold what it needs"
            assert_live_equal(before, live(eng))
            return False
        assert not must_refuse, f"rewind to {target} accepted though a ring evicted what it needs"
        self.s.truncate(target)
        return True

    def run(self, ops):
        for op, arg in ops:
            if op == "step":
                for _ in range(arg):
                    inputs, out = self.step()
                    self._record("step", inputs, out)
            elif op == "prefill":
                kv, ok = self.prefill(arg)
                self._record("prefill", kv, ok)
            elif op == "rewind":
                target = max(0, self.eng.position - arg)
                self._record("rewind", target, self.rewind(target))
            elif op == "save":
                self.eng.save(self.path)
                # the record itself, not its length: a rewind below the save point and a step after it
                # replace what the record held there, and the restore must bring that back
                self.saved = (live(self.eng), list(self.s.history_k), list(self.s.history_v))
                self.log = []
            elif op == "restore" and self.log is not None:
                self.restore_and_replay()

    def _record(self, op, inputs, result):
        if self.log is not None:
            self.log.append((op, inputs, result))

    def restore_and_replay(self):
        now = live(self.eng)
        saved_live, history_k, history_v = self.saved
        self.eng.load(self.path)
        assert_live_equal(saved_live, live(self.eng), loaded=self.eng)
        self.s.history_k, self.s.history_v = list(history_k), list(history_v)
        log, self.log = self.log, None
        for op, inputs, result in log:
            if op == "step":
                _, out = self.step(*inputs)
                if result is None:
                    assert out is None
                else:
                    np.testing.assert_array_equal(out, result)  # bit for bit
            elif op == "prefill":
                assert self.prefill(None, inputs)[1] == result
            else:
                assert self.rewind(inputs) == result
        self.log = log  # the save still stands
        assert_live_equal(now, live(self.eng), loaded=self.eng)


def _run_session(arch, spec, tmp_path, strict=False):
    eng = mt.Engine(spec["cfg"], arch=arch, pinned=spec["pinned"], graph=spec["graph"], capacity=spec["capacity"])
    old = os.environ.pop(ladder.STRICT_ENV, None)
    if strict:
        os.environ[ladder.STRICT_ENV] = "1"
    try:
        Driver(eng, spec, tmp_path / "session.safetensors").run(spec["ops"])
    finally:
        os.environ.pop(ladder.STRICT_ENV, None)
        if old is not None:
            os.environ[ladder.STRICT_ENV] = old
    return eng


def _sessions_test(arch, tmp_path, n, pinned):
    if pinned == "on" and not mt.pinned_library_status(arch)[0]:
        pytest.skip(f"the pinned rung is not loaded for arch {arch}: {mt.pinned_library_status(arch)[1]}")

    @settings(max_examples=n, deadline=None, derandomize=derandomized(arch),
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(spec=sessions(arch, pinned=pinned))
    def check(spec):
        _run_session(arch, spec, tmp_path)
    check()


@pytest.mark.parametrize("pinned", ["off", "on"], ids=["own-routes", "pinned-rung"])
def test_random_sessions_match_the_reference_and_resume_bit_for_bit(arch, tmp_path, pinned):
    _sessions_test(arch, tmp_path, examples(arch), pinned)


def test_the_large_input_session_that_passed_the_f32_bound(arch, tmp_path):
    """Pinned: the session hypothesis found on the H200 (run 10) whose f32 score rounding on "large"
    inputs passed 1e-5 on every backend (1.01-1.11e-5; tolerances.F32_ROUTE_RTOL_LARGE says why).  It
    must stay within the large-input bound, and it is replayed every run, not left to chance."""
    cfg = mt.geometry_from_dict(dict(name="test", n_heads=2, n_kv_heads=2, head_dim=256, n_layers=1,
                                     layer_pattern=["swa"], window=31, max_context=400, attention_scale=0.0625))
    spec = {"cfg": cfg, "capacity": None, "pinned": "off", "graph": "teacher", "dist": "large", "seed": 800,
            "ops": [("prefill", 111)] + [("step", 1)] * 5 + [("step", 27)]}
    eng = _run_session(arch, spec, tmp_path)
    assert eng.position == 111 + 5 + 27

@pytest.mark.slow
@pytest.mark.parametrize("pinned", ["off", "on"], ids=["own-routes", "pinned-rung"])
def test_random_sessions_long(arch, tmp_path, pinned):
    _sessions_test(arch, tmp_path, examples(arch, slow=True), pinned)


def test_no_nan_ever_leaves_a_tiny_session(arch, tmp_path):
    """§16.0's tiny-session case: a plane allocated below 32 rows would let a 32-row-block reader run
    past its end and poison the whole distribution with NaNs.  With the library loaded (CPU) and even
    with the strict cross-vendor switch set, the ladder keeps such planes on the project's kernels,
    and every output stays finite, for every distribution including K/V near the f16 range."""
    @settings(max_examples=examples(arch), deadline=None, derandomize=derandomized(arch),
              suppress_health_check=[HealthCheck.too_slow])
    @given(spec=sessions(arch, tiny=True), strict=st.booleans())
    def check(spec, strict):
        assume(spec["capacity"] is not None and spec["capacity"] < 32)
        eng = _run_session(arch, spec, tmp_path, strict=strict)
        assert set(eng.route_counts) <= {"splitk", "interleaved"}, eng.route_counts
    check()
