"""Mirror planes (muser_ti/plane_mirror.py): the copy of the planes the pinned Metal rung reads.

Off macOS the mirror runs with its host-memory backing, so its real bookkeeping is tested here: sessions
through prefill, the ring's wrap, rewinds (accepted and refused), NoPE growth and snapshots, comparing
the mirror with the engine's planes bit for bit after every operation; the f16 rounding of awkward
values; ggml's vec routes over the mirror against the same routes over the planes (bit for bit); and
the bridge descriptors the Metal path would build, checked by the bridge's own plain-C planner.
The Metal backing itself needs macOS and skips here.
"""

from __future__ import annotations

import ctypes
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import muser_ti as mt
from muser_ti import ladder
from muser_ti.pinned import metal_bridge as mb, mirror as plane_mirror
from muser_ti.config import NOPE, SWA
from muser_ti.pinned.ggml import pinned_status
from muser_ti.planes import PlaneState
from sessions import GEOMETRIES, Session, geometry, not_on_lavapipe, token_stream

GGML_OK, GGML_WHY = pinned_status()
needs_ggml = pytest.mark.skipif(not GGML_OK, reason=f"pinned ggml-python 0.0.45 not usable: {GGML_WHY}")
NEEDS_METAL = "needs macOS with the pinned metallib; not run in this project's CI"
SRC = pathlib.Path(__file__).resolve().parent.parent / "metal_pinned"


def cpu_only(arch):
    if arch != "cpu":
        pytest.skip(f"the vec routes read host memory through ggml on the CPU backend, not on {arch}")


def assert_mirrors_planes(eng, what=""):
    """The mirror equals the engine's planes bit for bit (whole planes: every write is mirrored, so even
    dead rows agree) and its states are the engine's."""
    m = eng.mirror
    snap = eng.planes_snapshot()
    assert set(m.state) == set(snap), what
    for kind, (k, v, st) in snap.items():
        assert m.state[kind] == st, f"{what}: {kind} mirror state {m.state[kind]} != engine {st}"
        for name, mine, theirs in (("k", m.k[kind], k), ("v", m.v[kind], v)):
            assert mine.shape == theirs.shape, f"{what}: {kind}.{name} shape {mine.shape} != {theirs.shape}"
            diff = np.argwhere(mine.view(np.uint16) != theirs.view(np.uint16))
            assert not len(diff), (f"{what}: {kind}.{name} differs at {len(diff)} elements, first {tuple(diff[0])}: "
                                   f"mirror {mine[tuple(diff[0])]!r} vs plane {theirs[tuple(diff[0])]!r}")


# ---- bookkeeping through a whole session -----------------------------------------------------------

# the mirror is host bookkeeping beside the stores; the geometries change its row layout, not that: lavapipe runs one
@pytest.mark.parametrize("geom", ["gqa16-d128", *not_on_lavapipe(*sorted(set(GEOMETRIES) - {"gqa16-d128"}))])
def test_mirror_follows_the_planes_through_a_session(arch, geom, tmp_path):
    """Over 30 s on lavapipe (34 s warm on the 2-core VM): a whole session with rewinds, snapshots and growth at
    Glimmer's group shape, each step's planes read back and compared with the mirror; it is the one case lavapipe
    runs of this test, the mirror's only check against device planes in CI."""
    # ring of 96 = window 64 + slack 32 (rewinds of up to 32 tokens), NoPE plane from 64 rows, doubling
    cfg = geometry(window=64, slack=32, **GEOMETRIES[geom])
    # where ggml can run (the CPU), with the pinned rung on, so its vec routes read the mirror
    rung = "on" if arch == "cpu" and GGML_OK else "auto"
    s = Session(mt.Engine(cfg, arch=arch, mirror="host", pinned=rung), seed=11)
    eng = s.eng
    assert eng.mirror.name == "host"
    assert_mirrors_planes(eng, "new engine")
    s.prefill(40)
    assert_mirrors_planes(eng, "prefill 40")
    eng.save(tmp_path / "early.safetensors")  # NoPE capacity 64 here
    for _ in range(40):  # NoPE grows 64 -> 128 at token 64
        s.step()
        assert_mirrors_planes(eng, f"step to {eng.position}")
    assert eng.planes[NOPE].state.capacity == 128
    s.prefill(50)  # the ring (96) wraps inside the prefill; NoPE grows to 256
    assert eng.planes[SWA].state.origin_physical != 0 and eng.planes[NOPE].state.capacity == 256
    assert_mirrors_planes(eng, "prefill across the wrap")
    for _ in range(30):
        s.step()
        assert_mirrors_planes(eng, f"step to {eng.position}")

    s.rewind(eng.position - 20)  # accepted: within the slack; the ring is now partially wrapped
    assert eng.planes[SWA].state.is_partially_wrapped
    assert_mirrors_planes(eng, "accepted rewind")
    before = {kind: (m.copy(), eng.mirror.state[kind]) for kind, m in eng.mirror.k.items()}
    with pytest.raises(mt.EngineError, match="cannot rewind"):
        eng.rewind(eng.position - 60)  # refused: the ring no longer holds that far back
    assert_mirrors_planes(eng, "refused rewind")
    for kind, (k, st) in before.items():
        assert eng.mirror.state[kind] == st and np.array_equal(eng.mirror.k[kind], k)
    for _ in range(40):  # refills the partially wrapped ring, then wraps on
        s.step()
        assert_mirrors_planes(eng, f"step to {eng.position} after the rewind")

    if arch == "cpu" and GGML_OK:  # the vec routes ran, reading the mirror, within llama's tolerance
        assert {ladder.LLAMA_VEC_SWA, ladder.LLAMA_VEC_NOPE} <= set(eng.route_counts)

    eng.save(tmp_path / "late.safetensors")
    for _ in range(5):
        s.step()
    eng.load(tmp_path / "late.safetensors")
    assert_mirrors_planes(eng, "load (same capacities)")
    eng.load(tmp_path / "early.safetensors")  # NoPE plane shrinks back to 64 rows: the mirror reallocates
    assert eng.mirror.state[NOPE].capacity == 64
    assert_mirrors_planes(eng, "load (smaller NoPE plane)")
    resumed = mt.Engine.from_snapshot(tmp_path / "late.safetensors", arch=arch, mirror="host", pinned=rung)
    assert_mirrors_planes(resumed, "from_snapshot")
    # both resumed sessions go on storing into their mirrors
    for e in (eng, resumed):
        for q, k, v in token_stream(cfg, 3, seed=12):
            e.step(q, k, v)
            assert_mirrors_planes(e, f"after resuming, step to {e.position}")


@pytest.mark.parametrize("graph", ["teacher", "serving"])
def test_f16_rounding_of_awkward_values_matches_the_store_kernels(arch, graph):
    """numpy's f32 -> f16 (round to nearest even, subnormals kept) gives the store kernels' bits."""
    if graph == "serving" and not (arch == "cpu" and GGML_OK):
        pytest.skip("graph='serving' needs the pinned rung (ggml on the CPU backend)")
    f = np.float32
    ties = [1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -24 * 1.5, 2048 + 1, 2048 + 3]
    # the ties above round to even: 1, 1+2^-9, 0, 2^-23, 2^-23, 2048, 2052
    assert [float(np.float16(x)) for x in ties] == [1.0, 1 + 2.0 ** -9, 0.0, 2.0 ** -23, 2.0 ** -23, 2048.0, 2052.0]
    special = np.array(ties + [-x for x in ties] + [-0.0, 0.0, 65504.0, -65504.0, 65503.9, 6.1e-5, 6.0e-5,
                                                    5.96e-8, 2.9e-8, 1e-10, 0.1, 1 / 3, 2 / 3, 1e4 + 0.5], f)
    cfg = geometry(window=32, **GEOMETRIES["gqa4-d64"])
    eng = mt.Engine(cfg, arch=arch, mirror="host", graph=graph, pinned="on" if arch == "cpu" and GGML_OK else "auto")
    rng = np.random.default_rng(3)
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def awkward(*shape):
        a = rng.choice(special, size=shape).astype(f)
        wide = (rng.standard_normal(shape) * 10.0 ** rng.integers(-8, 5, size=shape)).astype(f)
        return np.clip(np.where(rng.random(shape) < 0.5, a, wide), -65504, 65504).astype(f)

    eng.prefill(awkward(40, L, KV, D), awkward(40, L, KV, D))
    assert_mirrors_planes(eng, "prefill of awkward values")
    for _ in range(3):
        eng.step(rng.standard_normal((L, H, D)).astype(f) * 1e-3, awkward(L, KV, D), awkward(L, KV, D))
        assert_mirrors_planes(eng, f"step of awkward values to {eng.position}")


def test_store_writes_only_its_rows_and_bad_calls_are_refused():
    cfg = geometry(window=8, **GEOMETRIES["gqa4-d64"])
    L, KV, D = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    m = plane_mirror.PlaneMirror(cfg, plane_mirror.HostBacking(),
                                 {SWA: PlaneState(0, 8), NOPE: PlaneState(0, 64)})
    for kind in m.k:
        m.k[kind][...] = np.float16(7)
    k = np.full((2, L, KV, D), 0.5, np.float32)
    m.store(SWA, [3, 5], k, k)
    m.store(NOPE, [9, 10], k, k)
    touched = {SWA: (slice(None), [3, 5]), NOPE: (slice(None), slice(None), [9, 10])}
    for kind, idx in touched.items():
        mask = np.zeros(m.k[kind].shape, bool)
        mask[idx] = True
        assert (m.k[kind][mask] == 0.5).all() and (m.k[kind][~mask] == 7).all()  # O(rows written), nothing else
    with pytest.raises(plane_mirror.MirrorError, match="outside"):
        m.store(SWA, [8, 0], k, k)
    with pytest.raises(plane_mirror.MirrorError, match="float32"):
        m.store(SWA, [0, 1], k.astype(np.float64), k)
    with pytest.raises(plane_mirror.MirrorError, match="grow"):
        m.set_state(NOPE, PlaneState(0, 128))
    with pytest.raises(plane_mirror.MirrorError, match="only an unwrapped NoPE plane grows"):
        m.grow(SWA, 16)
    with pytest.raises(mt.EngineError, match="mirror="):
        mt.Engine(cfg, arch="cpu", mirror="metal")


# ---- the mirror is a drop-in for the planes ---------------------------------------------------------

@needs_ggml
@pytest.mark.parametrize("graph", ["teacher", "serving"])
@pytest.mark.parametrize("geom", ["gqa16-d128", "gqa4-d64"])
def test_vec_routes_over_the_mirror_equal_those_over_the_planes(arch, geom, graph):
    cpu_only(arch)
    cfg = geometry(window=64, slack=32, **GEOMETRIES[geom]).with_overrides(n_ubatch=64)
    mirrored = mt.Engine(cfg, arch=arch, pinned="on", graph=graph, mirror="host")
    direct = mt.Engine(cfg, arch=arch, pinned="on", graph=graph)
    stream = token_stream(cfg, 400, seed=21)
    rng = np.random.default_rng(22)
    pre_k = rng.standard_normal((70, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)).astype(np.float32)
    pre_v = rng.standard_normal(pre_k.shape).astype(np.float32)
    for e in (mirrored, direct):
        e.prefill(pre_k, pre_v)
    compared = 0

    def both_step(i):
        nonlocal compared
        q, k, v = stream[i]
        a, b = mirrored.step(q, k, v), direct.step(q, k, v)
        assert mirrored.routes == direct.routes
        np.testing.assert_array_equal(a, b, err_msg=f"position {direct.position - 1}, routes {direct.routes}")
        compared += sum(r in ladder.PINNED_ROUTES for r in direct.routes)

    for i in range(130):  # through the ring's wrap, NoPE growth
        both_step(i)
    for e in (mirrored, direct):
        e.rewind(e.position - 25)
    for i in range(130, 200):
        both_step(i)
    assert compared > 100
    assert {ladder.LLAMA_VEC_SWA, ladder.LLAMA_VEC_NOPE} <= set(mirrored.route_counts)
    assert_mirrors_planes(mirrored, "end")
    # and the vec routes do read the mirror: change a NoPE row every token sees, and only they change
    mirrored.mirror.k[NOPE][:, :, 0] = np.float16(4.0)
    q, k, v = stream[200]
    a, b = mirrored.step(q, k, v), direct.step(q, k, v)
    for layer, route in enumerate(direct.routes):
        assert np.array_equal(a[layer], b[layer]) == (route != ladder.LLAMA_VEC_NOPE), (layer, route)


# ---- the Metal dispatch, checked by the bridge's plain-C planner -------------------------------------

@pytest.fixture(scope="module")
def plan_lib(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    so = tmp_path_factory.mktemp("mirror_plan") / "libmp_plan.so"
    subprocess.run(["gcc", "-std=c11", "-O2", "-shared", "-fPIC", str(SRC / "fa_plan.c"), str(SRC / "mp_pin.c"),
                    "-lm", "-o", str(so)], check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(so))
    mb.declare_plan_abi(lib)
    return lib


@needs_ggml
@pytest.mark.parametrize("graph", ["teacher", "serving"])
def test_bridge_descriptors_over_the_mirror_fit_its_buffers(arch, plan_lib, graph):
    """What BridgeRunner hands mp_attend_batch on Metal, for every vec-route layer of a session: the C planner
    accepts each problem, ns10 is 256 token-major / 128 head-major, and every K/V range the kernels touch
    (the pad kernel's ragged over-read included) lies inside its buffer at the bridge's alignment."""
    cpu_only(arch)
    # window 40 + slack 24 = 64 rows: with len 64 unwrapped the teacher graph attends 40 ragged rows ending at
    # the ring's last row, so the pad kernel reads past the plane, into the mirror's tail
    cfg = geometry(window=40, slack=24, **GEOMETRIES["gqa16-d128"]).with_overrides(n_ubatch=64)
    s = Session(mt.Engine(cfg, arch=arch, pinned="on", graph=graph, mirror="host"), seed=31)
    eng, seen = s.eng, set()
    for _ in range(200):
        s.step()
        p = eng.position - 1
        for route, kind in ((ladder.LLAMA_VEC_SWA, SWA), (ladder.LLAMA_VEC_NOPE, NOPE)):
            layers = tuple(i for i, r in enumerate(eng.routes) if r == route)
            if not layers:
                continue
            views = eng.vec.views(kind, layers, eng.planes[kind].state, p)
            probs = plane_mirror.bridge_problems(views, eng.mirror.backing.locate, cfg.n_heads, cfg.n_kv_heads,
                                                 cfg.head_dim, cfg.attention_scale)
            for vw, (prob, (kbuf, koff), (vbuf, voff)) in zip(views, probs):
                plan = mb.make_plan(plan_lib, prob)
                assert plan.vec.ns10 == (256 if kind == SWA else 128)
                for buf, off, extent in ((kbuf, koff, plan.k_extent), (vbuf, voff, plan.v_extent)):
                    assert off % 8 == 0 and off + extent <= buf.nbytes, (kind, p, off, extent, buf.nbytes)
                assert plan.has_mask == (vw.mask is not None)
                seen.add((kind, bool(plan.has_kvpad), vw.mask is not None))
    assert (NOPE, True, False) in seen  # head-major, ragged (pad kernel)
    if graph == "teacher":
        assert (SWA, True, False) in seen  # the ragged token-major window the mirror's tail is for
    else:
        assert (SWA, False, True) in seen  # llama's cells: 256-row multiples, with a mask


# ---- on Metal ------------------------------------------------------------------------------------------

@pytest.mark.skipif(sys.platform != "darwin", reason=NEEDS_METAL)
def test_metal_rung_reads_the_mirror(tmp_path):
    try:
        mb.load().close()
    except mb.MetalBridgeError as exc:
        pytest.skip(f"{NEEDS_METAL}: {exc}")
    loaded, why = mt.pinned_library_status("metal")
    assert loaded and "mirror" in why
    cfg = geometry(window=64, slack=32, **GEOMETRIES["gqa16-d128"])
    s = Session(mt.Engine(cfg, arch="metal", pinned="on"), seed=41)
    eng = s.eng
    assert eng.mirror.name == "metal"
    s.prefill(100)
    assert_mirrors_planes(eng, "prefill")
    for _ in range(120):
        s.step()  # checked against the float64 reference, llama's tolerance on the vec routes
        assert_mirrors_planes(eng, f"step to {eng.position}")
    s.rewind(eng.position - 20)
    for _ in range(30):
        s.step()
    eng.save(tmp_path / "m.safetensors")
    eng.load(tmp_path / "m.safetensors")
    assert_mirrors_planes(eng, "load")
    assert {ladder.LLAMA_VEC_SWA, ladder.LLAMA_VEC_NOPE} <= set(eng.route_counts)
