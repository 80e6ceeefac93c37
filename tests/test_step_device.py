"""Engine.step_device: the activations stay on the device; results, refusals and state match step()."""

import numpy as np
import pytest
import taichi as ti

import muser_ti as mt
from muser_ti import EngineError
from sessions import DISTRIBUTIONS, GEOMETRIES, Session, covering_product, geometry


def device_arrays(*host):
    out = []
    for a in host:
        dev = ti.ndarray(ti.f32, a.shape)
        dev.from_numpy(a)
        out.append(dev)
    return out


def assert_same_state(a: mt.Engine, b: mt.Engine):
    assert a.position == b.position and a.routes == b.routes
    for kind, (k, v, st) in a.planes_snapshot().items():
        k2, v2, st2 = b.planes_snapshot()[kind]
        assert st == st2, kind
        np.testing.assert_array_equal(k, k2)
        np.testing.assert_array_equal(v, v2)


def assert_cache_as_it_was(eng: mt.Engine, before: dict, pos: int):
    """After a refused token: every plane, its state and the position as ``before`` (planes_snapshot)."""
    after = eng.planes_snapshot()
    for kind in before:
        assert before[kind][2] == after[kind][2]
        np.testing.assert_array_equal(before[kind][0], after[kind][0])
        np.testing.assert_array_equal(before[kind][1], after[kind][1])
    assert eng.position == pos

# the geometries: the GPU producer's tiles and index paths; the distributions: the kernels' numerics; lavapipe runs a
# covering set (each geometry and each distribution once)
@pytest.mark.parametrize("geom, dist", covering_product(list(GEOMETRIES), DISTRIBUTIONS))
def test_step_device_gives_steps_bits(arch, geom, dist):
    """Two engines, one token stream: step() with numpy, step_device() with ndarrays, through the ring's
    wrap and a NoPE plane growth; the caller's buffers alternate between two sets, as a double-buffered
    decoder's would (the step graph is keyed by their shapes, so both sets replay the same graph)."""
    cfg = geometry(window=48, **GEOMETRIES[geom])
    host = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=5, dist=dist)
    dev = mt.Engine(cfg, arch=arch, pinned="off")
    host.prefill(44, also=dev)
    shapes = [(cfg.n_layers, cfg.n_heads, cfg.head_dim), (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)]
    buffers = [[ti.ndarray(ti.f32, s) for s in (shapes[0], shapes[1], shapes[1], shapes[0])] for _ in range(2)]
    for t in range(22):  # the 48-row ring wraps at 48, the NoPE plane grows at 64
        q, k, v = host.token()
        expected = host.eng.step(q, k, v)
        host.record(k, v)
        host.verify(expected, q, k, v)
        qd, kd, vd, out = buffers[t % 2]
        qd.from_numpy(q), kd.from_numpy(k), vd.from_numpy(v)
        out.fill(float("nan"))
        assert dev.step_device(qd, kd, vd, out) is out
        np.testing.assert_array_equal(out.to_numpy(), expected, err_msg=f"token {t}")
    assert_same_state(host.eng, dev)
    assert dev.planes["swa"].state.origin_logical > 0 and dev.planes["nope"].state.capacity > 64  # wrapped, grew


@pytest.mark.parametrize("geom, pattern", [(g, ("swa", "swa", "swa", "nope")) for g in GEOMETRIES] +
                         [("gqa4-d64", ("swa", "nope"))])  # as many layers in each class: one partials buffer each
def test_one_dispatch_step_gives_the_graph_routes_bits(arch, geom, pattern):
    """The one-dispatch step (CUDA, Vulkan) against the same kernels launched one by one through the step
    graph, on the same tokens, through the ring's wrap and NoPE plane growth (a growing step takes the
    graph route): the same output bits, the same planes, step() and step_device() alike."""
    if arch not in ("cuda", "vulkan"):
        pytest.skip(f"the one-dispatch step is a CUDA/Vulkan path; {arch} takes the route-by-route one")
    probe = mt.Engine(geometry(**GEOMETRIES[geom]), arch=arch, pinned="off")
    assert probe.one_dispatch_step, f"{arch} lost the one-dispatch step for {geom}"
    cfg = geometry(window=48, pattern=pattern, **GEOMETRIES[geom])
    one = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=21, dist="peaked")
    graph = mt.Engine(cfg, arch=arch, pinned="off")
    graph.launcher.step_kernel = None  # every step through the graph route
    one.prefill(40, also=graph)
    out = ti.ndarray(ti.f32, (cfg.n_layers, cfg.n_heads, cfg.head_dim))
    grew = 0
    for t in range(30):
        q, k, v = one.token()
        nope = one.eng.planes["nope"]
        grows = nope.check_append(one.eng.position).capacity != nope.state.capacity
        grew += grows
        if t % 2:
            one.eng.step_device(*device_arrays(q, k, v), out)
            got = out.to_numpy()
        else:
            got = one.eng.step(q, k, v)
        assert (one.eng.launches_last_step <= 2) != grows, t  # one dispatch (and the packed upload) unless it grew
        np.testing.assert_array_equal(got, graph.step(q, k, v), err_msg=f"token {t}")
        one.record(k, v)
        one.verify(got, q, k, v)  # and both right, not only alike
    assert_same_state(one.eng, graph)
    assert one.eng.planes["swa"].state.origin_logical > 0 and grew  # wrapped, grew


@pytest.mark.parametrize("bad, fragment", [
    (lambda q, k, v: (q, k, np.where(np.arange(v.size).reshape(v.shape) == 77, np.nan, v)),
     "v: non-finite value nan at layer 0, kv head 1, d 13"),
    (lambda q, k, v: (np.where(np.arange(q.size).reshape(q.shape) == 5, -np.inf, q), k, v),
     "q: non-finite value -inf at layer 0, head 0, d 5"),
    (lambda q, k, v: (q, np.where(np.arange(k.size).reshape(k.shape) == 130, np.inf, k), v),
     "k: non-finite value inf at layer 1, kv head 0, d 2"),
    (lambda q, k, v: (q, np.where(np.arange(k.size).reshape(k.shape) == 2 * 128 + 64 + 7, 7e4, k), v),
     "k: value 70000 at layer 2, kv head 1, d 7 overflows the f16 plane"),
    (lambda q, k, v: (q, k, np.where(np.arange(v.size).reshape(v.shape) == 300, -65520.0, v)),
     "v: value -65520 at layer 2, kv head 0, d 44 overflows the f16 plane"),
])
def test_bad_device_token_is_refused_as_step_refuses_it(arch, bad, fragment):
    cfg = geometry(window=64, **GEOMETRIES["gqa4-d64"])
    s = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=4)
    s.prefill(70)
    s.step()
    before, pos = s.eng.planes_snapshot(), s.eng.position
    q, k, v = bad(*s.token())
    out = ti.ndarray(ti.f32, q.shape)
    out.fill(7.0)
    with pytest.raises(EngineError) as info:
        s.eng.step_device(*device_arrays(q, k, v), out)
    assert fragment in str(info.value)
    assert_cache_as_it_was(s.eng, before, pos)
    assert (out.to_numpy() == 7.0).all()  # the one-dispatch step's reducers ask the scan's flags too
    # a value at the edge of the f16 range is accepted, and the session goes on
    q, k, v = s.token()
    k[0, 0, 0], v[1, 1, 1] = 65504.0, -65504.0
    q *= 1e-3  # so the score of that key stays modest: the check is the f16 range, not the softmax's
    s.eng.step_device(*device_arrays(q, k, v), out)
    assert s.eng.position == pos + 1
    s.record(k, v)
    s.verify(out.to_numpy(), q, k, v)


@pytest.mark.parametrize("prefilled, grows", [(64, True), (65, False)])
def test_bad_device_token_leaves_the_cache_whether_or_not_the_step_grows_a_plane(arch, prefilled, grows):
    """A bad token is refused with the planes, their capacity and the position unchanged, on a step that
    would grow the NoPE plane as on one that would not; the token made good then goes through.  (Both
    rows are bad.  On CUDA and Vulkan the step that grows scans first and takes the graph route, where
    the NoPE row is the producer's fused store and the SWA row store_token's; the other is the one
    dispatch, whose store task asks the scan's flags.)"""
    cfg = geometry(window=64, **GEOMETRIES["gqa4-d64"])
    s = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=9)
    s.prefill(prefilled)
    nope = s.eng.planes["nope"]
    assert (nope.check_append(prefilled).capacity != nope.state.capacity) == grows
    before, pos = s.eng.planes_snapshot(), s.eng.position
    q, k, v = s.token()
    k[3, 1, 5] = np.nan  # layer 3 is the NoPE layer
    v[0, 0, 9] = 7e4  # layer 0 is SWA
    out = ti.ndarray(ti.f32, q.shape)
    with pytest.raises(EngineError, match="k: non-finite value nan at layer 3, kv head 1, d 5"):
        s.eng.step_device(*device_arrays(q, k, v), out)
    assert_cache_as_it_was(s.eng, before, pos)
    k[3, 1, 5], v[0, 0, 9] = 0.5, -0.5
    s.eng.step_device(*device_arrays(q, k, v), out)
    s.record(k, v)
    s.verify(out.to_numpy(), q, k, v)
    assert s.eng.position == pos + 1 and (s.eng.planes["nope"].state.capacity > before["nope"][2].capacity) == grows


def test_step_device_refuses_what_is_not_a_float32_ndarray_of_the_shape(arch):
    cfg = geometry(window=64, **GEOMETRIES["gqa4-d64"])
    eng = mt.Engine(cfg, arch=arch, pinned="off")
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, k, v, out = (ti.ndarray(ti.f32, s) for s in ((L, H, D), (L, KV, D), (L, KV, D), (L, H, D)))
    cases = [
        ((q.to_numpy(), k, v, out), "step_device q: expected a Taichi float32 ndarray of shape (4, 8, 64), got ndarray"),
        ((q, ti.ndarray(ti.f32, (L, KV, D + 1)), v, out), "step_device k: expected a Taichi float32 ndarray of shape "
                                                         "(4, 2, 64), got f32 ndarray of shape (4, 2, 65)"),
        ((q, k, ti.ndarray(ti.f16, (L, KV, D)), out), "step_device v: expected a Taichi float32 ndarray of shape "
                                                      "(4, 2, 64), got f16 ndarray of shape (4, 2, 64)"),
        ((q, k, v, ti.ndarray(ti.f32, (L, KV, D))), "step_device out: expected"),
    ]
    for args, fragment in cases:
        with pytest.raises(EngineError) as info:
            eng.step_device(*args)
        assert fragment in str(info.value)
    assert eng.position == 0


def test_step_device_with_a_mirror_takes_the_host_path_and_the_same_bits(arch):
    """Mirror planes are written from host rows: step_device copies the token there, with step()'s result."""
    cfg = geometry(window=32, **GEOMETRIES["gqa4-d64"])
    a = Session(mt.Engine(cfg, arch=arch, pinned="off", mirror="host"), seed=9)
    b = mt.Engine(cfg, arch=arch, pinned="off", mirror="host")
    a.prefill(30, also=b)
    out = ti.ndarray(ti.f32, (cfg.n_layers, cfg.n_heads, cfg.head_dim))
    for _ in range(6):
        q, k, v = a.token()
        expected = a.eng.step(q, k, v)
        b.step_device(*device_arrays(q, k, v), out)
        np.testing.assert_array_equal(out.to_numpy(), expected)
    assert_same_state(a.eng, b)
    for kind in a.eng.mirror.k:
        np.testing.assert_array_equal(a.eng.mirror.k[kind], b.mirror.k[kind])
        np.testing.assert_array_equal(a.eng.mirror.v[kind], b.mirror.v[kind])


def test_device_waits_per_token_in_each_mode(arch):
    """A step_device token costs one device wait with per-token checks (the flags' download) and none with
    deferred checks, which wait once at sync(); off CUDA and Vulkan (no one-dispatch step) both modes look
    at every token's flags.  Counted on the engine's transfers, which are its only waits."""
    cfg = geometry(window=64, **GEOMETRIES["gqa4-d64"])
    waits = {}
    for mode in ("per_token", "deferred"):
        s = Session(mt.Engine(cfg, arch=arch, pinned="off", device_checks=mode), seed=3)
        s.prefill(70)
        out = ti.ndarray(ti.f32, (cfg.n_layers, cfg.n_heads, cfg.head_dim))
        transfer = s.eng.launcher.transfer
        before = transfer.waits
        for _ in range(4):
            s.eng.step_device(*device_arrays(*s.token()), out)
        waits[mode] = transfer.waits - before
        before = transfer.waits
        s.eng.sync()
        waits[mode + " sync"] = transfer.waits - before
    deferred = 0 if s.eng.one_dispatch_step else 4
    assert waits == {"per_token": 4, "per_token sync": 0, "deferred": deferred, "deferred sync": 1 - deferred // 4}


def test_deferred_checks_refuse_late_and_roll_back_to_the_refused_token(arch):
    """Deferred checks: a bad token among good ones goes unnoticed until sync(), which raises for it and
    leaves the engine where it was before it, planes bit for bit a twin's that never saw it; the device
    wrote neither it nor the tokens after it (their out buffers keep what they held), and the session goes on."""
    cfg = geometry(window=64, **GEOMETRIES["gqa4-d64"])
    s = Session(mt.Engine(cfg, arch=arch, pinned="off", device_checks="deferred"), seed=11)
    twin = mt.Engine(cfg, arch=arch, pinned="off")
    s.prefill(70, also=twin)
    tokens = [s.token() for _ in range(5)]
    q, k, v = tokens[2]
    tokens[2] = (q, np.where(np.arange(k.size).reshape(k.shape) == 130, np.inf, k), v)
    outs = [ti.ndarray(ti.f32, (cfg.n_layers, cfg.n_heads, cfg.head_dim)) for _ in tokens]
    for out in outs:
        out.fill(7.0)
    for out, token in zip(outs, tokens):
        if not s.eng.one_dispatch_step and token is tokens[2]:  # no deferral there: refused at once
            with pytest.raises(EngineError, match="k: non-finite value inf at layer 1, kv head 0, d 2"):
                s.eng.step_device(*device_arrays(*token), out)
            break
        s.eng.step_device(*device_arrays(*token), out)
    else:
        with pytest.raises(EngineError, match=r"position 72 was refused by the device scan \(a non-finite value in "
                                              r"k\); it and the 2 token\(s\) after it were not written"):
            s.eng.sync()
    for q, k, v in tokens[:2]:
        twin.step(q, k, v)
    assert_same_state(s.eng, twin)
    assert s.eng.route_counts == twin.route_counts
    for out in outs[2:]:
        assert (out.to_numpy() == 7.0).all()
    for q, k, v in tokens[:2]:
        s.record(k, v)
    for _ in range(3):  # the session goes on from there, right and equal to the twin's
        q, k, v = s.token()
        out = outs[0]
        s.eng.step_device(*device_arrays(q, k, v), out)
        expected = twin.step(q, k, v)
        np.testing.assert_array_equal(out.to_numpy(), expected)
        s.record(k, v)
        s.verify(expected, q, k, v)
    s.eng.sync()
    assert_same_state(s.eng, twin)
