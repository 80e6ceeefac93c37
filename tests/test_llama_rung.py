"""The pinned llama rung off macOS: ggml's own kernel on the planes, predicates with the library
loaded, sessions mixing all four routes, and the serving graph's bit-parity with llama's cache."""

import numpy as np
import pytest

import muser_ti as mt
from muser_ti import PinnedUnavailable, ladder
from muser_ti.pinned import llama_rung
from muser_ti.pinned.ggml import GgmlFlashAttn, pinned_status
from muser_ti.tolerances import LLAMA_CPU_VTOL
from sessions import GEOMETRIES, Session, geometry

GGML_OK, GGML_WHY = pinned_status()
needs_ggml = pytest.mark.skipif(not GGML_OK, reason=f"pinned ggml-python 0.0.45 not usable: {GGML_WHY}")


def cpu_only(arch):
    if arch != "cpu":
        pytest.skip(f"the pinned ggml kernel reads host memory: it is the rung on the CPU backend, not on {arch}")


@needs_ggml
def test_identity_and_modes(arch):
    cfg = geometry(window=64, **GEOMETRIES["gqa4-d64"])
    loaded, why = mt.pinned_library_status(arch)
    if arch == "cpu":
        assert loaded and "ggml-python 0.0.45 (ggml v0.15.3)" in why
        eng = mt.Engine(cfg, arch=arch, pinned="on")
        assert eng.pinned_loaded and eng.pinned_description == why
        assert not mt.Engine(cfg, arch=arch, pinned="off").pinned_loaded
    elif arch == "metal" and loaded:  # macOS with the bridge built: it reads mirror planes (test_plane_mirror.py)
        assert "mirror" in why and mt.Engine(cfg, arch=arch, pinned="on").mirror.name == "metal"
    else:
        assert not loaded and "cannot read planes" in why
        with pytest.raises(PinnedUnavailable, match="cannot read planes"):
            mt.Engine(cfg, arch=arch, pinned="on")
        assert not mt.Engine(cfg, arch=arch).pinned_loaded  # auto falls to the project's kernels


def ring_session(arch, window=64, slack=0, capacity=None, geom="gqa16-d128", dist="normal", seed=0, **kw):
    cfg = geometry(window=window, slack=slack, **GEOMETRIES[geom], **kw)
    return Session(mt.Engine(cfg, arch=arch, pinned="on", capacity=capacity), seed=seed, dist=dist)


@needs_ggml
@pytest.mark.parametrize("dist", ["normal", "peaked", "sink"])
def test_vec_routes_on_every_admitted_plane_state(arch, dist):
    cpu_only(arch)
    s = ring_session(arch, dist=dist, seed=1)
    seen = set()
    for _ in range(130):  # before the wrap (len % 32 == 0 only), exactly full, then full and wrapped
        s.step()
        st = s.eng.planes["swa"].state
        if s.eng.routes[0] == ladder.LLAMA_VEC_SWA:
            seen.add("unwrapped" if st.origin_physical == 0 else "full-wrapped")
        assert s.eng.routes[0] == (ladder.LLAMA_VEC_SWA if st.len % 32 == 0 else ladder.SPLITK)
        assert s.eng.routes[3] == ladder.LLAMA_VEC_NOPE  # head-major, never wraps, capacity >= 32
    assert seen == {"unwrapped", "full-wrapped"}
    assert s.eng.planes["nope"].state.capacity == 256  # the growing plane grew under the vec route


@needs_ggml
def test_full_ring_with_slack_reads_every_slot_masked(arch):
    cpu_only(arch)
    s = ring_session(arch, window=48, slack=16, seed=2)  # capacity 64 = window + slack
    s.prefill(100)
    for _ in range(20):
        s.step()
    st = s.eng.planes["swa"].state
    assert st.len == st.capacity == 64 and s.eng.routes[0] == ladder.LLAMA_VEC_SWA
    first, n, mask = llama_rung.ring_view(st, s.eng.position - 1, 48)
    assert (first, n) == (0, 64) and int((mask == 0).sum()) == 48


@needs_ggml
def test_predicates_with_the_library_loaded(arch):
    cpu_only(arch)
    # window not a multiple of 32: once the ring is full len % 32 != 0 and SWA stays on splitk
    s = ring_session(arch, window=40, geom="gqa4-d64", seed=3)
    s.prefill(60)
    for _ in range(5):
        s.step()
    assert s.eng.routes[0] == ladder.SPLITK and s.eng.routes[3] == ladder.LLAMA_VEC_NOPE
    # a tiny session: capacity < 32 keeps every layer off the vec kernel
    s = ring_session(arch, window=8, capacity=16, geom="gqa4-d64", seed=4)
    for _ in range(16):
        s.step()
    assert s.eng.route_counts == {ladder.SPLITK: 48, ladder.INTERLEAVED: 16}
    # contiguity: a rollback leaves a ring with slack partially wrapped, which the vec route never reads
    s = ring_session(arch, window=32, slack=32, geom="gqa4-d64", seed=5)
    s.prefill(100)
    s.step()
    s.rewind(s.eng.position - 32)  # len 32 (a multiple of 32), origin_physical != 0
    s.step()
    st = s.eng.planes["swa"].state
    assert st.is_partially_wrapped and s.eng.routes[0] == ladder.SPLITK


@needs_ggml
def test_sessions_mix_all_four_routes(arch):
    cpu_only(arch)
    cfg = geometry(window=64, n_layers=8, **GEOMETRIES["gqa16-d128"])
    s = Session(mt.Engine(cfg, arch=arch, pinned="on", force={7: ladder.INTERLEAVED}), seed=6)
    for _ in range(70):
        s.step()
    assert set(s.eng.route_counts) == set(ladder.ROUTES)
    assert s.eng.routes[3] == ladder.LLAMA_VEC_NOPE and s.eng.routes[7] == ladder.INTERLEAVED


class LlamaCacheModel:
    """llama.cpp's SWA cache as the serving graph must reproduce it, written apart from the engine's
    staging code: cells = GGML_PAD(window + n_ubatch, 256), token p in cell p % cells, attend
    n_kv = min(cells, GGML_PAD(used, 256)) cells with -inf on empty cells and outside the window."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.cells = -(-(cfg.window + cfg.n_ubatch) // 256) * 256
        shape = (cfg.n_layers, self.cells, cfg.n_kv_heads, cfg.head_dim)
        self.k, self.v = np.zeros(shape, np.float16), np.zeros(shape, np.float16)
        self.token_in_cell = [None] * self.cells
        self.fa = GgmlFlashAttn(cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.attention_scale, n_threads=None)

    def append(self, p, k, v):
        c = p % self.cells
        self.k[:, c], self.v[:, c] = k.astype(np.float16), v.astype(np.float16)
        self.token_in_cell[c] = p

    def attend(self, p, q, layer):
        used = sum(t is not None for t in self.token_in_cell)
        n_kv = min(self.cells, -(-used // 256) * 256)
        mask = np.array([0.0 if t is not None and p - self.cfg.window < t <= p else -np.inf
                         for t in self.token_in_cell[:n_kv]], np.float16)
        kv = self.cfg.n_kv_heads * self.cfg.head_dim
        return self.fa.attend(q[layer], self.k[layer], self.v[layer], first_row=0, n_rows=n_kv,
                              row_stride_elems=kv, head_stride_elems=self.cfg.head_dim, mask=mask)


@needs_ggml
def test_serving_graph_is_bit_identical_to_llamas_cache_and_teacher_is_not(arch):
    cpu_only(arch)
    # 64-token window, n_ubatch 64: 256 cells, so both the ring (64) and the cells (256) wrap
    cfg = geometry(window=64, n_layers=4, **GEOMETRIES["gqa4-d64"]).with_overrides(n_ubatch=64)
    serving = mt.Engine(cfg, arch=arch, pinned="on", graph="serving")
    teacher = mt.Engine(cfg, arch=arch, pinned="on", graph="teacher")
    model = LlamaCacheModel(cfg)
    assert serving.cache.serving.cells == model.cells == 256
    rng = np.random.default_rng(7)
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    compared = wrapped_differences = 0
    values = []  # v per position: the rung's bound scales with the attended rows' |V|
    for p in range(300):
        q = rng.standard_normal((L, H, D)).astype(np.float32)
        k = rng.standard_normal((L, KV, D)).astype(np.float32)
        v = rng.standard_normal((L, KV, D)).astype(np.float32)
        values.append(v)
        out_s, out_t = serving.step(q, k, v), teacher.step(q, k, v)
        assert serving.routes == teacher.routes
        model.append(p, k, v)
        ref = teacher.reference(q, k, v)
        for layer in cfg.swa_layers:
            if serving.routes[layer] != ladder.LLAMA_VEC_SWA:
                continue
            np.testing.assert_array_equal(out_s[layer], model.attend(p, q, layer))  # llama's bits
            compared += 1
            v_max = max(float(np.abs(row[layer]).max()) for row in values[-cfg.window:])
            for graph, out in (("serving", out_s), ("teacher", out_t)):  # both the same attention, the reference's
                err = float(np.abs(out[layer] - ref[layer]).max()) / v_max
                assert err <= LLAMA_CPU_VTOL, f"{graph} graph, position {p}, layer {layer}: {err:.3g} x max|V|"
            if teacher.planes["swa"].state.origin_physical != 0 and not np.array_equal(out_t[layer], out_s[layer]):
                wrapped_differences += 1
    assert compared > 200
    assert wrapped_differences >= 1, "the teacher graph's wrapped-ring read never differed in the last bits"
