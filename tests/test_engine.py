"""Engine behaviour: rewind exactness, the current-token bypass, launch counts, refused input, modes."""

from collections import Counter

import numpy as np
import pytest
import taichi as ti

import muser_ti as mt
from muser_ti import EngineError, PinnedUnavailable, RouteError, ladder
from muser_ti.reference import relative_error
from muser_ti.tolerances import F16_OUTPUT_RTOL, F32_ROUTE_RTOL
from sessions import GEOMETRIES, Session, geometry, not_on_lavapipe, token_stream as stream


def assert_unchanged(before, after):
    assert before.keys() == after.keys()
    for kind in before:
        assert before[kind][2] == after[kind][2], kind
        np.testing.assert_array_equal(before[kind][0], after[kind][0])
        np.testing.assert_array_equal(before[kind][1], after[kind][1])


# Glimmer's group shape and a small one (the GPU producer's two tiles); lavapipe runs the small one
@pytest.mark.parametrize("geom", ["gqa4-d64", *not_on_lavapipe("gqa16-d128")])
def test_rewind_reproduces_a_session_that_never_saw_the_dropped_tokens(arch, geom):
    cfg = geometry(window=48, slack=16, **GEOMETRIES[geom])
    kept, dropped, after = stream(cfg, 70, 1), stream(cfg, 9, 2), stream(cfg, 12, 3)
    a, b = mt.Engine(cfg, arch=arch, pinned="off"), mt.Engine(cfg, arch=arch, pinned="off")
    k = np.stack([tok[1] for tok in kept[:62]])
    v = np.stack([tok[2] for tok in kept[:62]])
    for eng in (a, b):  # the 64-row ring (48 + 16 slack) fills by prefill, wraps by steps
        eng.prefill(k, v)
        for tok in kept[62:]:
            eng.step(*tok)
    for tok in dropped:  # speculative tokens, then rolled back: the rings are left partially wrapped
        a.step(*tok)
    a.rewind(len(kept))
    assert a.planes["swa"].state.is_partially_wrapped
    for tok in after:
        np.testing.assert_array_equal(a.step(*tok), b.step(*tok))  # bit for bit
    assert a.routes == b.routes


def test_current_token_bypass(arch):
    """The interleaved route attends the current token as f32 activations, never its f16 plane copy."""
    cfg = geometry(window=64, **GEOMETRIES["gqa4-d64"])
    eng = mt.Engine(cfg, arch=arch, pinned="off")
    s = Session(eng, seed=11)
    s.prefill(20)
    q, k, v = s.token()
    # k/v of the current token: values f16 cannot represent (1 + 2^-13 rounds to 1.0), and a query aimed
    # at it so the current token carries nearly all the weight.
    k[:] = np.float32(1.0 + 2.0 ** -13)
    v[:] = np.float32(1.0 + 3 * 2.0 ** -13)
    assert np.float16(v[0, 0, 0]) != v[0, 0, 0]
    q[:] = 4.0
    out = eng.step(q, k, v)
    nope, swa = cfg.nope_layers[0], cfg.swa_layers[0]
    assert eng.routes[nope] == ladder.INTERLEAVED and eng.routes[swa] == ladder.SPLITK
    bypass_ref = eng.reference(q, k, v)  # interleaved layers: current token from the f32 activations
    stored_ref = eng.reference(q, routes=[ladder.SPLITK if r == ladder.INTERLEAVED else r for r in eng.routes])
    assert relative_error(out[nope], bypass_ref[nope]) <= F32_ROUTE_RTOL
    gap = relative_error(out[nope], stored_ref[nope])
    assert gap > 10 * F32_ROUTE_RTOL, f"bypass indistinguishable from store-then-read (gap {gap:.2e})"
    # splitk stores first and reads the f16 row back: it matches the store-then-read reference
    assert relative_error(out[swa], stored_ref[swa]) <= F32_ROUTE_RTOL
    # and the fused store did write the f16 row into the plane
    kp, _, st, _ = eng.plane_rows(nope)
    np.testing.assert_array_equal(kp[:, st.physical(eng.position - 1)], k[nope].astype(np.float16))


def test_f16_output_reducer_is_the_f32_result_rounded(arch):
    cfg = geometry(window=64, **GEOMETRIES["gqa4-d64"])
    eng = mt.Engine(cfg, arch=arch, pinned="off")
    s = Session(eng, seed=12)
    s.prefill(100)
    q, k, v = s.token()
    out32 = eng.step(q, k, v)
    from muser_ti.kernels.common import on_gpu
    from muser_ti.kernels.splitk import build_splitk
    reduce_f16 = build_splitk(cfg.head_dim, cfg.heads_per_kv, cfg.n_kv_heads, cfg.n_heads, on_gpu())[2]
    # Re-run splitk over the SWA layers (the plane already holds this token) with the f16 reducer.
    swa = cfg.swa_layers
    out16 = ti.ndarray(ti.f16, (cfg.n_layers, cfg.n_heads, cfg.head_dim))
    launcher = eng.launcher
    k_dev, v_dev = launcher.upload(q, k, v)
    launcher.run_producer(launcher.splitk, reduce_f16, "swa", swa, eng.planes["swa"].state, eng.position - 1, k_dev,
                          v_dev, out16)
    got = out16.to_numpy()[list(swa)]
    np.testing.assert_array_equal(got, out32[list(swa)].astype(np.float16))
    assert relative_error(got, eng.reference(q, k, v)[list(swa)]) <= F16_OUTPUT_RTOL


def test_launches_per_token_do_not_grow_with_layers(arch):
    counts = []
    for n_layers in (4, 16):
        cfg = geometry(window=64, n_layers=n_layers, **GEOMETRIES["gqa4-d64"])
        s = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=3)
        s.prefill(80)
        s.step(check=False)
        counts.append(s.eng.launches_last_step)
    # CUDA, Vulkan: the step is one dispatch (kernels/one_dispatch.py); elsewhere store + splitk producer + reduce,
    # interleaved producer (fused store) + reduce_v2.  Where host copies go through Taichi (Vulkan, Metal)
    # one more: the kernel that takes q/k/v up packed (engine.py says why).  Written from the arch, not
    # from the engine's own attributes, so an engine that lost its one dispatch fails here
    expected = {"cpu": 5, "cuda": 1, "vulkan": 1 + 1, "metal": 5 + 1}[arch]
    assert counts == [expected] * 2


@pytest.mark.parametrize("bad, fragment", [
    (lambda q, k, v: (q[:-1], k, v), "q: shape"),
    (lambda q, k, v: (q, k.astype(np.int32), v), "k: dtype int32"),
    (lambda q, k, v: (q, k, np.where(np.arange(v.size).reshape(v.shape) == 77, np.nan, v)), "v: non-finite value nan at layer 0, kv head 1, d 13"),
    (lambda q, k, v: (np.where(np.arange(q.size).reshape(q.shape) == 5, np.inf, q), k, v), "q: non-finite value inf at layer 0, head 0, d 5"),
    (lambda q, k, v: (q, np.where(np.arange(k.size).reshape(k.shape) == 2 * 128 + 64 + 7, 7e4, k), v),
     "k: value 70000 at layer 2, kv head 1, d 7 overflows the f16 plane"),
    (lambda q, k, v: (list(q), k, v), "expected a numpy array"),
])
def test_bad_input_is_refused_and_changes_nothing(arch, bad, fragment):
    cfg = geometry(window=64, **GEOMETRIES["gqa4-d64"])
    s = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=4)
    s.prefill(70)
    s.step()
    before, pos, counts = s.eng.planes_snapshot(), s.eng.position, dict(s.eng.route_counts)
    with pytest.raises(EngineError) as info:
        s.eng.step(*bad(*s.token()))
    assert fragment in str(info.value)
    assert_unchanged(before, s.eng.planes_snapshot())
    assert s.eng.position == pos and dict(s.eng.route_counts) == counts
    s.step()  # and the session goes on


def test_position_limits(arch):
    cfg = geometry(window=8, max_context=40, **GEOMETRIES["gqa4-d64"])
    s = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=8)
    with pytest.raises(EngineError, match="passes max_context=40"):
        s.prefill(41)
    s.prefill(39)
    s.step()
    with pytest.raises(EngineError, match="past max_context=40"):
        s.step()
    with pytest.raises(EngineError, match=r"rewind to 41: expected an integer in \[0, 40\]"):
        s.eng.rewind(41)


def test_forced_routes(arch):
    cfg = geometry(window=64, **GEOMETRIES["gqa4-d64"])
    eng = mt.Engine(cfg, arch=arch, pinned="off", force="splitk")
    s = Session(eng, seed=9)
    s.step()
    assert eng.routes == ["splitk", "splitk", "splitk", "interleaved"]
    with pytest.raises(RouteError, match="serves swa layers; layer 3 is nope"):
        Session(mt.Engine(cfg, arch=arch, pinned="off", force={3: "splitk"})).step()
    forced = mt.Engine(cfg, arch=arch, pinned="off", force="llama_vec_swa")
    s = Session(forced, seed=9)
    with pytest.raises(RouteError, match="'llama_vec_swa' forced on layer 0 but its predicate fails"):
        s.step()
    assert forced.position == 0 and forced.planes["swa"].state.len == 0


def test_pinned_modes_without_the_library(arch, monkeypatch):
    """With no pinned library (simulated here, so the test means the same on every machine)."""
    from muser_ti.pinned import llama_rung

    monkeypatch.setattr(llama_rung, "pinned_status", lambda arch: (False, "simulated: not installed"))
    cfg = geometry(window=64, **GEOMETRIES["gqa4-d64"])
    with pytest.raises(PinnedUnavailable, match="pinned='on' but the pinned library is not loaded: simulated"):
        mt.Engine(cfg, arch=arch, pinned="on")
    with pytest.raises(PinnedUnavailable, match="graph='serving'"):
        mt.Engine(cfg, arch=arch, graph="serving")
    with pytest.raises(EngineError, match="pinned="):
        mt.Engine(cfg, arch=arch, pinned="maybe")
    eng = mt.Engine(cfg, arch=arch)  # auto: falls to the project's kernels
    assert not eng.pinned_loaded and eng.pinned_description == "simulated: not installed"
    s = Session(eng, seed=10)
    s.step()
    # The cross-vendor switch turns the vec clause on without a library: the ladder picks the vec
    # routes, which cannot be dispatched, so the token is refused before anything is written.
    monkeypatch.setenv(ladder.STRICT_ENV, "1")
    before = eng.planes_snapshot()
    with pytest.raises(PinnedUnavailable, match="llama_vec_nope"):
        s.step()
    assert_unchanged(before, eng.planes_snapshot())
    monkeypatch.delenv(ladder.STRICT_ENV)
    s.step()
    assert eng.route_counts == {"splitk": 6, "interleaved": 2}


@pytest.mark.parametrize("force", [None, {0: ladder.SPLITK}], ids=["ladder", "forced"])
def test_route_counts_sum_the_routes_of_every_accepted_step(arch, force):
    """route_counts is kept per route mix and summed when read: it must equal the per-layer tally of
    every accepted step's routes, skip a refused token, survive assignment (snapshot restore) and not
    be changed by editing what a read returned."""
    cfg = geometry(window=16)
    s = Session(mt.Engine(cfg, arch=arch, force=force), seed=12)
    expected = Counter()
    for _ in range(20):  # the SWA ring wraps at 16: the ladder sees full and wrapped planes
        s.step()
        expected.update(s.eng.routes)
    assert s.eng.route_counts == expected and sum(expected.values()) == 20 * cfg.n_layers
    q, k, v = s.token()
    k[0, 0, 0] = np.nan
    with pytest.raises(EngineError):
        s.eng.step(q, k, v)
    assert s.eng.route_counts == expected
    read = s.eng.route_counts
    read[ladder.SPLITK] += 1000
    assert s.eng.route_counts == expected
    s.eng.route_counts = {ladder.SPLITK: 3}
    s.step()
    assert s.eng.route_counts == Counter({ladder.SPLITK: 3}) + Counter(s.eng.routes)
