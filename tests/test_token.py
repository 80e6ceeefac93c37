"""Attention one layer at a time (Engine.token, Engine.prompt), as a model's forward pass calls it.

The per-layer token is held to step(): the same routes and the same output bits for the same token on each
backend (so every accuracy contract of step() carries over), through a ring's wrap and a NoPE plane's growth;
then to the float64 reference on its own.  It is atomic: an exception between layers leaves the engine exactly
as a twin that never saw the token.  Out-of-order, repeated and missing layers are refused, naming the layer.
"""

import numpy as np
import pytest

import muser_ti as mt
from muser_ti import EngineError, ladder
from sessions import GEOMETRIES, Session, covering_product, geometry
from test_hostile import assert_same_state, state

# Glimmer's group shape and a small one; 4 layers (three SWA, one NoPE), a 64-row window so the rings wrap
BITS_GEOMETRIES = {name: GEOMETRIES[name] for name in ("gqa16-d128", "gqa4-d64")}


def twins(arch, geom, **options):
    cfg = geometry(**geom)
    return mt.Engine(cfg, arch=arch, **options), mt.Engine(cfg, arch=arch, **options)


def by_layer(eng, q, k, v, **kinds):
    """One token through eng.token(), layer by layer: out [layers, heads, d]."""
    with eng.token() as t:
        return np.stack([np.asarray(t.attend(layer, q[layer], k[layer], v[layer])) for layer in range(eng.cfg.n_layers)])


# the geometries: the GPU producer's two tiles; the distributions: the kernels' numerics under each (test_routes
# holds those to the reference on every backend); lavapipe runs a covering set
@pytest.mark.parametrize("geom, dist", covering_product(list(BITS_GEOMETRIES), ["normal", "peaked", "large"]))
def test_a_token_by_layer_has_steps_routes_and_bits(arch, geom, dist):
    """Prefill 56 rows, then 16 tokens: the 64-row rings wrap and the NoPE plane grows 64 -> 128 while decoding.
    Every token: step() on one engine, token() on its twin, the same routes and bits; the twin's output is
    within the f32 bound of the float64 reference too."""
    stepper, layered = twins(arch, BITS_GEOMETRIES[geom])
    s = Session(layered, seed=3, dist=dist)
    s.prefill(56, also=stepper)
    capacities = set()
    for _ in range(16):
        q, k, v = s.token()
        expected = stepper.step(q, k, v)
        out = by_layer(layered, q, k, v)
        s.record(k, v)
        assert layered.routes == stepper.routes
        np.testing.assert_array_equal(out, expected)
        s.verify(out, q, k, v)
        capacities.add(layered.plane_state(3).capacity)
    assert capacities == {64, 128}, "the NoPE plane grew while decoding"
    assert layered.plane_state(0).is_wrapped, "the ring wrapped while decoding"
    assert layered.route_counts == stepper.route_counts
    assert_same_state(state(layered), state(stepper))


def test_n_tokens_at_once_are_n_steps(arch):
    """token(n), a verify pass: each layer attends its n tokens in order, each over the cache and the chunk's
    earlier tokens: the bits, routes, counts and planes of n steps, across the NoPE plane's growth at 64 rows."""
    stepper, layered = twins(arch, GEOMETRIES["gqa4-d64"])
    s = Session(layered, seed=5)
    s.prefill(58, also=stepper)
    for n in (1, 4, 3):
        toks = [s.token() for _ in range(n)]
        q, k, v = (np.stack(x) for x in zip(*toks))  # [n, layers, ...]
        expected = np.stack([stepper.step(*tok) for tok in toks])
        with layered.token(n) as t:
            out = np.stack([t.attend(layer, q[:, layer], k[:, layer], v[:, layer])
                            for layer in range(layered.cfg.n_layers)], axis=1)
        np.testing.assert_array_equal(out, expected)
        assert layered.routes == stepper.routes
    assert_same_state(state(layered), state(stepper))
    assert layered.plane_state(3).capacity == 128


# where the model raises (after the first layer, a middle one, the last) and how many tokens the forward holds:
# what the undo puts back differs (rows of one or n tokens; the growing plane's old allocation at layer 3);
# lavapipe runs a covering set
@pytest.mark.parametrize("raise_after, n", covering_product([0, 1, 3], [1, 3]))
def test_an_exception_between_layers_leaves_the_engine_as_before(arch, raise_after, n):
    """The model raises after layer ``raise_after`` (a KeyboardInterrupt once): the engine is bit for bit its twin
    that never saw the token, at a token that wraps the ring and one that grows the NoPE plane, and the next
    tokens give the twin's bits."""
    a, twin = twins(arch, GEOMETRIES["gqa4-d64"])
    s = Session(a, seed=11)
    s.prefill(63, also=twin)  # the next token grows the NoPE plane (64 rows) ...
    for _ in range(2):  # ... and, after the first abandoned token, the same again; then the ring is full
        before = state(a)
        q, k, v = (np.stack([s.token()[i] for _ in range(n)]) for i in range(3)) if n > 1 else s.token()
        error = KeyboardInterrupt if raise_after == 1 else RuntimeError
        with pytest.raises(error):
            with a.token(n) as t:
                for layer in range(raise_after + 1):
                    t.attend(layer, q[:, layer] if n > 1 else q[layer], k[:, layer] if n > 1 else k[layer],
                             v[:, layer] if n > 1 else v[layer])
                raise error("the model's own code raised between layers")
        assert a.open_token is None
        assert_same_state(state(a), before)
        assert_same_state(state(a), state(twin))
    for _ in range(3):
        q, k, v = s.token()
        np.testing.assert_array_equal(by_layer(a, q, k, v), twin.step(q, k, v))
    assert_same_state(state(a), state(twin))


def test_layers_out_of_order_twice_or_missing_are_refused_naming_the_layer(arch):
    eng, twin = twins(arch, GEOMETRIES["gqa4-d64"])
    s = Session(eng, seed=2)
    s.prefill(10, also=twin)
    q, k, v = s.token()
    t = eng.token()
    with pytest.raises(EngineError, match="layer 2: out of order: layer 0 is next"):
        t.attend(2, q[2], k[2], v[2])
    t.attend(0, q[0], k[0], v[0])
    with pytest.raises(EngineError, match="layer 0 has already attended"):
        t.attend(0, q[0], k[0], v[0])
    with pytest.raises(EngineError, match=r"expected a layer in \[0, 4\)"):
        t.attend(4, q[0], k[0], v[0])
    with pytest.raises(EngineError, match="layers 1..3 have not run"):
        t.commit()
    with pytest.raises(EngineError, match="token of 1 token.s. at position 10 is open .layers 0..0 done, layer 1 next"):
        eng.step(q, k, v)
    for call in (lambda: eng.rewind(5), lambda: eng.token(), lambda: eng.prompt(2), lambda: eng.plane_halves("swa")):
        with pytest.raises(EngineError, match="is open"):
            call()
    t.abandon()
    with pytest.raises(EngineError, match="closed"):
        t.attend(1, q[1], k[1], v[1])
    assert_same_state(state(eng), state(twin))
    with pytest.raises(EngineError, match="layer 3 has not run; it was abandoned"):
        with eng.token() as t:
            for layer in range(3):
                t.attend(layer, q[layer], k[layer], v[layer])
    assert_same_state(state(eng), state(twin))
    np.testing.assert_array_equal(by_layer(eng, q, k, v), twin.step(q, k, v))


@pytest.mark.parametrize("bad", ["nan q", "inf k", "v past f16", "q past f16", "shape", "dtype"])
def test_bad_arrays_at_a_layer_are_refused_naming_it(arch, bad):
    eng, twin = twins(arch, GEOMETRIES["gqa4-d64"])
    s = Session(eng, seed=4)
    s.prefill(20, also=twin)
    q, k, v = s.token()
    q2, k2, v2 = q[2].copy(), k[2].copy(), v[2].copy()
    expected = {"nan q": "attend layer 2 q: non-finite value nan at token 0, head 5, d 7",
                "inf k": "attend layer 2 k: non-finite value inf at token 0, kv head 1, d 3",
                "v past f16": "attend layer 2 v: value 70000 at token 0, kv head 0, d 9 is outside the f16 range the planes hold",
                "q past f16": "attend layer 2 q: value -100000 at token 0, head 1, d 1 is outside the f16 range q is held to",
                "shape": r"attend layer 2 k: shape \(1, 3, 64\), expected \(1, 2, 64\)",
                "dtype": "attend layer 2 q: dtype int64"}[bad]
    if bad == "nan q":
        q2[5, 7] = np.nan
    elif bad == "inf k":
        k2[1, 3] = np.inf
    elif bad == "v past f16":
        v2[0, 9] = 70000
    elif bad == "q past f16":
        q2[1, 1] = -1e5
    elif bad == "shape":
        k2 = np.zeros((3, 64), np.float32)
    else:
        q2 = np.ones((8, 64), np.int64)
    with pytest.raises(EngineError, match=expected):
        with eng.token() as t:
            t.attend(0, q[0], k[0], v[0])
            t.attend(1, q[1], k[1], v[1])
            t.attend(2, q2, k2, v2)
    assert_same_state(state(eng), state(twin))


@pytest.mark.parametrize("framework", ["taichi", "torch-cuda"])
def test_bad_device_arrays_abandon_the_token_naming_the_layer(arch, framework):
    """Arrays the kernels read in place (Taichi ndarrays on a GPU arch, torch CUDA tensors on CUDA) are scanned on the
    device, and the flags read when the token commits: the token is abandoned then, naming the layer, and the engine
    is its twin's.  Elsewhere they go through the host check, which names the layer at once."""
    if framework == "torch-cuda":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device for torch here")
    eng, twin = twins(arch, GEOMETRIES["gqa4-d64"])
    s = Session(eng, seed=4)
    s.prefill(20, also=twin)
    q, k, v = s.token()
    q = q.copy()
    q[2, 5, 7] = np.nan
    with pytest.raises(EngineError, match="attend layer 2.*non-finite value"):
        with eng.token() as t:
            for layer in range(eng.cfg.n_layers):
                t.attend(layer, *(as_kind(x[layer][None], framework + " float32") for x in (q, k, v)))
    assert_same_state(state(eng), state(twin))


def array_kinds():
    kinds = ["numpy float32", "numpy float16", "numpy float64", "taichi"]
    try:
        import torch  # noqa: F401

        kinds += ["torch float32", "torch bfloat16"]
        if torch.cuda.is_available():  # read in place by the kernels on arch="cuda"; copied to the host elsewhere
            kinds += ["torch-cuda float32", "torch-cuda bfloat16"]
    except ImportError:
        pass
    try:
        import mlx.core  # noqa: F401

        kinds += ["mlx float32", "mlx float16"]
    except ImportError:
        pass
    return kinds


def as_kind(a: np.ndarray, kind: str):
    framework, dtype = kind.split()[0], kind.split()[-1]
    if framework == "numpy":
        return a.astype(dtype)
    if framework in ("torch", "torch-cuda"):
        import torch

        t = torch.from_numpy(a).to(getattr(torch, dtype))
        return t.cuda() if framework == "torch-cuda" else t
    if framework == "mlx":
        import mlx.core as mx

        return mx.array(a).astype(getattr(mx, dtype))
    import taichi as ti

    arr = ti.ndarray(ti.f32, a.shape)
    arr.from_numpy(a)
    return arr


def rounded(a: np.ndarray, kind: str) -> np.ndarray:
    """What ``a`` is once converted to ``kind`` (float16 and bfloat16 round it), as float32."""
    dtype = kind.split()[-1]
    if dtype == "float16":
        return a.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":  # round to nearest even on the top 16 bits, as torch does
        bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32)
    return a


@pytest.mark.parametrize("kind", array_kinds())
def test_what_models_hold_goes_in_and_comes_back_in_its_kind(arch, kind):
    """numpy float16/float64, torch float32/bfloat16, mlx float32/float16, Taichi ndarrays: the same bits as float32
    numpy carrying the same (rounded) values, and the output in the caller's kind; [1, heads, d] works too."""
    eng, twin = twins(arch, GEOMETRIES["gqa4-d64"])
    s = Session(eng, seed=6)
    s.prefill(30, also=twin)
    for _ in range(2):
        q, k, v = (rounded(a, kind) for a in s.token())
        expected = twin.step(q, k, v)
        framework = kind.split()[0]
        with eng.token() as t:
            for layer in range(eng.cfg.n_layers):
                lead = framework == "taichi" or layer % 2  # [1, ...] on odd layers (Taichi ndarrays: always)
                arrays = [x[layer][None] if lead else x[layer] for x in (q, k, v)]
                out = t.attend(layer, *(as_kind(a, kind) for a in arrays))
                assert type(out).__module__.split(".")[0] == as_kind(q[:1], kind).__class__.__module__.split(".")[0]
                if framework == "torch-cuda":
                    assert out.is_cuda
                    out = out.cpu()
                host = out.to_numpy() if framework == "taichi" else np.asarray(out.float() if "torch" in framework else out)
                assert host.dtype == np.float32 and host.shape == arrays[0].shape
                np.testing.assert_array_equal(host.reshape(expected[layer].shape), expected[layer])


def test_a_prompt_stored_layer_by_layer_is_a_prefill(arch):
    """prompt(n): K/V layer by layer, committed as one prefill (a prompt longer than the 64-row window wraps the
    ring; the NoPE plane grows to hold it): the planes, states and the next tokens' bits of prefill(); an
    abandoned prompt writes nothing; order enforced as for tokens."""
    eng, twin = twins(arch, GEOMETRIES["gqa4-d64"])
    s = Session(twin, seed=8)
    k, v = s.rows(150)
    twin.prefill(k, v)
    with pytest.raises(RuntimeError):
        with eng.prompt(150) as pr:
            pr.store(0, k[:, 0], v[:, 0])
            raise RuntimeError("the model raised")
    assert eng.position == 0 and eng.open_token is None
    pr = eng.prompt(150)
    with pytest.raises(EngineError, match="store layer 1: out of order: layer 0 is next"):
        pr.store(1, k[:, 1], v[:, 1])
    with pytest.raises(EngineError, match=r"prompt store layer 0 k: shape \(149, 2, 64\), expected \(150, 2, 64\)"):
        pr.store(0, k[1:, 0], v[1:, 0])
    with pr:
        for layer in range(eng.cfg.n_layers):
            pr.store(layer, k[:, layer], v[:, layer])
    assert_same_state(state(eng), state(twin))
    assert eng.plane_state(3).capacity == 256 and eng.plane_state(0).is_wrapped
    for _ in range(3):
        q, k1, v1 = s.token()
        np.testing.assert_array_equal(by_layer(eng, q, k1, v1), twin.step(q, k1, v1))


def test_cached_kv_gives_what_the_planes_hold(arch):
    eng = mt.Engine(geometry(**GEOMETRIES["gqa4-d64"]), arch=arch)
    s = Session(eng, seed=9)
    k, v = s.rows(100)
    eng.prefill(k, v)
    for layer in (0, 3):  # a ring (64 rows: holds 36..99) and a NoPE plane (all)
        ck, cv = eng.cached_kv(layer, 40)
        np.testing.assert_array_equal(ck, k[40:, layer].astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(cv, v[40:, layer].astype(np.float16).astype(np.float32))
    assert eng.cached_kv(3, 0)[0].shape == (100, 2, 64)
    with pytest.raises(EngineError, match="holds tokens 36..99 only"):
        eng.cached_kv(0, 10)


def test_pinned_routes_by_layer_have_steps_bits():
    """pinned='on' on the CPU: llama.cpp's kernel per layer, for one layer at a time, gives the bits of its
    one graph over every layer of the route (step())."""
    from muser_ti import backend

    backend.activate("cpu")
    if not mt.pinned_library_status("cpu")[0]:
        pytest.skip("the pinned llama library is not loaded here")
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    stepper, layered = mt.Engine(cfg, arch="cpu", pinned="on"), mt.Engine(cfg, arch="cpu", pinned="on")
    s = Session(layered, seed=12)
    s.prefill(95, also=stepper)
    routes = set()
    for _ in range(4):
        q, k, v = s.token()
        np.testing.assert_array_equal(by_layer(layered, q, k, v), stepper.step(q, k, v))
        assert layered.routes == stepper.routes
        routes |= set(layered.routes)
    assert {ladder.LLAMA_VEC_SWA, ladder.LLAMA_VEC_NOPE} <= routes
