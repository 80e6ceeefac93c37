"""Bad input at the public API beyond step(): prefill and rewind are refused with an error naming the
token, layer, head and value where that applies, and the cache (planes, origins, position, route
counts, the serving cache) is exactly as it was, bit for bit.  (step()'s own cases are in
test_engine.py::test_bad_input_is_refused_and_changes_nothing.)"""

import numpy as np
import pytest

import muser_ti as mt
from muser_ti import EngineError
from sessions import GEOMETRIES, Session, geometry, not_on_lavapipe
from test_snapshot import assert_live_equal, live

D64 = GEOMETRIES["gqa4-d64"]


def _at(shape, idx, value):
    def make(a):
        a = a.copy()
        a[idx] = value
        return a
    return make


def _kv(n, cfg, seed=0):
    rng = np.random.default_rng(seed)
    shape = (n, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


PREFILL_CASES = {
    "list": (lambda k, v: (k.tolist(), v), "prefill k: expected a 4-d numpy array"),
    "3-d": (lambda k, v: (k[0], v), "prefill k: expected a 4-d numpy array"),
    "v shape": (lambda k, v: (k, v[:, :, :1]), r"prefill v: shape \(5, 4, 1, 64\), expected \(5, 4, 2, 64\)"),
    "layers": (lambda k, v: (k[:, :3], v[:, :3]), r"prefill k: shape \(5, 3, 2, 64\), expected \(5, 4, 2, 64\)"),
    "int dtype": (lambda k, v: (k.astype(np.int32), v), "prefill k: dtype int32"),
    "complex": (lambda k, v: (k, v.astype(np.complex64)), "prefill v: dtype complex64"),
    "nan": (lambda k, v: (k, _at(v.shape, (3, 1, 0, 9), np.nan)(v)),
            "prefill v: non-finite value nan at token 3, layer 1, kv head 0, d 9"),
    "inf": (lambda k, v: (_at(k.shape, (4, 3, 1, 63), -np.inf)(k), v),
            "prefill k: non-finite value -inf at token 4, layer 3, kv head 1, d 63"),
    "f16 overflow": (lambda k, v: (_at(k.shape, (2, 2, 1, 0), 65520.0)(k), v),
                     "prefill k: value 65520 at token 2, layer 2, kv head 1, d 0 overflows the f16 plane"),
    "f64 overflow": (lambda k, v: (k.astype(np.float64), _at(v.shape, (0, 0, 0, 1), -1e6)(v).astype(np.float64)),
                     "prefill v: value -1e\\+06 at token 0, layer 0, kv head 0, d 1 overflows the f16 plane"),
}


# every refusal is the host's, before any device write: lavapipe runs one, for the planes it reads back unchanged
@pytest.mark.parametrize("case", ["nan", *not_on_lavapipe(*(c for c in PREFILL_CASES if c != "nan"))])
def test_bad_prefill_is_refused_and_changes_nothing(arch, case):
    bad, fragment = PREFILL_CASES[case]
    cfg = geometry(window=16, slack=8, **D64)
    eng = mt.Engine(cfg, arch=arch, pinned="off")
    s = Session(eng, seed=1)
    s.prefill(40)  # the ring has wrapped
    s.step()
    before = live(eng)
    with pytest.raises(EngineError, match=fragment):
        eng.prefill(*bad(*_kv(5, cfg)))
    assert_live_equal(before, live(eng))
    s.prefill(3)
    s.step()  # and the session goes on, checked against the reference


def test_prefill_the_planes_cannot_hold(arch):
    cfg = geometry(window=16, max_context=100, **D64)
    tiny = mt.Engine(cfg, arch=arch, pinned="off", capacity=24)  # NoPE plane: 24 rows at most
    Session(tiny, seed=1).prefill(20)
    before = live(tiny)
    with pytest.raises(EngineError, match="NoPE plane would exceed its capacity of 24 rows with 5 more tokens"):
        tiny.prefill(*_kv(5, cfg))
    assert_live_equal(before, live(tiny))
    small_ring = mt.Engine(cfg, arch=arch, pinned="off", capacity=8)  # a ring smaller than its window
    with pytest.raises(EngineError, match=r"ring of capacity 8 cannot hold the 9 rows its window sees at position 8 "
                                          r"\(the current token included; window 16\); it needs a capacity >= 9, "
                                          r"and 16 \(the window\) once"):
        small_ring.prefill(*_kv(9, cfg))
    assert small_ring.position == 0 and small_ring.planes["swa"].state.len == 0
    eng = mt.Engine(cfg, arch=arch, pinned="off")
    Session(eng, seed=1).prefill(90)
    before = live(eng)
    with pytest.raises(EngineError, match="prefill of 11 tokens at position 90 passes max_context=100"):
        eng.prefill(*_kv(11, cfg))
    assert_live_equal(before, live(eng))


@pytest.mark.parametrize("target, fragment", [
    (1.5, r"rewind to 1.5: expected an integer in \[0, 40\]"),
    ("3", r"rewind to '3': expected an integer"),
    (None, r"rewind to None: expected an integer"),
    (np.float64(2.0), r"rewind to .*2.0.*: expected an integer"),
    (-1, r"rewind to -1: expected an integer in \[0, 40\]"),
    (True, r"rewind to True: expected an integer"),  # bool is an int subclass; refused all the same
    (41, r"rewind to 41: expected an integer in \[0, 40\]"),
    (10, "cannot rewind to 10: the swa plane of capacity 24 no longer holds token 0"),
])
def test_bad_rewind_is_refused_and_changes_nothing(arch, target, fragment):
    cfg = geometry(window=16, slack=8, **D64)
    eng = mt.Engine(cfg, arch=arch, pinned="off")
    s = Session(eng, seed=2)
    s.prefill(39)
    s.step()
    before = live(eng)
    with pytest.raises(EngineError, match=fragment):
        eng.rewind(target)
    assert_live_equal(before, live(eng))
    eng.rewind(np.int64(32))  # numpy integers are integers; 8 back is what the slack allows
    s.truncate(32)
    s.step()


def test_refused_input_leaves_the_serving_cache_alone(arch):
    if not mt.pinned_library_status(arch)[0]:
        pytest.skip(f"the serving graph needs the pinned rung, not loaded for arch {arch}")
    cfg = geometry(window=16, slack=8, **D64)
    eng = mt.Engine(cfg, arch=arch, pinned="on", graph="serving")
    s = Session(eng, seed=3)
    s.prefill(40)
    s.step()
    before = live(eng)
    k, v = _kv(3, cfg)
    v[1, 0, 1, 2] = np.nan
    with pytest.raises(EngineError, match="prefill v: non-finite value nan at token 1, layer 0, kv head 1, d 2"):
        eng.prefill(k, v)
    q, k1, v1 = s.token()
    k1[3, 0, 5] = 1e5
    with pytest.raises(EngineError, match="k: value 100000 at layer 3, kv head 0, d 5 overflows"):
        eng.step(q, k1, v1)
    with pytest.raises(EngineError, match="cannot rewind to 20"):
        eng.rewind(20)
    assert_live_equal(before, live(eng))
    s.step()


def test_reference_before_any_step_says_so(arch):
    eng = mt.Engine(geometry(**D64), arch=arch, pinned="off")
    Session(eng, seed=1).prefill(5)
    q = np.ones((eng.cfg.n_layers, eng.cfg.n_heads, eng.cfg.head_dim), np.float32)
    with pytest.raises(EngineError, match=r"reference\(\): no step has run yet"):
        eng.reference(q)
