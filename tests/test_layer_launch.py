"""A per-layer token launched from compiled code (Taichi's C-API, muser_ti/layer_launch.py) against Taichi's Python
launch path: the same bits, whatever arrays the model holds; the fallback where the C-API cannot load; what the
C-API runtime keeps (imports, modules on disk, its compile configuration).

The compiled path runs on the CPU and CUDA; on Vulkan the engine takes the Python path (its planes live in the
Python runtime's device, which a C-API runtime cannot share), so these tests skip there.  tests/test_token.py
holds the default path (compiled, on the CPU) to step() bit for bit; here the two launch paths meet.
"""

import gc
import warnings
import weakref

import numpy as np
import pytest

import muser_ti as mt
from muser_ti import EngineError, aot, capi, layer_launch
from sessions import GEOMETRIES, Session, geometry
from test_hostile import assert_same_state, state


@pytest.fixture
def compiled_arch(arch):
    if arch not in ("cpu", "cuda"):
        pytest.skip(f"the compiled per-layer path runs on cpu and cuda; {arch} takes Taichi's Python path")
    return arch


def _kinds():
    """The arrays a model holds, as (name, convert); torch only where it is installed."""
    kinds = [("numpy-f32", lambda a: a), ("numpy-f16", lambda a: a.astype(np.float16))]
    try:
        import torch

        kinds += [("torch-f32", torch.from_numpy), ("torch-bf16", lambda a: torch.from_numpy(a).bfloat16())]
    except ImportError:
        pass
    return kinds


def _attend_all(eng, q, k, v, n, convert):
    """n tokens through eng.token(n), layer by layer: out [n, layers, heads, d] as float32 numpy."""
    outs = []
    with eng.token(n) as t:
        for layer in range(eng.cfg.n_layers):
            if n == 1:
                got = t.attend(layer, convert(q[0, layer]), convert(k[0, layer]), convert(v[0, layer]))
            else:
                got = t.attend(layer, convert(q[:, layer]), convert(k[:, layer]), convert(v[:, layer]))
            got = np.asarray(got.float() if hasattr(got, "float") else got, np.float32)
            outs.append(got.reshape(n, eng.cfg.n_heads, eng.cfg.head_dim))
    return np.stack(outs, axis=1)


# the array kinds convert differently on the way in (numpy copies, torch converts while it copies): each once;
# n=3 is a verify pass, each token over the cache and the chunk's earlier ones
@pytest.mark.parametrize("kind", [name for name, _ in _kinds()])
@pytest.mark.parametrize("n", [1, 3])
def test_compiled_and_python_launches_give_the_same_bits(compiled_arch, kind, n):
    """Prefill 40 rows, then tokens in chunks of n through the 64-row rings' wrap and the NoPE plane's growth
    (64 -> 128 -> 256): the two launch paths give the same routes, outputs and planes, bit for bit."""
    convert = dict(_kinds())[kind]
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    compiled = mt.Engine(cfg, arch=compiled_arch, launch="capi")
    python = mt.Engine(cfg, arch=compiled_arch, launch="python")
    s = Session(compiled, seed=11)
    s.prefill(40, also=python)
    assert compiled.launcher.compiled_layers() is not None and python.launcher.compiled_layers() is None
    for _ in range(90 // n):
        tokens = [s.token() for _ in range(n)]
        q, k, v = (np.stack([tok[i] for tok in tokens]) for i in range(3))
        got = _attend_all(compiled, q, k, v, n, convert)
        want = _attend_all(python, q, k, v, n, convert)
        np.testing.assert_array_equal(got, want)
        assert compiled.routes == python.routes
    assert compiled.plane_state(3).capacity == 256 and compiled.plane_state(0).is_wrapped
    assert_same_state(state(compiled), state(python))
    assert compiled.route_counts == python.route_counts


@pytest.mark.parametrize("n", [1, 3])
def test_a_layers_producer_on_one_thread_and_on_lanes_gives_steps_and_the_pools_bits(compiled_arch, n, monkeypatch):
    """The compiled path runs a layer's producer on the calling thread at short context, then (past CPU_SERIAL_ROWS,
    lowered here so the run crosses it) on the calling thread and its lanes, items dealt round-robin, or on the
    calling thread alone where there are no lanes; the Python path runs it serially, then on Taichi's pool.  Every
    way gives step()'s bits, through the rings' wrap and the NoPE plane's growth."""
    if compiled_arch != "cpu":
        pytest.skip("the serial producer and its lanes are the CPU's")
    from muser_ti.kernels import split_geometry

    monkeypatch.setattr(split_geometry, "CPU_SERIAL_ROWS", 100)  # serial up to 50 visible rows a layer (2 KV heads)
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    compiled = mt.Engine(cfg, arch="cpu", launch="capi")
    python = mt.Engine(cfg, arch="cpu", launch="python")
    stepper = mt.Engine(cfg, arch="cpu")
    s = Session(compiled, seed=5)
    k, v = s.rows(30)
    for eng in (compiled, python, stepper):
        eng.prefill(k, v)
    layers = compiled.launcher.compiled_layers()
    lanes = layers.lanes
    assert lanes is not None, "a 2-core machine has one producer lane"
    ways = set()
    for i in range(60 // n):
        layers.lanes = lanes if i % 4 else None  # every fourth token as on one core
        tokens = [s.token() for _ in range(n)]
        q, k, v = (np.stack([tok[j] for tok in tokens]) for j in range(3))
        ways.add("serial" if compiled.launcher.serial_layer(compiled.position + 1) else
                 "lanes" if layers.lanes is not None else "alone")
        got = _attend_all(compiled, q, k, v, n, lambda a: a)
        np.testing.assert_array_equal(got, _attend_all(python, q, k, v, n, lambda a: a))
        want = np.stack([np.asarray(stepper.step(q[j], k[j], v[j])) for j in range(n)])
        np.testing.assert_array_equal(got, want)
    assert ways == {"serial", "lanes", "alone"}
    assert compiled.plane_state(3).capacity == 128 and compiled.plane_state(0).is_wrapped
    assert_same_state(state(compiled), state(stepper))


def test_after_a_fork_the_layers_run_without_the_lanes(compiled_arch, monkeypatch):
    """fork copies only the calling thread: a child that handed a deep layer's items to the parent's lane threads
    would wait for ever, so the fork hook drops the lanes and the child's layers run on its calling thread, with the
    same bits.  (The hook is called here in this process; a real fork's child also loses Taichi's own thread pool,
    whose next parallel launch never returns, so an engine is not carried across a fork.)"""
    if compiled_arch != "cpu":
        pytest.skip("the producer lanes are the CPU's")
    from muser_ti.kernels import split_geometry

    monkeypatch.setattr(split_geometry, "CPU_SERIAL_ROWS", 16)  # every layer on the lanes
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    compiled = mt.Engine(cfg, arch="cpu", launch="capi")
    python = mt.Engine(cfg, arch="cpu", launch="python")
    s = Session(compiled, seed=6)
    s.prefill(40, also=python)
    lanes = compiled.launcher.compiled_layers().lanes
    assert lanes.lanes, "a 2-core machine has a producer lane"
    monkeypatch.setattr(lanes, "lanes", list(lanes.lanes))  # put back after the test
    monkeypatch.setattr(lanes, "lock", lanes.lock)
    layer_launch._forget_lanes_after_fork()
    assert lanes.lanes == []
    for _ in range(3):
        q, k, v = s.token()
        got = _attend_all(compiled, q[None], k[None], v[None], 1, lambda a: a)
        np.testing.assert_array_equal(got, _attend_all(python, q[None], k[None], v[None], 1, lambda a: a))


def _fold(eng, t, layer: int, io: tuple) -> None:
    """The folded layer kernel (kernels/layer_kernel.py) on ``io`` = (q, k, v, out) Taichi arrays [1, ...], launched
    through Taichi's Python path with the arguments CompiledLayers gives it through the C-API: every part, on every
    item, on this thread."""
    from muser_ti.kernels.layer_kernel import LAYER_ALL, build_layer_kernels
    from muser_ti.planes import visible_span, window_of

    launcher, cache, cfg = eng.launcher, eng.cache, eng.cfg
    p, new_states, routes, _ = t.plans[0]
    route, kind = routes[layer], cfg.layer_kinds[layer]
    st = new_states[kind]
    nwg, nsg = launcher.split_geometry(visible_span(cfg, kind, p)[1], t.route_sizes[0][route])
    grp = cache.token_group(layer)
    kernel = build_layer_kernels(cfg.head_dim, cfg.heads_per_kv, cfg.n_kv_heads, cfg.n_heads, launcher.gpu,
                                 launcher.items_cap)[route]
    kernel(*io, launcher.checks.flags, t._scan_stamp(layer), LAYER_ALL, cache.k[kind], cache.v[kind],
           launcher.partials_for(kind, 1, nwg), launcher._no_visits, grp.layers_dev, grp.slots_dev, p,
           window_of(cfg, kind), st.capacity, st.origin_logical, st.origin_physical, nwg, nsg, cfg.attention_scale, 0,
           1)


def test_the_folded_layer_gives_the_four_kernels_bits(arch):
    """The folded layer, launched through Taichi's Python path on any backend (its GPU tasks run here on Vulkan; the
    C-API path launches it on the CPU and CUDA), against the Python path's four kernels (scan, store, producer,
    merge): the same outputs and planes, bit for bit, through the NoPE plane's growth (128 -> 256 rows) on wrapped
    rings; then a token whose k holds a NaN at a ring's layer and a plane's: nothing written, and the abandon leaves
    the engine as before it."""
    if arch == "cpu":
        pytest.skip("on the CPU the C-API path launches the fold: test_compiled_and_python_launches_give_the_same_bits")
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    folded = mt.Engine(cfg, arch=arch, launch="python")
    four = mt.Engine(cfg, arch=arch, launch="python")
    s = Session(folded, seed=12)
    s.prefill(100, also=four)
    launcher = folded.launcher
    io = launcher.layer_device_arrays()
    for _ in range(30):
        q, k, v = s.token()
        want = _attend_all(four, q[None], k[None], v[None], 1, lambda a: a)[0]
        t = folded.token()
        for layer in range(cfg.n_layers):
            for dev, a in zip(io, (q[layer], k[layer], v[layer])):
                launcher.transfer.upload(dev, a[None])
            _fold(folded, t, layer, io)
            got = launcher.transfer.download(io[3], tuple(io[3].shape))[0]
            np.testing.assert_array_equal(got, want[layer], err_msg=f"position {folded.position}, layer {layer}")
        t.next_layer = cfg.n_layers  # every layer ran (here, not through t.attend)
        t.commit()
    assert folded.plane_state(3).capacity == 256 and folded.plane_state(0).is_wrapped
    assert_same_state(state(folded), state(four))
    q, k, v = s.token()
    before = state(folded)
    t = folded.token()
    for layer in range(cfg.n_layers):
        bad_k = k[layer].copy()
        bad_k[0, 9] = np.nan
        for dev, a in zip(io, (q[layer], bad_k, v[layer], np.full_like(q[layer], 7.0))):
            launcher.transfer.upload(dev, a[None])
        kept = _planes(folded)
        _fold(folded, t, layer, io)
        assert (launcher.transfer.download(io[3], tuple(io[3].shape)) == 7.0).all(), f"layer {layer}: out written"
        for kind, (k_plane, v_plane) in _planes(folded).items():
            np.testing.assert_array_equal(k_plane, kept[kind][0], err_msg=f"layer {layer}: {kind} K written")
            np.testing.assert_array_equal(v_plane, kept[kind][1], err_msg=f"layer {layer}: {kind} V written")
    t.abandon()
    assert_same_state(state(folded), before)


def _planes(eng) -> dict:
    """The engine's raw planes as they are now (planes_snapshot refuses while a token is open)."""
    return {kind: (eng.cache.k[kind].to_numpy(), eng.cache.v[kind].to_numpy()) for kind in eng.cache.k}


@pytest.mark.parametrize("bad", [np.nan, 1e5])
def test_a_layer_its_scan_flags_writes_nothing(compiled_arch, bad):
    """The folded layer (kernels/layer_kernel.py) stores the token's row and writes ``out`` only where its own scan
    passed the token: launched on a k holding a value the planes cannot hold (non-finite; past f16), a ring's layer
    (splitk) and a plane's (interleaved) leave both planes and ``out`` as they were, before any abandon puts rows
    back.  (The CPU's host then raises ScanRefused; CUDA's reads the flags at the commit.)"""
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    eng = mt.Engine(cfg, arch=compiled_arch, launch="capi")
    s = Session(eng, seed=4)
    s.prefill(40)
    compiled = eng.launcher.compiled_layers()
    assert {cfg.layer_kinds[0], cfg.layer_kinds[3]} == {"swa", "nope"}
    for layer in (0, 3):
        q, k, v = s.token()
        before = state(eng)
        t = eng.token()
        for earlier in range(layer):
            t.attend(earlier, q[earlier], k[earlier], v[earlier])
        kept = _planes(eng)
        bad_k = k[layer].copy()
        bad_k[1, 5] = bad
        arrays_in = [a[None].astype(np.float32) for a in (q[layer], bad_k, v[layer])]
        stamp = t._scan_stamp(layer)
        if compiled_arch == "cpu":
            views = eng.launcher._layer_views
            for view, a in zip(views, arrays_in):
                np.copyto(view, a)
            views[3][...] = 7.0
            with pytest.raises(layer_launch.ScanRefused):
                compiled.attend(t.plans[0], layer, t.route_sizes[0], compiled.staged(), stamp)
            out = views[3]
        else:
            import torch

            dev = [torch.from_numpy(a).cuda() for a in arrays_in]
            out_t = torch.full(dev[0].shape, 7.0, device="cuda")
            compiled.attend(t.plans[0], layer, t.route_sizes[0], compiled.device_io(*dev, out_t), stamp)
            torch.cuda.synchronize()
            out = out_t.cpu().numpy()
        assert (out == 7.0).all(), f"layer {layer}: out written by a refused layer"
        for kind, (k_plane, v_plane) in _planes(eng).items():
            np.testing.assert_array_equal(k_plane, kept[kind][0], err_msg=f"layer {layer}: {kind} K")
            np.testing.assert_array_equal(v_plane, kept[kind][1], err_msg=f"layer {layer}: {kind} V")
        t.abandon()
        assert_same_state(state(eng), before)


def test_new_arrays_every_token_import_nothing_new(compiled_arch):
    """The caller's arrays go through the layer's staging arrays (CPU): a fresh array every call imports nothing
    into the C-API runtime, whose imports Taichi 1.7.4 cannot free."""
    if compiled_arch != "cpu":
        pytest.skip("CUDA imports a framework's tensors where they lie, up to layer_launch.MAX_IMPORTED")
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    eng = mt.Engine(cfg, arch="cpu", launch="capi")
    s = Session(eng, seed=2)
    s.prefill(10)
    q, k, v = s.token()
    _attend_all(eng, q[None], k[None], v[None], 1, lambda a: a.copy())
    before = layer_launch.runtime("cpu").imported
    for _ in range(5):
        q, k, v = s.token()
        _attend_all(eng, q[None], k[None], v[None], 1, lambda a: a.copy())
    assert layer_launch.runtime("cpu").imported == before


def test_a_grown_plane_is_freed(compiled_arch):
    """The compiled path's record of the arrays it imported keeps none alive: once the token that grew the NoPE
    plane commits, the plane's old allocation is freed (held, it would stay for the process's life)."""
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    eng = mt.Engine(cfg, arch=compiled_arch, launch="capi")
    s = Session(eng, seed=3)
    s.prefill(60)
    q, k, v = s.token()
    _attend_all(eng, q[None], k[None], v[None], 1, lambda a: a)
    old = weakref.ref(eng.cache.k["nope"])
    while eng.plane_state(3).capacity == 64:
        q, k, v = s.token()
        _attend_all(eng, q[None], k[None], v[None], 1, lambda a: a)
    gc.collect()
    assert old() is None, "the NoPE plane's allocation before it grew is still referenced"


def test_auto_falls_back_to_the_python_path_with_one_warning(compiled_arch, monkeypatch):
    """Where the C-API cannot load, launch="auto" warns once, naming why, and takes Taichi's Python path (the same
    bits); launch="capi" refuses with the same reason."""
    if compiled_arch == "cuda":
        pytest.skip("launch='auto' takes the Python path on CUDA (the C-API path is not measured cheaper there)")
    cfg = geometry(**GEOMETRIES["gqa4-d64"])

    def unavailable(arch):
        raise capi.CApiError("libtaichi_c_api.so did not load (simulated)")

    monkeypatch.setattr(layer_launch, "runtime", unavailable)
    eng = mt.Engine(cfg, arch=compiled_arch, launch="auto")
    python = mt.Engine(cfg, arch=compiled_arch, launch="python")
    s = Session(eng, seed=5)
    s.prefill(20, also=python)
    tokens = [s.token() for _ in range(2)]
    with pytest.warns(RuntimeWarning, match=r"C-API cannot be used here \(libtaichi_c_api.so did not load "
                                            r"\(simulated\)\); per-layer attention takes Taichi's Python"):
        got = _attend_all(eng, *(a[None] for a in tokens[0]), 1, lambda a: a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the engine keeps its choice
        got2 = _attend_all(eng, *(a[None] for a in tokens[1]), 1, lambda a: a)
    assert eng.launcher.compiled_layers() is None
    np.testing.assert_array_equal(got, _attend_all(python, *(a[None] for a in tokens[0]), 1, lambda a: a))
    np.testing.assert_array_equal(got2, _attend_all(python, *(a[None] for a in tokens[1]), 1, lambda a: a))
    q, k, v = tokens[0]
    strict = mt.Engine(cfg, arch=compiled_arch, launch="capi")
    with pytest.raises(EngineError, match=r"launch='capi': libtaichi_c_api.so did not load \(simulated\)"):
        with strict.token() as t:
            t.attend(0, q[0], k[0], v[0])
    assert strict.position == 0 and strict.open_token is None


def test_capi_is_refused_where_the_planes_are_not_the_c_apis(arch):
    if arch in ("cpu", "cuda"):
        pytest.skip("the C-API serves this backend")
    eng = mt.Engine(geometry(**GEOMETRIES["gqa4-d64"]), arch=arch, launch="capi")
    with pytest.raises(EngineError, match=rf"launch='capi': .* on {arch} the planes live in the Python runtime's"):
        with eng.token() as t:
            t.attend(0, np.zeros((8, 64), np.float32), np.zeros((2, 64), np.float32), np.zeros((2, 64), np.float32))
    assert eng.position == 0 and eng.open_token is None


def test_launch_option_is_checked():
    with pytest.raises(EngineError, match=r"launch='fast'; expected one of \['auto', 'capi', 'python'\]"):
        mt.Engine(geometry(**GEOMETRIES["gqa4-d64"]), arch="cpu", launch="fast")


def test_the_aot_module_is_compiled_once_and_then_loaded(tmp_path, monkeypatch):
    """A cold cache compiles the layer's kernels into a module folder; the next engine of the geometry loads it."""
    monkeypatch.setenv(aot.CACHE_ENV, str(tmp_path))
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    first = mt.Engine(cfg, arch="cpu", launch="capi").launcher.compiled_layers()
    second = mt.Engine(cfg, arch="cpu", launch="capi").launcher.compiled_layers()
    assert first.compiled and not second.compiled
    folders = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(folders) == 1 and (folders[0] / aot.COMPLETE).is_file(), folders
    other = mt.Engine(geometry(**GEOMETRIES["gqa16-d128"]), arch="cpu", launch="capi").launcher.compiled_layers()
    assert other.compiled and len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


def test_the_c_api_runtime_runs_without_fast_math():
    """capi.strict_fp found Taichi 1.7.4's CompileConfig where it expects it and turned fast_math off; a layout it
    does not recognise is refused with nothing written."""
    rt = layer_launch.runtime("cpu")
    import ctypes

    config = ctypes.c_void_p.from_address(rt.handle + capi.CONFIG_POINTER_OFFSET).value
    raw = (ctypes.c_uint8 * 48).from_address(config)
    assert raw[capi.FAST_MATH_OFFSET] == 0
    assert tuple(raw[4:8]) == capi.CONFIG_SIGNATURE[4]
    # a fake runtime whose configuration is not laid out as expected
    fake_config = (ctypes.c_uint8 * 48)(*([7] * 48))
    fake_runtime = (ctypes.c_uint8 * (capi.CONFIG_POINTER_OFFSET + 8))()
    ctypes.c_void_p.from_address(ctypes.addressof(fake_runtime) + capi.CONFIG_POINTER_OFFSET).value = \
        ctypes.addressof(fake_config)
    with pytest.raises(capi.CApiError, match="not laid out as Taichi 1.7.4's"):
        capi.strict_fp(ctypes.addressof(fake_runtime), "cpu")
    assert list(fake_config) == [7] * 48


def test_cuda_graph_capture_is_refused_naming_why(compiled_arch):
    if compiled_arch != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    torch = pytest.importorskip("torch")
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    eng = mt.Engine(cfg, arch="cuda", launch="capi")
    s = Session(eng, seed=1)
    s.prefill(10)
    q, k, v = (torch.from_numpy(a).cuda() for a in s.token())
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(layer_launch.CaptureRefused, match="cannot be captured in a CUDA graph: Taichi 1.7.4's kernel "
                                                          "launcher allocates"):
        with torch.cuda.graph(graph, capture_error_mode="relaxed"):
            with eng.token() as t:
                t.attend(0, q[0], k[0], v[0])
    assert eng.position == 10 and eng.open_token is None


def test_auto_takes_the_python_path_on_cuda(compiled_arch):
    """The C-API path on CUDA gives the Python path's bits (test_compiled_and_python_launches_give_the_same_bits on
    an H100) but is not measured cheaper there: the default keeps the path every CUDA figure ran on, and
    launch="capi" opts in."""
    if compiled_arch != "cuda":
        pytest.skip("a CUDA default; launch='auto' takes the C-API on the CPU")
    eng = mt.Engine(geometry(**GEOMETRIES["gqa4-d64"]), arch="cuda", launch="auto")
    assert eng.launcher.compiled_layers() is None
