"""Snapshots: a resumed session is bit-identical to one that never stopped; bad files change nothing.

Every scenario saves a session in one plane state (empty, tiny, tiny and wrapped, wrapped, partially
wrapped, a NoPE plane that has grown), then runs the same continuation (steps with a rewind in the
middle) three ways: on the engine that never stopped, on a new engine made from the file, and on an
engine with other history that loads the file.  Outputs and routes must agree bit for bit, on every
route: the project's own kernels (pinned='off'), the pinned llama rung, and the serving graph.
"""

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

import muser_ti as mt
from muser_ti import snapshot
from muser_ti.errors import SnapshotError
from muser_ti.planes import fresh_capacity
from sessions import GEOMETRIES, Session, covering_product, geometry, not_on_lavapipe, token_stream as tokens

D64 = GEOMETRIES["gqa4-d64"]


# ---- scenarios: (geometry kwargs, Engine capacity, how to drive the session before the save) --------
def _drive(n_prefill, n_steps, rewind=0):
    def drive(s):
        if n_prefill:
            s.prefill(n_prefill)
        for _ in range(n_steps):
            s.step(check=False)
        if rewind:
            s.rewind(s.eng.position - rewind)
    return drive


SCENARIOS = {
    # nothing written yet
    "empty": (dict(window=48, slack=16), None, _drive(0, 0), lambda st: st["swa"].len == 0),
    # a deliberately tiny session: every plane below 32 rows (the vec routes are never eligible)
    "tiny": (dict(window=16), 20, _drive(8, 4), lambda st: st["swa"].capacity == 20 and st["nope"].capacity == 20),
    # tiny and wrapped: a 20-row ring (window 16) that has gone round twice
    "tiny-wrapped": (dict(window=16, n_layers=2, pattern=("swa", "swa")), 20, _drive(40, 5),
                     lambda st: st["swa"].is_wrapped and st["swa"].len == 20),
    # a full ring that has wrapped, and a NoPE plane grown past its first allocation (64 -> 256)
    "wrapped": (dict(window=48, slack=16), None, _drive(140, 6),
                lambda st: st["swa"].is_wrapped and st["swa"].len == 64 and st["nope"].capacity == 256),
    # partially wrapped: rolled back into the slack (origin_physical != 0, len < capacity)
    "partial": (dict(window=48, slack=16), None, _drive(140, 12, rewind=9),
                lambda st: st["swa"].is_partially_wrapped),
    # rewound below a growth: the NoPE plane holds 64 rows in a 128-row allocation, and a load gives it 64
    "rewound-below-growth": (dict(window=48, slack=16), None, _drive(66, 0, rewind=2),
                             lambda st: st["nope"].len == 64 and st["nope"].capacity == 128),
}

MODES = {  # Engine kwargs per route family
    "own": dict(pinned="off"),
    "pinned": dict(pinned="on"),
    "serving": dict(pinned="on", graph="serving"),
}


def continuation(eng, toks):
    """5 steps, a rewind of 2, 5 steps: outputs and routes of every step."""
    outs = []
    for i, tok in enumerate(toks):
        if i == 5:
            eng.rewind(eng.position - 2)
        outs.append((eng.step(*tok), list(eng.routes)))
    return outs


def assert_same_outputs(a, b):
    assert len(a) == len(b)
    for i, ((oa, ra), (ob, rb)) in enumerate(zip(a, b)):
        assert ra == rb, f"step {i}: routes {ra} vs {rb}"
        np.testing.assert_array_equal(oa, ob, err_msg=f"step {i}")


def live(eng):
    """Everything the next token depends on: ring planes whole, NoPE rows [0, len), states, position."""
    out = {"position": eng.position, "route_counts": dict(eng.route_counts)}
    for kind, (k, v, st) in eng.planes_snapshot().items():
        if kind == "nope":
            k, v = k[:, :, : st.len], v[:, :, : st.len]
        out[kind] = (k, v, st)
    if eng.cache.serving is not None:
        out["serving"] = (eng.cache.serving.k.copy(), eng.cache.serving.v.copy(), eng.cache.serving.pos.copy())
    return out


def assert_live_equal(a, b, loaded=None):
    """a and b hold the same state.  ``loaded``: b's engine, which has loaded a snapshot since a was taken;
    then its NoPE plane's allocation is at least what its rows need (planes.fresh_capacity, what a load
    gives it) and at most what a's engine had grown to, which after a rewind can be more (a file does not
    choose how much memory a load takes)."""
    assert a.keys() == b.keys()
    assert a["position"] == b["position"] and a["route_counts"] == b["route_counts"]
    for key in a.keys() - {"position", "route_counts"}:
        for x, y in zip(a[key], b[key]):
            if isinstance(x, np.ndarray):
                np.testing.assert_array_equal(x, y, err_msg=key)
            elif key == "nope" and loaded is not None:
                assert dataclasses.replace(x, capacity=y.capacity) == y, key
                cap = loaded.planes["nope"].cap
                need = fresh_capacity(cap, y.len)
                assert need <= y.capacity <= max(x.capacity, need), (key, x.capacity, y.capacity)
            else:
                assert x == y, key


def needs(mode, arch):
    kwargs = MODES[mode]
    if kwargs["pinned"] == "on" and not mt.pinned_library_status(arch)[0]:
        pytest.skip(f"the pinned rung is not loaded for arch {arch}: {mt.pinned_library_status(arch)[1]}")
    return kwargs


# the plane states a snapshot holds, and the engine modes that keep other state (pinned rung, serving cells):
# lavapipe runs a covering set (its part is the planes' copy to and from the device)
@pytest.mark.parametrize("scenario, mode", covering_product(list(SCENARIOS), list(MODES)))
def test_resumed_session_is_bit_identical(arch, tmp_path, scenario, mode):
    kwargs = needs(mode, arch)
    geom_kw, capacity, drive, state_ok = SCENARIOS[scenario]
    cfg = geometry(**{**D64, **geom_kw})
    a = mt.Engine(cfg, arch=arch, capacity=capacity, **kwargs)
    drive(Session(a, seed=1))
    assert state_ok({kind: ps.state for kind, ps in a.planes.items()}), scenario
    path = tmp_path / "session.safetensors"
    a.save(path)
    saved = live(a)
    toks = tokens(cfg, 10, seed=2)
    never_stopped = continuation(a, toks)

    # 1. a new engine from the file
    b = mt.Engine.from_snapshot(path, arch=arch, **kwargs)
    assert_live_equal(saved, live(b), loaded=b)
    assert_same_outputs(never_stopped, continuation(b, toks))
    # 2. the engine that went on, loaded back (a rollback further than any ring's slack)
    a.load(path)
    assert_live_equal(saved, live(a), loaded=a)
    assert_same_outputs(never_stopped, continuation(a, toks))
    # 3. an engine with other history (its NoPE plane grown differently) loading the file
    c = mt.Engine(cfg, arch=arch, capacity=capacity, **kwargs)
    Session(c, seed=3).prefill(min(30, capacity or 30))
    c.load(path)
    assert_live_equal(saved, live(c), loaded=c)
    assert_same_outputs(never_stopped, continuation(c, toks))


def test_snapshot_holds_what_the_issue_lists(arch, tmp_path):
    """Header metadata: format, version, geometry, position, and per plane len/capacity/origins."""
    from safetensors import safe_open

    cfg = geometry(window=48, slack=16, **D64)
    eng = mt.Engine(cfg, arch=arch, pinned="off")
    SCENARIOS["partial"][2](Session(eng, seed=1))
    eng.save(tmp_path / "s.safetensors")
    with safe_open(str(tmp_path / "s.safetensors"), framework="numpy") as f:
        meta = json.loads(f.metadata()["muser_ti"])
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    assert meta["format"] == "muser-ti-snapshot" and meta["version"] == 1
    assert mt.geometry_from_dict(meta["geometry"]) == cfg
    assert meta["position"] == eng.position
    for kind, ps in eng.planes.items():
        st = ps.state
        assert meta["planes"][kind] == dict(len=st.len, capacity=st.capacity, origin_logical=st.origin_logical,
                                            origin_physical=st.origin_physical, cap=ps.cap)
    # live rows only: the whole ring, NoPE rows [0, len) (not its 256-row allocation)
    assert shapes["swa.k"] == [3, 64, 2, 64]
    assert shapes["nope.k"] == [1, 2, eng.planes["nope"].state.len, 64]


# ---- atomic writes -----------------------------------------------------------------------------------
def test_a_crash_mid_save_leaves_the_old_file(arch, tmp_path, monkeypatch):
    import safetensors.numpy

    cfg = geometry(window=48, slack=16, **D64)
    eng = mt.Engine(cfg, arch=arch, pinned="off")
    s = Session(eng, seed=1)
    s.prefill(50)
    path = tmp_path / "s.safetensors"
    eng.save(path)
    old = path.read_bytes()
    s.step(check=False)

    def crash(tensors, filename, metadata=None):  # half a file written, then the process "dies"
        real(tensors, filename, metadata=metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        raise KeyboardInterrupt("simulated crash mid-save")

    real = safetensors.numpy.save_file
    monkeypatch.setattr(safetensors.numpy, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        eng.save(path)
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["s.safetensors"], "the temporary file was not cleaned up"


def test_save_into_a_missing_folder_names_the_folder(arch, tmp_path):
    """Not a bare FileNotFoundError naming the hidden temporary file: a SnapshotError naming the folder."""
    eng = mt.Engine(geometry(**D64), arch=arch, pinned="off")
    Session(eng, seed=1).prefill(3)
    missing = tmp_path / "no-such-folder"
    with pytest.raises(SnapshotError, match=f"the folder {missing} does not exist") as caught:
        eng.save(missing / "s.safetensors")
    assert ".tmp" not in str(caught.value)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SnapshotError, match="is not a folder"):
        eng.save(tmp_path / "a-file" / "s.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_no_prefix_of_a_snapshot_loads(arch, tmp_path):
    """What a crash could leave at the temporary name (any prefix of the file) never loads."""
    cfg = geometry(window=16, slack=4, **D64)
    eng = mt.Engine(cfg, arch=arch, pinned="off")
    Session(eng, seed=1).prefill(30)
    path = tmp_path / "s.safetensors"
    eng.save(path)
    data = path.read_bytes()
    bad = tmp_path / "cut.safetensors"
    for cut in sorted({0, 1, 7, 8, 9, 50, 200, len(data) // 3, len(data) // 2, len(data) - 2, len(data) - 1}):
        bad.write_bytes(data[:cut])
        with pytest.raises(SnapshotError, match="truncated or corrupt|not a muser-ti snapshot"):
            snapshot.read(bad)


# ---- refused files leave the engine unchanged -----------------------------------------------------
def forge(path, tensors, meta):
    """Write a file with a *valid* checksum, to reach the checks behind it."""
    from safetensors.numpy import save_file

    meta_json = json.dumps(meta, sort_keys=True)
    tensors = {name: np.ascontiguousarray(a) for name, a in tensors.items()}  # save_file mangles strided arrays
    save_file(tensors, str(path), metadata={"muser_ti": meta_json, "sha256": snapshot._checksum(meta_json, tensors)})


def _flip_byte(path, at):
    data = bytearray(Path(path).read_bytes())
    data[at] ^= 0x10
    Path(path).write_bytes(bytes(data))


def _edit_meta(**changes):
    def edit(tensors, meta):
        meta.update(changes)
    return edit


def _edit_plane(kind, **changes):
    def edit(tensors, meta):
        meta["planes"][kind].update(changes)
    return edit


def _geometry(**changes):
    def edit(tensors, meta):
        meta["geometry"].update(changes)
    return edit


def _tensor(name, fn):
    def edit(tensors, meta):
        if fn is None:
            del tensors[name]
        else:
            tensors[name] = fn(tensors[name])
    return edit


BAD_FILES = {
    "missing file": (None, "no such file"),
    "bit flip in a plane": ("flip:-100", "checksum mismatch"),
    "bit flip in the header": ("flip:60", "truncated or corrupt|checksum mismatch|not valid JSON"),
    "truncated": ("cut", "truncated or corrupt"),
    "not a snapshot": ("plain", "not a muser-ti snapshot"),
    "other version": (_edit_meta(version=2), "format version 2; this build reads version 1"),
    "other dtype": (_edit_meta(dtype="float32"), "plane dtype 'float32'"),
    "f32 tensors": (_tensor("swa.k", lambda a: a.astype(np.float32)), "'swa.k' has dtype float32, expected float16"),
    "missing tensor": (_tensor("nope.v", None), r"missing tensor\(s\) \['nope.v'\]"),
    "wrong shape": (_tensor("swa.v", lambda a: np.ascontiguousarray(a[:, :-1])), r"'swa.v' has shape \(3, 63, 2, 64\)"),
    "other head_dim": (_geometry(head_dim=128), "saved for another geometry|has shape"),
    "other window": (_geometry(window=32, swa_ring_slack=32), r"saved for another geometry \(window: file 32 vs engine 48"),
    "other n_kv_heads": (_geometry(n_kv_heads=4), "saved for another geometry|has shape"),
    "bad origins": (_edit_plane("swa", origin_logical=3), "origin_logical 3 \\+ len 55 != position"),
    "bad geometry": (_geometry(head_dim=96), "bad geometry: .*head_dim"),
    "inconsistent caps": (_edit_plane("nope", cap=1000), "plane caps .* follow neither from the geometry"),
}


# every refusal is the host's reading of the file: lavapipe runs one, for the planes it reads back unchanged
@pytest.mark.parametrize("case", ["bad origins", *not_on_lavapipe(*(c for c in BAD_FILES if c != "bad origins"))])
def test_bad_snapshot_is_refused_and_changes_nothing(arch, tmp_path, case):
    edit, fragment = BAD_FILES[case]
    cfg = geometry(window=48, slack=16, **D64)
    src = mt.Engine(cfg, arch=arch, pinned="off")
    SCENARIOS["partial"][2](Session(src, seed=1))
    path = tmp_path / "s.safetensors"
    src.save(path)
    if edit is None:
        path.unlink()
    elif edit == "cut":
        path.write_bytes(path.read_bytes()[:-1000])
    elif edit == "plain":
        from safetensors.numpy import save_file
        save_file({"x": np.zeros(3, np.float16)}, str(path))
    elif isinstance(edit, str) and edit.startswith("flip:"):
        _flip_byte(path, int(edit.split(":")[1]))
    else:
        tensors, session = src.snapshot_contents()
        meta = snapshot.file_meta(src.cfg, session)
        edit(tensors, meta)
        forge(path, tensors, meta)

    eng = mt.Engine(cfg, arch=arch, pinned="off")  # a running session with its own history
    s = Session(eng, seed=5)
    s.prefill(70)
    s.step()
    before = live(eng)
    with pytest.raises(SnapshotError, match=fragment):
        eng.load(path)
    assert_live_equal(before, live(eng))
    if case != "other window":  # (that file is a consistent session of another geometry: it loads alone)
        with pytest.raises(SnapshotError, match=fragment):
            mt.Engine.from_snapshot(path, arch=arch, pinned="off")
    s.step()  # the session goes on, checked against the reference


def test_serving_engine_refuses_a_teacher_snapshot(arch, tmp_path):
    if not mt.pinned_library_status(arch)[0]:
        pytest.skip(f"the pinned rung is not loaded for arch {arch}")
    cfg = geometry(window=48, **D64)
    teacher = mt.Engine(cfg, arch=arch, pinned="on")
    Session(teacher, seed=1).prefill(40)
    teacher.save(tmp_path / "t.safetensors")
    serving = mt.Engine(cfg, arch=arch, pinned="on", graph="serving")
    before = live(serving)
    with pytest.raises(SnapshotError, match="saved from graph='teacher'"):
        serving.load(tmp_path / "t.safetensors")
    assert_live_equal(before, live(serving))
    # the other way round is fine: the teacher graph does not need llama's cell order (a session under way,
    # so the load has planes to restore, not an empty file)
    served = Session(serving, seed=2)
    served.prefill(40)
    for _ in range(3):
        served.step()
    serving.save(tmp_path / "s.safetensors")
    teacher.load(tmp_path / "s.safetensors")
    assert teacher.position == serving.position == 43
    served_live = live(serving)
    del served_live["serving"]  # llama's cells: the serving graph's own, which the teacher has no use for
    assert_live_equal(served_live, live(teacher))


def test_a_session_of_another_capacity_is_refused(arch, tmp_path):
    cfg = geometry(window=16, **D64)
    tiny = mt.Engine(cfg, arch=arch, pinned="off", capacity=20)
    Session(tiny, seed=1).prefill(10)
    tiny.save(tmp_path / "tiny.safetensors")
    eng = mt.Engine(cfg, arch=arch, pinned="off")
    Session(eng, seed=2).prefill(10)
    before = live(eng)
    with pytest.raises(SnapshotError, match="swa plane may hold 20 rows in the file but 16 in this engine"):
        eng.load(tmp_path / "tiny.safetensors")
    assert_live_equal(before, live(eng))
    # from_snapshot restores the session capacity with the session
    again = mt.Engine.from_snapshot(tmp_path / "tiny.safetensors", arch=arch, pinned="off")
    assert {k: ps.cap for k, ps in again.planes.items()} == {"swa": 20, "nope": 20}
