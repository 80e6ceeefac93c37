"""Correct on every accepted input, and nothing lost: what a hostile or careless user can hand the engine.

Each case goes through the public API and compares the engine with a twin that never saw the bad input,
bit for bit (planes, plane states, position, route counts), or shows the default settings within their
documented bound on inputs that are accepted.
"""

import os
import stat
import sys

import numpy as np
import pytest
import taichi as ti
import yaml

import muser_ti as mt
from muser_ti import EngineError, SnapshotError, ladder, snapshot
from muser_ti.reference import relative_error
from muser_ti.tolerances import F32_ROUTE_RTOL_LARGE, LLAMA_CPU_VTOL
from sessions import GEOMETRIES, Session, geometry

D64 = GEOMETRIES["gqa4-d64"]


def state(eng):
    """Everything the next token depends on, as plain data: the whole planes, their states, position, counts."""
    out = {"position": eng.position, "route_counts": dict(eng.route_counts), "routes": list(eng.routes)}
    for kind, (k, v, st) in eng.planes_snapshot().items():
        out[kind] = (k.copy(), v.copy(), st)
    return out


def assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], tuple):
            np.testing.assert_array_equal(a[key][0], b[key][0], err_msg=key)
            np.testing.assert_array_equal(a[key][1], b[key][1], err_msg=key)
            assert a[key][2] == b[key][2], key
        else:
            assert a[key] == b[key], key


# ---- 1. the default settings stay within their bound on every accepted input ------------------------------

def hostile_sessions(n_rows, v_value=None, shift=None, seed=0):
    """Tokens that llama.cpp's f16 V accumulator does not survive: flat attention (q = 0) over many rows of one
    value, or random q/k with one V channel shifted far from the rest."""
    rng = np.random.default_rng(seed)
    cfg = mt.geometry_from_dict(dict(name="hostile", n_heads=32, n_kv_heads=2, head_dim=128, n_layers=1,
                                     layer_pattern=["nope"], window=n_rows + 1, max_context=n_rows + 1,
                                     attention_scale="auto"))
    k = rng.standard_normal((n_rows, 1, 2, 128)).astype(np.float32)
    if v_value is not None:
        v = np.full_like(k, v_value)
        q = np.zeros((1, 32, 128), np.float32)
    else:
        v = rng.standard_normal(k.shape).astype(np.float32)
        v[..., 5] += shift
        q = rng.standard_normal((1, 32, 128)).astype(np.float32)
    return cfg, k, v, q


@pytest.mark.parametrize("n_rows, v_value, shift", [(96, 1100.0, None), (2001, 40.0, None), (8193, 1.0, None),
                                                    (2001, None, 30.0)])
def test_default_settings_stay_within_their_bound_where_llamas_cpu_kernel_does_not(arch, n_rows, v_value, shift):
    """pinned='auto' (the default) takes the project's own routes: within their f32 bound on inputs where
    llama.cpp's CPU kernel (pinned='on', an f16 V accumulator) leaves its own: inf at 96 rows of V = 1100,
    35.3 instead of 40 over 2,001 rows, half the value over 8,193 rows of V = 1."""
    cfg, k, v, q = hostile_sessions(n_rows, v_value, shift)
    eng = mt.Engine(cfg, arch=arch)  # the defaults
    eng.prefill(k[:-1], v[:-1])
    out = eng.step(q, k[-1], v[-1])
    assert eng.routes == [ladder.INTERLEAVED] and not eng.pinned_loaded
    ref = eng.reference(q, k[-1], v[-1])
    assert np.isfinite(out).all() and relative_error(out, ref) <= F32_ROUTE_RTOL_LARGE
    if mt.pinned_library_status(arch)[0]:  # why the rung is opt-in: the same tokens through it
        rung = mt.Engine(cfg, arch=arch, pinned="on")
        rung.prefill(k[:-1], v[:-1])
        with np.errstate(invalid="ignore"):
            theirs = rung.step(q, k[-1], v[-1])
        assert rung.routes == [ladder.LLAMA_VEC_NOPE]
        vmax = float(np.abs(v.astype(np.float16)).max())
        assert not (np.abs(theirs - ref).max() <= LLAMA_CPU_VTOL * vmax)  # past its bound, or not finite


# ---- 2. every argument checked by one rule set ------------------------------------------------------------

def test_q_outside_the_f16_range_is_refused_with_nothing_written(arch):
    cfg = geometry(window=32, **D64)
    s = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=1)
    twin = mt.Engine(cfg, arch=arch, pinned="off")
    s.prefill(40, also=twin)
    q, k, v = s.token()
    q[2, 3, 7] = 70000.0
    with pytest.raises(EngineError, match=r"q: value 70000 at layer 2, head 3, d 7 is outside the f16 range"):
        s.eng.step(q, k, v)
    out = ti.ndarray(ti.f32, q.shape)
    with pytest.raises(EngineError, match=r"q: value 70000 at layer 2, head 3, d 7"):
        s.eng.step_device(*[_device(a) for a in (q, k, v)], out)
    assert_same_state(state(s.eng), state(twin))
    q[2, 3, 7] = -65504.0  # the edge of the range is accepted
    np.testing.assert_array_equal(s.eng.step(q, k, v), twin.step(q, k, v))


def _device(a):
    d = ti.ndarray(ti.f32, a.shape)
    d.from_numpy(a)
    return d


def test_capacity_is_checked_against_the_plane_limit_before_anything_is_allocated(arch):
    cfg = geometry(window=32, **D64)
    for bad, fragment in ((2 ** 25, r"capacity=33554432: the swa plane would hold .* past the 2\*\*31"),
                          (2 ** 24, r"expected at most"), (True, "expected an integer, got bool"),
                          (np.bool_(True), "expected an integer"), (0, "expected a positive integer"),
                          (32.0, "expected an integer, got float")):
        with pytest.raises(EngineError, match=fragment):
            mt.Engine(cfg, arch=arch, pinned="off", capacity=bad)
    eng = mt.Engine(cfg, arch=arch, pinned="off", capacity=np.int64(48))  # a numpy integer is an integer
    assert eng.planes["swa"].cap == 48 and isinstance(eng.planes["swa"].cap, int)


def test_masked_arrays_are_refused_not_read_without_their_mask(arch):
    cfg = geometry(window=32, **D64)
    s = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=2)
    s.prefill(10)
    before = state(s.eng)
    q, k, v = s.token()
    with pytest.raises(EngineError, match="not a masked one"):
        s.eng.step(q, np.ma.masked_array(k, mask=k > 1), v)
    kp = np.ones((3, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), np.float32)
    with pytest.raises(EngineError, match="not a masked one"):
        s.eng.prefill(np.ma.masked_array(kp), kp)
    assert_same_state(before, state(s.eng))


# ---- 3. the serving graph refuses a rewind it cannot serve --------------------------------------------------

def test_serving_refuses_a_rewind_its_cells_cannot_serve_and_teacher_takes_it(arch, tmp_path):
    """Window 200 and slack 400: the ring rolls back 400 tokens, but llama.cpp's cache keeps GGML_PAD(200 +
    n_ubatch 64, 256) = 512 cells, 312 tokens past the window; a rewind of 350 is refused by the serving graph
    (state unchanged) and served right by the teacher graph."""
    if not mt.pinned_library_status(arch)[0]:
        pytest.skip(f"the serving graph needs the pinned rung: {mt.pinned_library_status(arch)[1]}")
    cfg = mt.geometry_from_dict(dict(name="slack", n_heads=8, n_kv_heads=2, head_dim=64, n_layers=2,
                                     layer_pattern=["swa", "nope"], window=200, swa_ring_slack=400, max_context=4096,
                                     attention_scale="auto", n_ubatch=64))
    serving = Session(mt.Engine(cfg, arch=arch, pinned="on", graph="serving"), seed=3)
    teacher = mt.Engine(cfg, arch=arch, pinned="on", graph="teacher")
    serving.prefill(900, also=teacher)
    assert serving.eng.cache.serving.cells == 512
    before = state(serving.eng)
    with pytest.raises(EngineError, match=r"cannot rewind to 550: the serving graph's llama.cpp cells \(512\) no longer "
                                          r"hold token 351, which the next token attends"):
        serving.eng.rewind(550)
    assert_same_state(before, state(serving.eng))
    teacher.rewind(550)
    serving.eng.rewind(900 - 300)  # within the cells' room: taken
    assert serving.eng.position == 600


# ---- 4. a step is atomic: an exception anywhere leaves it done or not done ------------------------------------

class InjectAt:
    """A tracer that raises KeyboardInterrupt at the n-th line the package executes (then stops raising).
    interrupts.held_back's own lines are left alone: it is what holds a real SIGINT back, and nothing in them
    raises (an exception injected as it restores the handler would leave its own installed)."""

    def __init__(self, n):
        self.n, self.seen, self.fired = n, 0, False
        self.root = os.path.dirname(mt.__file__)
        self.exempt = os.path.join(self.root, "interrupts.py")

    def __call__(self, frame, event, arg):
        name = frame.f_code.co_filename
        if not name.startswith(self.root) or name == self.exempt:
            return None
        if event == "line" and not self.fired:
            self.seen += 1
            if self.seen == self.n:
                self.fired = True
                raise KeyboardInterrupt(f"injected at line {self.n}: {frame.f_code.co_filename}:{frame.f_lineno}")
        return self


@pytest.mark.parametrize("call", ["step", "prefill", "rewind"])
def test_an_exception_at_any_line_of_a_call_leaves_it_done_or_not_done(tmp_path, call):
    """A full ring with slack (a step overwrites its oldest row, which a later rewind within the slack needs) and a
    NoPE plane about to grow.  For every line the call executes: an injected KeyboardInterrupt there, then the
    engine must equal, bit for bit, either the twin that never made the call or the twin that made it, and
    the session must go on right from there: a rewind within the slack, then steps."""
    cfg = geometry(window=32, slack=8, **D64)
    base = Session(mt.Engine(cfg, arch="cpu", pinned="off"), seed=4)
    base.prefill(63)  # ring of 40 full and wrapped; NoPE plane of 64 rows: the next step holds its last row
    base.step()  # position 64: the next append grows the NoPE plane
    path = tmp_path / "base.safetensors"
    base.eng.save(path)
    rng = np.random.default_rng(9)
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    token = (rng.standard_normal((L, H, D)).astype(np.float32), rng.standard_normal((L, KV, D)).astype(np.float32),
             rng.standard_normal((L, KV, D)).astype(np.float32))
    rows = rng.standard_normal((3, L, KV, D)).astype(np.float32)
    later = [tuple(rng.standard_normal(a.shape).astype(np.float32) for a in token) for _ in range(3)]

    def make(pinned="off"):
        return mt.Engine.from_snapshot(path, arch="cpu", pinned=pinned)

    def act(eng):
        if call == "step":
            eng.step(*token)
        elif call == "prefill":
            eng.prefill(rows, rows * 0.5)
        else:
            eng.rewind(eng.position - 2)

    def go_on(eng):
        """A rewind within the slack (8 rows, 7 with the call's) and steps: what a wrongly overwritten row or
        position would show."""
        eng.rewind(eng.position - 5)
        return [eng.step(*t) for t in later]

    not_done, done = make(), make()
    act(done)
    want = {"not done": (state(not_done), go_on(not_done)), "done": (state(done), go_on(done))}
    n, fired = 0, True
    while fired:
        n += 1
        eng = make()
        tracer, outer = InjectAt(n), sys.gettrace()
        sys.settrace(tracer)
        try:
            act(eng)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(outer)
        fired = tracer.fired
        got = state(eng)
        which = "done" if got["position"] == want["done"][0]["position"] else "not done"
        assert_same_state(want[which][0], got)
        for a, b in zip(want[which][1], go_on(eng)):
            np.testing.assert_array_equal(a, b, err_msg=f"injected at line {n} ({which})")
    assert n > 20  # the call's lines were all visited


def test_ctrl_c_during_a_commit_lands_after_it(monkeypatch, default_sigint):
    """SIGINT during the commit section is held back to its end: the token is written and counted, then the
    KeyboardInterrupt arrives."""
    import signal

    cfg = geometry(window=32, **D64)
    s = Session(mt.Engine(cfg, arch="cpu", pinned="off"), seed=5)
    twin = mt.Engine(cfg, arch="cpu", pinned="off")
    s.prefill(20, also=twin)
    q, k, v = s.token()
    real = s.eng.cache.commit

    def commit_with_ctrl_c(*args):
        signal.raise_signal(signal.SIGINT)  # arrives while the commit runs
        real(*args)

    monkeypatch.setattr(s.eng.cache, "commit", commit_with_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        s.eng.step(q, k, v)
    twin.step(q, k, v)
    assert_same_state(state(s.eng), state(twin))


# ---- 5. snapshots are untrusted input -----------------------------------------------------------------------

def forge(path, tensors, meta):
    """A file with a valid checksum (anyone can compute one), to reach the checks behind it."""
    from safetensors.numpy import save_file
    import json

    meta_json = json.dumps(meta, sort_keys=True)
    tensors = {name: np.ascontiguousarray(a) for name, a in tensors.items()}
    save_file(tensors, str(path), metadata={"muser_ti": meta_json, "sha256": snapshot._checksum(meta_json, tensors)})


def saved(cfg, arch, n=50, **kwargs):
    s = Session(mt.Engine(cfg, arch=arch, pinned="off", **kwargs), seed=6)
    s.prefill(n)
    tensors, session = s.eng.snapshot_contents()
    return s.eng, tensors, snapshot.file_meta(cfg, session)


@pytest.mark.parametrize("edit, fragment", [
    (lambda t, m: t["swa.k"].__setitem__((0, 3, 1, 5), np.float16(np.nan)), r"'swa.k' holds nan"),
    (lambda t, m: t["nope.v"].__setitem__((0, 1, 2, 3), np.float16(np.inf)), r"'nope.v' holds inf"),
    (lambda t, m: m["route_counts"].__setitem__("splitk", -3), "route_counts"),
    (lambda t, m: m["route_counts"].__setitem__("made_up", 1), "route_counts"),
    (lambda t, m: m["route_counts"].__setitem__("splitk", 1.5), "route_counts"),
    (lambda t, m: m["routes"].__setitem__(0, "made_up"), "routes"),
])
def test_a_forged_file_with_a_valid_checksum_is_refused_and_changes_nothing(arch, tmp_path, edit, fragment):
    cfg = geometry(window=32, **D64)
    src, tensors, meta = saved(cfg, arch)
    edit(tensors, meta)
    path = tmp_path / "forged.safetensors"
    forge(path, tensors, meta)
    eng = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=7).eng
    eng.prefill(np.ones((5, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), np.float32),
                np.ones((5, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), np.float32))
    before = state(eng)
    with pytest.raises(SnapshotError, match=fragment):
        eng.load(path)
    assert_same_state(before, state(eng))
    with pytest.raises(SnapshotError, match=fragment):
        mt.Engine.from_snapshot(path, arch=arch, pinned="off")


def test_a_small_file_cannot_make_a_load_allocate_what_it_names(arch, tmp_path):
    """An empty session whose file names a NoPE plane of max_context rows (a few hundred bytes) loads into the
    plane an empty session has, not into the one the file names."""
    cfg = mt.geometry_from_dict(dict(name="big", n_heads=8, n_kv_heads=2, head_dim=64, n_layers=2,
                                     layer_pattern=["nope"], window=1, max_context=1 << 20, attention_scale="auto"))
    src, tensors, meta = saved(cfg, arch, n=0)
    meta["planes"]["nope"]["capacity"] = 1 << 20
    path = tmp_path / "small.safetensors"
    forge(path, tensors, meta)
    assert path.stat().st_size < 4096
    eng = mt.Engine.from_snapshot(path, arch=arch, pinned="off")
    assert eng.planes["nope"].state.capacity == 64 and eng.position == 0
    s = Session(eng, seed=8)
    for _ in range(3):
        s.step()


def test_a_snapshot_with_a_serving_cell_out_of_place_is_refused(tmp_path):
    if not mt.pinned_library_status("cpu")[0]:
        pytest.skip(f"the serving graph needs the pinned rung: {mt.pinned_library_status('cpu')[1]}")
    cfg = geometry(window=32, **D64)
    s = Session(mt.Engine(cfg, arch="cpu", pinned="on", graph="serving"), seed=9)
    s.prefill(30)
    tensors, session = s.eng.snapshot_contents()
    tensors["serving.pos"][3] = 29  # token 29 belongs in cell 29
    path = tmp_path / "cells.safetensors"
    forge(path, tensors, snapshot.file_meta(cfg, session))
    with pytest.raises(SnapshotError, match="serving.pos"):
        s.eng.load(path)


def test_save_refuses_what_is_not_a_regular_file_and_clears_stray_temporaries(arch, tmp_path):
    cfg = geometry(window=32, **D64)
    eng = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=10).eng
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    for target in (fifo, folder, "/dev/null"):
        with pytest.raises(SnapshotError, match="exists and is not a regular file"):
            eng.save(target)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and folder.is_dir()
    stray = tmp_path / ".s.safetensors.abc123.tmp"  # what an interrupted save leaves
    stray.write_bytes(b"partial")
    eng.save(tmp_path / "s.safetensors")
    assert not stray.exists() and (tmp_path / "s.safetensors").is_file()


# ---- 6. configs ---------------------------------------------------------------------------------------------

def test_an_alias_bomb_is_refused_at_once_with_a_short_message(tmp_path):
    levels = ['a0: &a0 ["xxxxxxxxxxxxxxxx","xxxxxxxxxxxxxxxx","xxxxxxxxxxxxxxxx","xxxxxxxxxxxxxxxx"]']
    for i in range(1, 10):
        levels.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(levels) + "\nname: *a9\n")
    assert path.stat().st_size < 1024
    with pytest.raises(mt.ConfigError, match="aliases") as info:  # refused while composing, before any expansion
        mt.load_config(path)
    assert len(str(info.value)) < 500


@pytest.mark.parametrize("text, fragment", [
    ("name: a\nname: b\n", "duplicate key 'name'"),
    ("head_dim: 64.0\n", "head_dim': got 64.0; expected one of the integers"),
    ("attention_scale: 1.0e+39\n", "attention_scale': got 1e\\+39; expected 'auto' .* or a number in"),
    ("n_layers: 4096\nn_heads: 1024\nhead_dim: 256\nlayer_pattern: [nope]\n", "a token of at most"),
])
def test_a_bad_config_names_its_field(tmp_path, text, fragment):
    base = dict(name="t", n_heads=8, n_kv_heads=2, head_dim=64, n_layers=2, layer_pattern=["swa", "nope"], window=8,
                max_context=64, attention_scale="auto")
    own = yaml.safe_load(text) if "name: a\nname" not in text else {}
    body = yaml.safe_dump({k: v for k, v in base.items() if k not in own}) + text
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(mt.ConfigError, match=fragment) as info:
        mt.load_config(path)
    assert str(path) in str(info.value)
