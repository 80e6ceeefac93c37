"""Many sequences at once (muser_ti/batch.py): a pool of sequence slots attended together, layer by layer.

Each sequence in a batch is held to what it gives alone: the same routes and output bits as a lone engine fed
the same prompt and tokens, and the float64 reference (over its planes and over the test's own record of its
tokens), with prompts of different lengths (one past the window, so its ring has wrapped; one short) and
sequences joining and leaving between steps.  A step is atomic over the batch: a refusal in one sequence names
it and leaves every sequence exactly as before.
"""

import gc
import warnings
import weakref

import numpy as np
import pytest

import muser_ti as mt
from muser_ti import EngineError, batch_compiled, capi
from muser_ti.config import NOPE
from muser_ti.batch import Batch
from sessions import GEOMETRIES, NOT_ON_LAVAPIPE, Session, geometry
from test_hostile import assert_same_state, state

# Glimmer's group shape and a small one; 4 layers (three SWA, one NoPE) with a 64-row window
BATCH_GEOMETRIES = {name: GEOMETRIES[name] for name in ("gqa16-d128", "gqa4-d64")}
PROMPTS = (70, 35, 50)  # past the window (the ring has wrapped), short, near it: all three wrap within 30 steps


def _prompt(batch, sessions: dict, lengths: dict, lone: dict | None = None):
    """Each sequence's prompt through batch.prompt, layer by layer; the same rows into its lone twin."""
    rows = {seq: sessions[seq].rows(n) for seq, n in lengths.items()}
    with batch.prompt(lengths) as p:
        for layer in range(batch.cfg.n_layers):
            p.store(layer, {seq: (k[:, layer], v[:, layer]) for seq, (k, v) in rows.items()})
    for seq, (k, v) in rows.items():
        sessions[seq].record_rows(k, v)
        if lone is not None and seq in lone:
            lone[seq].prefill(k, v)


def _step(batch, sessions: dict, seqs=None):
    """One token of every sequence in ``seqs`` through batch.token: (tokens per sequence, out [B, layers, H, D])."""
    seqs = batch.sequences if seqs is None else seqs
    toks = {seq: sessions[seq].token() for seq in seqs}
    q, k, v = (np.stack([toks[s][i] for s in seqs]) for i in range(3))  # [B, layers, ...]
    with batch.token(seqs) as t:
        out = np.stack([t.attend(layer, q[:, layer], k[:, layer], v[:, layer])
                        for layer in range(batch.cfg.n_layers)], axis=1)
    for seq in seqs:
        sessions[seq].record(*toks[seq][1:])
    return toks, out


def _twin_batches(cfg, arch, seed: int, steps: int = 0, launches=("auto", "auto")):
    """Two batches of three sequences fed alike (PROMPTS, then ``steps`` steps), on the launch paths ``launches``:
    (batches, their sessions)."""
    twins, sessions = [Batch(cfg, 3, arch=arch, launch=launch) for launch in launches], []
    for batch in twins:
        seqs = [batch.join() for _ in PROMPTS]
        ss = {seq: Session(batch.sequence(seq), seed=seed + seq) for seq in seqs}
        _prompt(batch, ss, dict(zip(seqs, PROMPTS)))
        for _ in range(steps):
            _step(batch, ss)
        sessions.append(ss)
    return twins, sessions


def _lone_token(eng, q, k, v):
    with eng.token() as t:
        return np.stack([t.attend(layer, q[layer], k[layer], v[layer]) for layer in range(eng.cfg.n_layers)])


# lavapipe runs one case: a batch is its sequences' own per-layer tokens, whose kernels test_token holds to step()'s
# bits on every backend; the CPU and hardware backends run all six
@pytest.mark.parametrize("geom, dist", [
    pytest.param(g, d, id=f"{g}-{d}", marks=() if (g, d) == ("gqa4-d64", "peaked") else NOT_ON_LAVAPIPE)
    for g in BATCH_GEOMETRIES for d in ("normal", "peaked", "large")])
def test_each_sequence_in_a_batch_has_its_lone_bits(arch, geom, dist):
    """Three sequences, prompts of 70 (wrapped), 35 and 50 tokens, then 30 steps: each sequence's ring wraps and its
    NoPE plane grows at its own step.  Every step, every sequence: a lone engine's routes and bits, and within the
    f32 bound of both float64 references."""
    cfg = geometry(**BATCH_GEOMETRIES[geom])
    batch = Batch(cfg, 3, arch=arch)
    seqs = [batch.join() for _ in PROMPTS]
    sessions = {seq: Session(batch.sequence(seq), seed=10 + seq, dist=dist) for seq in seqs}
    lone = {seq: mt.Engine(cfg, arch=arch) for seq in seqs}
    _prompt(batch, sessions, dict(zip(seqs, PROMPTS)), lone)
    grew, wrapped = set(), set()
    for _ in range(30):
        toks, out = _step(batch, sessions)
        for b, seq in enumerate(seqs):
            q, k, v = toks[seq]
            np.testing.assert_array_equal(out[b], _lone_token(lone[seq], q, k, v), err_msg=f"sequence {seq}")
            eng = batch.sequence(seq)
            assert eng.routes == lone[seq].routes
            sessions[seq].verify(out[b], q, k, v)
            if eng.plane_state(3).capacity > 64:
                grew.add(seq)
            if eng.plane_state(0).is_wrapped:
                wrapped.add(seq)
    assert batch.positions() == [n + 30 for n in PROMPTS]
    assert grew == set(seqs) and wrapped == set(seqs), "every sequence's ring wrapped and NoPE plane grew"
    for seq in seqs:
        assert_same_state(state(batch.sequence(seq)), state(lone[seq]))


def test_a_layer_is_one_launch_per_route_whatever_the_batch_size(arch):
    """A step of one sequence and a step of three make the same launches: per layer its route's store (splitk),
    producer and reducer over every sequence, one launch each (the rows a step may overwrite are kept in one more
    when it opens, batch.BatchToken._save_rows)."""
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    launches = {}
    for size in (1, 3):
        batch = Batch(cfg, size, arch=arch)
        seqs = [batch.join() for _ in range(size)]
        sessions = {seq: Session(batch.sequence(seq), seed=40 + seq) for seq in seqs}
        _prompt(batch, sessions, dict(zip(seqs, PROMPTS)))
        before = batch._launcher.launches
        _step(batch, sessions)
        launches[size] = batch._launcher.launches - before
        assert all(batch.sequence(s).launcher.launches == 0 for s in seqs), "no sequence launched alone"
    routes = batch.sequence(0).routes
    assert launches[1] == launches[3] == sum(3 if r == "splitk" else 2 for r in routes), launches


def test_compiled_launches_give_the_python_paths_bits(arch):
    """A batch's layers through Taichi's C-API (batch_compiled.py) and through Taichi's Python path (one compiled
    graph a layer): the same bits every step, through ring wraps and pool growth, and the same planes after."""
    if arch not in ("cpu", "cuda"):
        pytest.skip(f"a batch launches through Taichi's C-API on cpu and cuda; {arch} takes the Python path")
    cfg = geometry(**GEOMETRIES["gqa16-d128"])
    twins, sessions = _twin_batches(cfg, arch, seed=60, launches=("capi", "python"))
    assert twins[0]._launcher.compiled is not None and twins[1]._launcher.compiled is None
    for _ in range(30):
        outs = [_step(batch, ss)[1] for batch, ss in zip(twins, sessions)]
        np.testing.assert_array_equal(outs[0], outs[1])
    for seq in twins[0].sequences:
        assert_same_state(state(twins[0].sequence(seq)), state(twins[1].sequence(seq)))
    assert twins[0].sequence(0).plane_state(3).capacity > 64, "the pool grew"


def test_a_grown_pool_frees_its_old_planes(arch):
    """When the pool's growing planes double, their old allocation is freed once the step that grew them commits:
    neither the C-API's record of imported arrays nor a layer's kept arguments hold it."""
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    batch = Batch(cfg, 2, arch=arch)
    seqs = [batch.join() for _ in range(2)]
    sessions = {seq: Session(batch.sequence(seq), seed=70 + seq) for seq in seqs}
    _prompt(batch, sessions, {seqs[0]: 60, seqs[1]: 30})
    _step(batch, sessions)
    old = weakref.ref(batch.pool.k[NOPE])
    while batch.pool.capacity[NOPE] == 64:
        _step(batch, sessions)
    gc.collect()
    assert old() is None, "the pool's NoPE plane before it grew is still referenced"


def test_auto_falls_back_to_the_python_path_with_one_warning(arch, monkeypatch):
    """Where the C-API cannot load, a batch's launch="auto" warns once, naming why, and its layers take Taichi's
    Python path (the same bits); launch="capi" refuses with the same reason, naming the option."""
    if arch != "cpu":
        pytest.skip("launch='auto' takes the C-API on the CPU only (the Python path on CUDA, Vulkan and Metal)")

    def unavailable(arch):
        raise capi.CApiError("libtaichi_c_api.so did not load (simulated)")

    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    monkeypatch.setattr(batch_compiled, "runtime", unavailable)
    twins, sessions = _twin_batches(cfg, arch, seed=80, launches=("auto", "python"))
    with pytest.warns(RuntimeWarning, match=r"C-API cannot be used here \(libtaichi_c_api.so did not load"):
        outs = [_step(batch, ss)[1] for batch, ss in zip(twins, sessions)]
    assert twins[0]._launcher.compiled is None
    np.testing.assert_array_equal(outs[0], outs[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next steps say nothing
        outs = [_step(batch, ss)[1] for batch, ss in zip(twins, sessions)]
    np.testing.assert_array_equal(outs[0], outs[1])
    refused = Batch(cfg, 1, arch=arch, launch="capi")
    refused.join()
    with pytest.raises(EngineError, match=r"launch='capi': libtaichi_c_api.so did not load \(simulated\)"):
        with refused.token() as t:
            t.attend(0, *(np.ones((1, h, cfg.head_dim), np.float32) for h in (cfg.n_heads, cfg.n_kv_heads,
                                                                                cfg.n_kv_heads)))


@pytest.mark.parametrize("launch", ["capi", "python"])
def test_torch_cuda_tensors_are_read_on_the_device_with_the_host_arrays_bits(arch, launch):
    """torch CUDA tensors go to the group kernels on the device, with a row scan there (no host copy): where they lie
    on the C-API path, copied into the batch's arrays on the Python path; the bits of the same step from numpy
    arrays; a NaN in one row is refused when the step commits, naming the sequence and the layer, and every
    sequence is as before it."""
    torch = pytest.importorskip("torch")
    if arch != "cuda" or not torch.cuda.is_available():
        pytest.skip("torch CUDA tensors are read in place on arch='cuda' only (elsewhere: the host path, tested above)")
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    twins, sessions = _twin_batches(cfg, arch, seed=50, launches=("python", launch))
    cuda = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    for step in range(3):
        _, host_out = _step(twins[0], sessions[0])
        toks = {seq: sessions[1][seq].token() for seq in twins[1].sequences}
        q, k, v = (np.stack([toks[s][i] for s in twins[1].sequences]) for i in range(3))
        with twins[1].token() as t:
            dev_out = [t.attend(layer, cuda(q[:, layer]), cuda(k[:, layer]), cuda(v[:, layer]))
                       for layer in range(cfg.n_layers)]
        assert all(o.is_cuda for o in dev_out)
        for seq in twins[1].sequences:
            sessions[1][seq].record(*toks[seq][1:])
        np.testing.assert_array_equal(host_out, np.stack([o.cpu().numpy() for o in dev_out], axis=1))
    batch = twins[1]
    before = {s: state(batch.sequence(s)) for s in batch.sequences}
    toks = {seq: sessions[1][seq].token() for seq in batch.sequences}
    q, k, v = (np.stack([toks[s][i] for s in batch.sequences]) for i in range(3))
    q[2, 1, 0, 3] = np.nan
    with pytest.raises(EngineError, match=r"sequence 2 \(row 2\): attend layer 1: the device scan refused its arrays "
                                          r"\(a non-finite value in q"):
        with batch.token() as t:
            for layer in range(cfg.n_layers):
                t.attend(layer, cuda(q[:, layer]), cuda(k[:, layer]), cuda(v[:, layer]))
    for s in batch.sequences:
        assert_same_state(state(batch.sequence(s)), before[s])


def test_sequences_join_and_leave_between_steps(arch):
    """A pool of two: a third sequence is refused while both run (the message names the pool and who holds it,
    nothing changes); one leaves, the newcomer takes its slot empty, and the one still running continues with its
    lone twin's bits throughout."""
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    batch = Batch(cfg, 2, arch=arch)
    a, b = batch.join(), batch.join()
    sessions = {a: Session(batch.sequence(a), seed=1), b: Session(batch.sequence(b), seed=2)}
    lone_b = mt.Engine(cfg, arch=arch)
    _prompt(batch, sessions, {a: 12, b: 66}, {b: lone_b})
    toks, out = _step(batch, sessions)
    np.testing.assert_array_equal(out[1], _lone_token(lone_b, *toks[b]))
    before = {s: state(batch.sequence(s)) for s in (a, b)}
    with pytest.raises(EngineError, match=r"join: the pool is full: 2 of 2 slots hold sequences \[0, 1\].*"
                                          r"max_sequences > 2"):
        batch.join()
    for s in (a, b):
        assert_same_state(state(batch.sequence(s)), before[s])

    batch.leave(a)
    assert batch.sequences == [b]
    c = batch.join()
    assert c not in (a, b) and batch.sequences == [b, c] and batch.sequence(c).position == 0
    sessions[c] = Session(batch.sequence(c), seed=3)
    _prompt(batch, sessions, {c: 20})
    for _ in range(5):
        toks, out = _step(batch, sessions)
        np.testing.assert_array_equal(out[0], _lone_token(lone_b, *toks[b]))
        sessions[c].verify(out[1], *toks[c])
    # a step of some of the sequences: the others stay where they are
    _step(batch, sessions, seqs=[c])
    assert batch.positions([b, c]) == [66 + 6, 20 + 6]
    with pytest.raises(EngineError, match=r"leave: no sequence 0 in the batch \(it holds \[1, 2\]\)"):
        batch.leave(a)


@pytest.mark.parametrize("where", ["bad value", "exception between layers", "batch size"])
def test_a_refused_step_leaves_every_sequence_as_before(arch, where):
    """A NaN in one sequence's row at layer 2, an exception in the model between layers, or arrays of the wrong
    batch size: the step is abandoned for every sequence (the error names the sequence and its row), and the next
    step has the bits of a batch that never saw it."""
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    twins, sessions = _twin_batches(cfg, arch, seed=20, steps=1)
    batch = twins[0]
    before = {s: state(batch.sequence(s)) for s in batch.sequences}
    toks = {seq: sessions[0][seq].token() for seq in batch.sequences}
    q, k, v = (np.stack([toks[s][i] for s in batch.sequences]) for i in range(3))
    if where == "bad value":
        k[1, 2, 0, 5] = np.nan
        with pytest.raises(EngineError, match=r"sequence 1 \(row 1\): attend layer 2 k: non-finite value nan.*every "
                                              r"sequence's token of this step was abandoned"):
            with batch.token() as t:
                for layer in range(cfg.n_layers):
                    t.attend(layer, q[:, layer], k[:, layer], v[:, layer])
    elif where == "exception between layers":
        with pytest.raises(KeyError):
            with batch.token() as t:
                t.attend(0, q[:, 0], k[:, 0], v[:, 0])
                raise KeyError("the model raised")
    else:
        with pytest.raises(EngineError, match=r"attend layer 0 q: shape \(2, 8, 64\), expected the batch's 3 sequences"):
            with batch.token() as t:
                t.attend(0, q[:2, 0], k[:2, 0], v[:2, 0])
    assert batch._open is None
    for s in batch.sequences:
        assert_same_state(state(batch.sequence(s)), before[s])
    for s in batch.sequences:  # the refused step's tokens were never recorded: both twins are at the same step
        sessions[0][s].rng = np.random.default_rng(99 + s)
        sessions[1][s].rng = np.random.default_rng(99 + s)
    _, out = _step(batch, sessions[0])
    _, twin_out = _step(twins[1], sessions[1])
    np.testing.assert_array_equal(out, twin_out)


def test_rewind_and_snapshot_one_sequence(arch, tmp_path):
    """One sequence rewinds (the others untouched); one is saved and resumed into a new slot, bit for bit."""
    cfg = geometry(**GEOMETRIES["gqa4-d64"], slack=4)
    batch = Batch(cfg, 3, arch=arch)
    a, b = batch.join(), batch.join()
    sessions = {a: Session(batch.sequence(a), seed=5), b: Session(batch.sequence(b), seed=6)}
    _prompt(batch, sessions, {a: 70, b: 30})
    for _ in range(4):
        _step(batch, sessions)
    held_b = state(batch.sequence(b))
    batch.rewind(a, 72)
    sessions[a].truncate(72)
    assert batch.positions() == [72, 34]
    assert_same_state(state(batch.sequence(b)), held_b)

    path = tmp_path / "a.safetensors"
    batch.sequence(a).save(path)
    c = batch.join(snapshot=path)
    assert batch.sequence(c).position == 72
    assert [batch.sequence(c).plane_state(layer) for layer in range(4)] == \
        [batch.sequence(a).plane_state(layer) for layer in range(4)]
    q, k, v = sessions[a].token()
    outs = []
    for seq in (a, c):
        with batch.token([seq]) as t:
            outs.append(np.stack([t.attend(layer, q[None, layer], k[None, layer], v[None, layer])[0]
                                  for layer in range(cfg.n_layers)]))
    np.testing.assert_array_equal(outs[0], outs[1])
    sessions[a].record(k, v)
    sessions[a].verify(outs[0], q, k, v)


def test_every_sequence_saved_and_resumed(arch, tmp_path):
    """Batch.save writes a file a sequence; Batch.resume joins them all into another pool, bit for bit (the next
    step's outputs equal); too few free slots are refused whole, and a damaged file takes back what it joined."""
    cfg = geometry(**GEOMETRIES["gqa4-d64"])
    batch = Batch(cfg, 2, arch=arch)
    seqs = [batch.join(), batch.join()]
    sessions = {s: Session(batch.sequence(s), seed=30 + s) for s in seqs}
    _prompt(batch, sessions, {seqs[0]: 70, seqs[1]: 9})
    _step(batch, sessions)
    paths = batch.save(tmp_path)
    assert [p.name for p in paths] == ["seq-0.safetensors", "seq-1.safetensors"]
    other = Batch(cfg, 3, arch=arch)
    with pytest.raises(EngineError, match=r"resume: 4 sessions but 3 free slot\(s\) of 3; nothing was joined"):
        other.resume(paths * 2)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a snapshot")
    with pytest.raises(EngineError):
        other.resume([paths[0], bad])
    assert other.sequences == []
    resumed = other.resume(paths)
    assert other.positions(resumed) == batch.positions()
    toks = {s: sessions[s].token() for s in seqs}
    q, k, v = (np.stack([toks[s][i] for s in seqs]) for i in range(3))
    outs = []
    for b in (batch, other):
        with b.token() as t:
            outs.append(np.stack([t.attend(layer, q[:, layer], k[:, layer], v[:, layer]) for layer in range(4)]))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_bad_batch_calls_are_refused_naming_what_is_wrong(arch):
    """Each refusal names the value and what is allowed, and changes nothing."""
    cfg = geometry(**GEOMETRIES["gqa4-d64"], max_context=256)
    with pytest.raises(EngineError, match=r"max_sequences=0: expected a positive number"):
        Batch(cfg, 0, arch=arch)
    batch = Batch(cfg, 2, arch=arch)
    a, b = batch.join(), batch.join()
    with pytest.raises(EngineError, match=r"prompt of sequence 1 \(row 1\): prompt of 300 token\(s\) at position 0 "
                                          r"passes max_context=256; nothing was opened"):
        batch.prompt({a: 10, b: 300})
    assert batch._open is None and batch.positions() == [0, 0]
    with pytest.raises(EngineError, match=r"token: no sequence 7 in the batch \(it holds \[0, 1\]\)"):
        batch.token([a, 7])
    with pytest.raises(EngineError, match=r"sequence\(s\) \[0\] listed twice"):
        batch.token([a, a])
    sessions = {a: Session(batch.sequence(a)), b: Session(batch.sequence(b))}
    _prompt(batch, sessions, {a: 10, b: 3})
    with pytest.raises(EngineError, match=r"prompt: sequence\(s\) \{0: 10\} \(id: position\) already hold tokens"):
        batch.prompt({a: 4})
    with batch.token() as t:
        with pytest.raises(EngineError, match=r"join: a batch token of sequences \[0, 1\] is open"):
            batch.join()
        t.abandon()
    assert batch.positions() == [10, 3]
    # the step's layer order: a layer out of order abandons the step; one left out refuses the commit, and the
    # with-block's exit then abandons it; either way every sequence is as before
    before = {s: state(batch.sequence(s)) for s in (a, b)}
    rows = {s: sessions[s].token() for s in (a, b)}
    q, k, v = (np.stack([rows[s][i] for s in (a, b)]) for i in range(3))
    with pytest.raises(EngineError, match=r"attend layer 2: out of order: layer 1 is next"):
        with batch.token() as t:
            t.attend(0, q[:, 0], k[:, 0], v[:, 0])
            t.attend(2, q[:, 2], k[:, 2], v[:, 2])
    with pytest.raises(EngineError, match=r"batch token: layers 2\.\.3 have not run \(every layer runs once, in "
                                          r"order\); it was abandoned and every sequence is as before it"):
        with batch.token() as t:
            for layer in range(2):
                t.attend(layer, q[:, layer], k[:, layer], v[:, layer])
            with pytest.raises(EngineError, match=r"commit: layer(s)? .* not run.*attend the rest, or abandon"):
                t.commit()
    assert batch._open is None
    for s in (a, b):
        assert_same_state(state(batch.sequence(s)), before[s])


def test_a_pool_is_sized_up_front_and_a_slot_is_reused(arch):
    """Batch(context=N): every slot holds its rings (window + slack) and its growing planes for N rows from the start,
    exactly (rings x (window + slack) + full layers x N) x kv_heads x head_dim x 4 bytes, the same bits as a lone
    engine whose planes grow; a sequence that leaves frees its slot and the next one to join takes the same memory,
    empty."""
    cfg = geometry(**GEOMETRIES["gqa4-d64"], slack=2, max_context=1024)
    batch = Batch(cfg, 2, arch=arch, context=300)
    per_seq = (3 * (64 + 2) + 1 * 300) * cfg.n_kv_heads * cfg.head_dim * 4
    a, b = batch.join(), batch.join()
    assert batch.kv_bytes(a) == batch.kv_bytes(b) == per_seq and batch.pool.nbytes() == 2 * per_seq
    sessions = {a: Session(batch.sequence(a), seed=7), b: Session(batch.sequence(b), seed=8)}
    lone = {a: mt.Engine(cfg, arch=arch), b: mt.Engine(cfg, arch=arch)}
    _prompt(batch, sessions, {a: 100, b: 10}, lone)
    for _ in range(6):
        toks, out = _step(batch, sessions)
        for i, seq in enumerate((a, b)):
            np.testing.assert_array_equal(out[i], _lone_token(lone[seq], *toks[seq]))
    assert lone[a].plane_state(3).capacity == 128 and batch.sequence(a).plane_state(3).capacity == 300
    planes = batch.sequence(a).cache.k[mt.config.NOPE]
    batch.leave(a)
    c = batch.join()
    eng = batch.sequence(c)
    assert eng.position == 0 and eng.route_counts == {} and eng.cache.k[mt.config.NOPE] is planes
    assert batch.kv_bytes(c) == per_seq
    sessions[c] = Session(eng, seed=9)
    _prompt(batch, sessions, {c: 70})
    toks, out = _step(batch, sessions)
    sessions[c].verify(out[1], *toks[c])  # the reused slot's rows: this sequence's own, within the f32 bound
    with pytest.raises(EngineError, match=r"context=2000: expected the tokens a slot holds, in \[1, max_context=1024\]"):
        Batch(cfg, 1, arch=arch, context=2000)
