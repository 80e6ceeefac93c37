"""metal_pinned/: the pinned llama.cpp Metal vec-kernel bridge.

Everything that needs no Metal is checked here on Linux: the plain C (fa_plan.c, mp_pin.c) is
compiled with gcc into a temporary folder, both as the C test program (through the Makefile's
check-plan target) and as a shared library loaded with ctypes through the same declarations
muser_ti.pinned.metal_bridge uses on Darwin.  Expected values are stated here independently, from the
facts in shared/notes/llama-vec-kernel.md (checked against ggml v0.15.3, eced84c8).

The tests that dispatch the kernel need macOS with Metal and skip here with that reason.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from muser_ti.pinned import metal_bridge as mb

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "metal_pinned"
NEEDS_METAL = "needs macOS with Metal; not run on these Linux machines"

GLIMMER = dict(n_heads=32, n_kv_heads=2, head_dim=128)
SCALE = 1.0 / np.sqrt(128.0)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    out = tmp_path_factory.mktemp("metal_pinned")
    so = out / "libmp_plan.so"
    subprocess.run(["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                    str(SRC / "fa_plan.c"), str(SRC / "mp_pin.c"), "-lm", "-o", str(so)],
                   check=True, capture_output=True, text=True)
    return out, so


@pytest.fixture(scope="module")
def lib(build):
    lib = ctypes.CDLL(str(build[1]))
    mb.declare_plan_abi(lib)       # the declarations the Darwin loader uses, bound to the Linux build
    return lib


def plan_for(lib, visible, layout, capacity=8192, has_mask=False):
    if layout == "head_major":
        row, head = mb.layout_head_major(capacity)
    else:
        row, head = mb.layout_token_major(GLIMMER["n_kv_heads"])
    return mb.make_plan(lib, mb.problem(visible=visible, row_stride=row, head_stride=head, scale=SCALE,
                                        has_mask=has_mask, **GLIMMER))


# ---- the C test program, through the Makefile -----------------------------------------------------

def test_make_check_plan_passes(build):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    r = subprocess.run(["make", "-C", str(SRC), "check-plan", f"BUILD={build[0] / 'mk'}", "CC=gcc"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checks passed" in r.stdout


# ---- struct layouts ----------------------------------------------------------------------------------

# stated in the notes (and ggml-metal-impl.h v0.15.3): sizes and the listed offsets
NOTES_SIZES = {"fa_vec": 192, "fa_pad": 104, "fa_vec_reduce": 4}
NOTES_VEC_OFFSETS = {"ne01": 0, "nb01": 16, "ne11": 40, "ns10": 52, "nb11": 56, "ns20": 80, "nb21": 88,
                     "ne31": 112, "nb31": 128, "ne1": 152, "scale": 164, "logit_softcap": 184}

VEC_FIELDS = [("ne01", 4), ("ne02", 4), ("ne03", 4), ("nb01", 8), ("nb02", 8), ("nb03", 8),
              ("ne11", 4), ("ne_12_2", 4), ("ne_12_3", 4), ("ns10", 4), ("nb11", 8), ("nb12", 8), ("nb13", 8),
              ("ns20", 4), ("nb21", 8), ("nb22", 8), ("nb23", 8),
              ("ne31", 4), ("ne32", 4), ("ne33", 4), ("nb31", 8), ("nb32", 8), ("nb33", 8),
              ("ne1", 4), ("ne2", 4), ("ne3", 4), ("scale", 4), ("max_bias", 4), ("m0", 4), ("m1", 4),
              ("n_head_log2", 4), ("logit_softcap", 4)]
PAD_FIELDS = [("ne11", 4), ("ne_12_2", 4), ("ne_12_3", 4), ("nb11", 8), ("nb12", 8), ("nb13", 8),
              ("nb21", 8), ("nb22", 8), ("nb23", 8), ("ne31", 4), ("ne32", 4), ("ne33", 4),
              ("nb31", 8), ("nb32", 8), ("nb33", 8)]


def natural_layout(fields):
    """Offsets and size of a C struct of scalars under natural alignment (computed here, not by C)."""
    off, align, out = 0, 1, {}
    for name, size in fields:
        off = (off + size - 1) // size * size
        out[name] = off
        off += size
        align = max(align, size)
    return out, (off + align - 1) // align * align


def test_struct_sizes_and_offsets(lib):
    for name, size in NOTES_SIZES.items():
        assert lib.mp_struct_sizeof(name.encode()) == size, name
    for field, off in NOTES_VEC_OFFSETS.items():
        assert lib.mp_struct_offsetof(b"fa_vec", field.encode()) == off, field
    for sname, fields in (("fa_vec", VEC_FIELDS), ("fa_pad", PAD_FIELDS), ("fa_vec_reduce", [("nrows", 4)])):
        offsets, size = natural_layout(fields)
        assert size == NOTES_SIZES[sname]
        for field, off in offsets.items():
            assert lib.mp_struct_offsetof(sname.encode(), field.encode()) == off, (sname, field)
    assert lib.mp_struct_offsetof(b"fa_vec", b"no_such_field") == -1


def test_python_mirrors_match_the_c(lib):
    for sname, cls in mb.MIRRORS.items():
        assert ctypes.sizeof(cls) == lib.mp_struct_sizeof(sname.encode()), sname
        for field, *_ in cls._fields_:
            assert getattr(cls, field).offset == lib.mp_struct_offsetof(sname.encode(), field.encode()), (sname, field)
    assert lib.mp_abi_version() == mb.ABI_VERSION
    assert lib.mp_ggml_tag().decode() == mb.PINNED_GGML_TAG
    assert lib.mp_ggml_commit().decode() == mb.PINNED_GGML_COMMIT


# ---- geometry --------------------------------------------------------------------------------------------

VISIBLES = [1, 31, 32, 33, 1000, 1024, 1025, 2047, 2048, 2049, 4096, 4097, 8192, 65537, 131072]


def test_nsg_rule_matches_splitk_geometry(lib):
    from muser_ti.kernels.split_geometry import splitk_geometry
    for visible in VISIBLES:
        expected = 1 if visible <= 2048 else (2 if visible <= 4096 else 4)   # the notes' thresholds
        assert lib.mp_fa_nsg(32, visible) == expected, visible
        assert lib.mp_fa_nsg(32, visible) == splitk_geometry(visible)[1], visible


def gpad(x, n):
    return (x + n - 1) // n * n


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("visible", [1, 33, 2048, 2049, 4097, 131072])
def test_plan_geometry_and_sizing(lib, layout, visible):
    capacity = 131072
    pl = plan_for(lib, visible, layout, capacity)
    nsg = 1 if visible <= 2048 else (2 if visible <= 4096 else 4)
    ns10 = 128 if layout == "head_major" else 256
    nb11 = 2 * ns10
    nb12 = capacity * 256 if layout == "head_major" else 256
    v = pl.vec
    assert (v.ne01, v.ne02, v.ne03, v.ne11, v.ne_12_2, v.ne_12_3) == (1, 32, 1, visible, 2, 1)
    assert (v.ns10, v.ns20, v.nb11, v.nb21, v.nb12, v.nb22) == (ns10, ns10, nb11, nb11, nb12, nb12)
    assert (v.nb01, v.nb02) == (32 * 128 * 4, 128 * 4)
    assert (v.ne1, v.ne2, v.ne3) == (32, 1, 1)
    assert v.scale == pytest.approx(SCALE, rel=1e-7)
    assert (v.max_bias, v.m0, v.m1, v.n_head_log2, v.logit_softcap) == (0.0, 1.0, 1.0, 32, 0.0)
    p = pl.pad
    assert (p.ne11, p.ne_12_2, p.nb11, p.nb12, p.nb21, p.nb22) == (visible, 2, nb11, nb12, nb11, nb12)
    assert pl.reduce.nrows == 32

    assert (pl.nwg, pl.nsg, pl.ncpsg) == (32, nsg, 32)
    assert pl.has_kvpad == (visible % 32 != 0)
    assert (pl.has_mask, pl.has_sinks, pl.has_bias, pl.has_scap) == (0, 0, 0, 0)
    assert list(pl.vec_groups) == [1, 32, 32] and list(pl.vec_threads) == [32, nsg, 1]
    assert list(pl.pad_groups) == [32, 2, 1] and list(pl.pad_threads) == [32, 1, 1]
    assert list(pl.reduce_groups) == [32, 1, 1] and list(pl.reduce_threads) == [1024, 1, 1]
    assert pl.vec_smem_bytes == gpad((gpad(128, 128) + 4 * 32 + 2 * gpad(128, 128)) * nsg * 2, 16) == 1024 * nsg

    assert pl.tmp_bytes == 32 * 32 * (128 + 2) * 4 == pl.tmp_bytes_ggml   # nrows * nwg * (DV + 2) floats
    assert pl.pad_bytes == 32 * (nb11 * 2 + nb11 * 2)                      # C rows of K and V per KV head
    assert pl.pad_bytes_ggml == 64 * (nb11 * 2 + nb11 * 2)                 # ggml reserves for ncpsg 64
    assert pl.q_bytes == pl.out_bytes == 32 * 128 * 4
    read_to = (visible - 1) * nb11 + nb12 + (nb11 if pl.has_kvpad else 256)
    assert pl.k_extent == pl.v_extent == max(read_to, (visible - 1) * nb11 + nb12 + 256)


def test_ragged_token_major_window_over_reads_past_its_rows(lib):
    """The pad kernel copies a whole 512-byte row stride from the last KV head's offset: 256 bytes past
    the window's last row on a token-major ring (what the SWA len % 32 predicate keeps off this route)."""
    pl = plan_for(lib, 33, "token_major")
    assert pl.has_kvpad
    assert pl.k_extent - 33 * 512 == 256
    assert plan_for(lib, 64, "token_major").k_extent == 64 * 512
    assert plan_for(lib, 33, "head_major", capacity=33).k_extent == 2 * 33 * 256   # head-major: exact


def test_mask_broadcast_row(lib):
    pl = plan_for(lib, 256, "token_major", has_mask=True)
    assert pl.has_mask == 1
    assert (pl.vec.ne31, pl.vec.ne32, pl.vec.ne33, pl.vec.nb31) == (1, 1, 1, 512)
    assert pl.mask_bytes == 512
    assert pl.pad_bytes == 32 * (512 * 2 * 2 + 2)


def test_function_constants(lib):
    pl = plan_for(lib, 4097, "token_major")
    c = (mb.FcValue * 9)()
    assert lib.mp_fa_vec_constants(ctypes.byref(pl), c) == 9
    assert [(x.index, x.type, x.value) for x in c] == [
        (400, 1, 0), (401, 1, 0), (402, 1, 0), (403, 1, 0), (404, 1, 1),
        (420, 2, 256), (421, 2, 256), (422, 2, 4), (423, 2, 32)]
    key = ctypes.create_string_buffer(512)
    lib.mp_fa_pipeline_key(b"kernel_flash_attn_ext_vec_f16_dk128_dv128", c, 9, key, 512)
    assert key.value.decode() == ("kernel_flash_attn_ext_vec_f16_dk128_dv128_mask=0_sink=0_bias=0_scap=0_kvpad=1"
                                  "_ns10=256_ns20=256_nsg=4_nwg=32")
    assert lib.mp_fa_pad_constants(ctypes.byref(pl), c) == 2
    assert [(x.index, x.type, x.value) for x in c[:2]] == [(100, 1, 0), (125, 2, 32)]
    assert lib.mp_fa_reduce_constants(ctypes.byref(pl), c) == 2
    assert [(x.index, x.type, x.value) for x in c[:2]] == [(500, 2, 128), (501, 2, 32)]


@pytest.mark.parametrize("change, words", [
    (dict(head_dim=64), "head_dim"),
    (dict(n_heads=31), "multiple of n_kv_heads"),
    (dict(visible=0), "visible"),
    (dict(row_stride=130), "multiple of 4"),
    (dict(row_stride=64), ">= head_dim"),
    (dict(head_stride=4), "multiple of 8"),
    (dict(scale=float("nan")), "scale"),
])
def test_refused_problems(lib, change, words):
    args = dict(GLIMMER, visible=64, row_stride=256, head_stride=256, scale=SCALE)
    args.update(change)
    with pytest.raises(mb.MetalBridgeError, match=words):
        mb.make_plan(lib, mb.problem(**args))


# ---- SHA-256 and the PIN --------------------------------------------------------------------------------

def test_sha256_matches_hashlib(lib, tmp_path):
    rng = np.random.default_rng(7)
    for n in [0, 1, 55, 56, 63, 64, 65, 119, 120, 1000, 65536, 65537, 300001]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        f = tmp_path / f"blob{n}"
        f.write_bytes(data)
        out, err = ctypes.create_string_buffer(65), ctypes.create_string_buffer(256)
        assert lib.mp_sha256_file(str(f).encode(), out, err, 256) == 0, err.value
        want = hashlib.sha256(data).hexdigest()
        assert out.value.decode() == want, n
        actual = ctypes.create_string_buffer(65)
        assert lib.mp_pin_check(data, n, want.upper().encode(), actual, err, 256) == 0, err.value
        assert actual.value.decode() == want
        wrong = ("0" if want[0] != "0" else "1") + want[1:]
        assert lib.mp_pin_check(data, n, wrong.encode(), actual, err, 256) == -1
        assert b"does not match" in err.value


def test_repository_pin_is_never_silently_accepted(lib):
    text = (SRC / "PIN").read_text()
    values = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert len(values) == 1
    if values[0] == mb.PIN_PLACEHOLDER:
        with pytest.raises(mb.MetalBridgeError, match="unset"):
            mb.read_pin(lib, SRC / "PIN")
        err = ctypes.create_string_buffer(256)
        assert lib.mp_pin_check(b"x", 1, values[0].encode(), None, err, 256) == -1
    else:   # after `make pin` on macOS: exactly one sha256
        assert mb.read_pin(lib, SRC / "PIN") == values[0].lower()


# named ids: pytest versions print ids of strings like these differently (the H200's pytest 9.1.1 printed the
# two-pin text escaped, this machine's collects it as "text5"), and scripts/lab/suite_results.py matches by id
@pytest.mark.parametrize("text", ["", "# nothing\n", "UNSET\n", "abc\n", "g" * 64 + "\n",
                                  "a" * 64 + "\n" + "b" * 64 + "\n", "a" * 63 + "\n"],
                         ids=["empty", "comment only", "UNSET", "short", "not hex", "two pins", "63 digits"])
def test_pin_parser_refuses(lib, text):
    out, err = ctypes.create_string_buffer(65), ctypes.create_string_buffer(512)
    assert lib.mp_pin_parse(text.encode(), out, err, 512) == -1
    assert err.value


def test_pin_script_writes_and_guards_the_pin(lib, tmp_path):
    metallib = tmp_path / "fake.metallib"
    metallib.write_bytes(b"not really a metallib\x00\x01")
    pin = tmp_path / "PIN"
    shutil.copy(SRC / "PIN", pin)
    run = lambda env=None: subprocess.run(["sh", str(SRC / "pin.sh"), str(metallib), str(pin), "deadbeef"],
                                          capture_output=True, text=True, env=env)
    r = run()
    assert r.returncode == 0, r.stderr
    assert mb.read_pin(lib, pin) == hashlib.sha256(metallib.read_bytes()).hexdigest()
    metallib.write_bytes(b"another binary")
    r = run()
    assert r.returncode != 0 and "refusing to re-pin" in r.stderr
    r = run(dict(os.environ, REPIN="1"))
    assert r.returncode == 0, r.stderr
    assert mb.read_pin(lib, pin) == hashlib.sha256(b"another binary").hexdigest()


# ---- the Python loader ------------------------------------------------------------------------------------

@pytest.mark.skipif(sys.platform == "darwin", reason="checks the refusal off Darwin")
def test_loader_refuses_off_darwin():
    with pytest.raises(mb.MetalBridgeError, match="needs macOS"):
        mb.load()
    ok, why = mb.status()
    assert not ok and "macOS" in why


def test_bridge_source_says_it_was_never_linked_or_run():
    head = (SRC / "bridge.m").read_text()[:1500]
    assert "NEVER LINKED OR RUN" in head
    assert "never linked or run" in (SRC / "README.md").read_text().lower()


# ---- on Metal ----------------------------------------------------------------------------------------------

def reference(q, k, v, scale):
    """float64 attention with llama's Q rounding (Q is staged as half in threadgroup memory)."""
    q = q.astype(np.float16).astype(np.float64)
    heads_per_kv = q.shape[0] // k.shape[1]
    out = np.empty_like(q)
    for h in range(q.shape[0]):
        kk, vv = k[:, h // heads_per_kv].astype(np.float64), v[:, h // heads_per_kv].astype(np.float64)
        s = kk @ q[h] * scale
        w = np.exp(s - s.max())
        out[h] = w @ vv / w.sum()
    return out


@pytest.mark.skipif(sys.platform != "darwin", reason=NEEDS_METAL)
@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("visible", [33, 2048, 4097])
def test_vec_kernel_on_metal(layout, visible):
    try:
        bridge = mb.load()
    except mb.MetalBridgeError as exc:
        pytest.skip(f"pinned Metal bridge not available: {exc}")
    rng = np.random.default_rng(visible)
    H, KV, D = 32, 2, 128
    with bridge:
        cap = visible + 32                         # slack rows so a ragged token-major pad stays in bounds
        q = rng.standard_normal((H, D)).astype(np.float32)
        k = rng.standard_normal((cap, KV, D)).astype(np.float16)
        v = rng.standard_normal((cap, KV, D)).astype(np.float16)
        qb, ob = bridge.buffer(q.nbytes), bridge.buffer(q.nbytes)
        kb, vb = bridge.buffer(k.nbytes), bridge.buffer(v.nbytes)
        qb.array(np.float32, q.shape)[:] = q
        if layout == "token_major":
            kb.array(np.float16, k.shape)[:] = k
            vb.array(np.float16, v.shape)[:] = v
            row, head = mb.layout_token_major(KV)
        else:
            kb.array(np.float16, (KV, cap, D))[:] = k.transpose(1, 0, 2)
            vb.array(np.float16, (KV, cap, D))[:] = v.transpose(1, 0, 2)
            row, head = mb.layout_head_major(cap)
        prob = mb.problem(H, KV, D, visible, row, head, float(SCALE))
        bridge.attend([bridge.desc(prob, q=qb, k=kb, v=vb, out=ob)])
        got = ob.array(np.float32, (H, D)).copy()
        for b in (qb, ob, kb, vb):
            b.free()
    want = reference(q, k[:visible], v[:visible], SCALE)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
