"""The planes' storage (kernels/halves.py): two f16 per u32 word, the same bits an f16 plane held."""

import numpy as np
import pytest
import taichi as ti

from muser_ti.kernels import halves


def _values(rng, n: int) -> np.ndarray:
    """f32 values across the f16 range: normal and peaked, large, subnormal in f16, signed zeros, ties."""
    parts = [
        rng.standard_normal(n),
        rng.standard_normal(n) * 60000.0 / 4.0,  # large magnitudes, inside the f16 range
        rng.uniform(-6e-5, 6e-5, n),  # f16 subnormals (below 6.1e-5) and their rounding
        np.array([0.0, -0.0, 65504.0, -65504.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 2.0 ** -24, -2.0 ** -25]),
    ]
    return np.concatenate(parts).astype(np.float32)


def _mismatches(what: str, inputs: np.ndarray, want_bits: np.ndarray, got_bits: np.ndarray) -> str:
    """The first few elements whose bits differ, with the input and both bit patterns, and how many of
    them have an f16-subnormal input (the class a driver's default float controls may flush)."""
    bad = np.flatnonzero(want_bits != got_bits)
    if not bad.size:
        return ""
    subnormal = np.abs(inputs[bad].astype(np.float64)) < 2.0 ** -14
    rows = [f"{inputs[i]!r}: want {int(want_bits[i]):#x} got {int(got_bits[i]):#x}" for i in bad[:8]]
    return (f"{what}: {bad.size} of {inputs.size} differ ({int(subnormal.sum())} of them below the f16 normal "
            f"range 2**-14); first: " + "; ".join(rows))


@ti.kernel
def _pack_words(src: ti.types.ndarray(dtype=ti.f32, ndim=1), words: ti.types.ndarray(dtype=ti.u32, ndim=1)):
    for w in range(words.shape[0]):
        words[w] = halves.pack(src[2 * w], src[2 * w + 1])


@ti.kernel
def _unpack_words(words: ti.types.ndarray(dtype=ti.u32, ndim=1), back: ti.types.ndarray(dtype=ti.f32, ndim=1)):
    for w in range(words.shape[0]):
        back[2 * w] = halves.low(words[w])
        back[2 * w + 1] = halves.high(words[w])


def _even(x: np.ndarray) -> np.ndarray:
    return x[: x.size // 2 * 2]


def _pack_report(x: np.ndarray) -> str:
    """Pack f32 ``x`` (an even count) on the device; _mismatches against numpy's f16 bits."""
    src, words = ti.ndarray(ti.f32, (x.size,)), ti.ndarray(ti.u32, (x.size // 2,))
    src.from_numpy(x)
    _pack_words(src, words)
    with np.errstate(over="ignore"):  # past 65504 numpy rounds to inf, as pack does
        want = x.astype(np.float16).view(np.uint16)
    return _mismatches("pack", x, want, words.to_numpy().view(np.uint16))


def test_pack_rounds_as_numpy_does(arch):
    """pack rounds as numpy's astype(float16) does: nearest even, f16 subnormals kept; the words hold
    numpy's f16 bits, low half first."""
    x = _even(_values(np.random.default_rng(7), 512))
    assert not (report := _pack_report(x)), report


def test_pack_matches_numpy_across_the_f32_range(arch):
    """Random f32 bit patterns over the whole finite range, and every pattern near the edges where the
    rounding changes kind (the f16 subnormal boundary, the last binade before 65504 and the overflow to
    inf), both signs: each word's halves are numpy's."""
    rng = np.random.default_rng(11)
    bits = np.concatenate([
        rng.integers(0, 0x7F800000, 1 << 18, dtype=np.uint32),
        rng.integers(0x33000000 - 4096, 0x38800000 + 4096, 1 << 18, dtype=np.uint32),  # 2**-25 .. 2**-14
        np.arange(0x33000000 - 4096, 0x33000000 + 4096, dtype=np.uint32),  # around 2**-25: rounds to 0 or not
        np.arange(0x38800000 - 4096, 0x38800000 + 4096, dtype=np.uint32),  # around 2**-14: subnormal or not
        np.arange(0x477FE000 - 8192, 0x47800010, dtype=np.uint32),  # 65504's binade, the tie 65520, 65536
        np.array([0, 1, 0x387FFFFF, 0x38800000, 0x7F7FFFFF, 0x7F800000], np.uint32),
    ])
    x = _even(np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32))
    assert not (report := _pack_report(x)), report


def test_unpack_gives_back_each_half_exactly(arch):
    """low/high give back exactly the f32 value of each half, for every finite f16 bit pattern (both
    signs, every exponent, subnormals and signed zeros)."""
    every = np.arange(0x10000, dtype=np.uint32).astype(np.uint16)
    finite = every[np.isfinite(every.view(np.float16))]
    h = _even(finite)
    words = ti.ndarray(ti.u32, (h.size // 2,))
    words.from_numpy(h.view(np.uint32))
    back = ti.ndarray(ti.f32, (h.size,))
    _unpack_words(words, back)
    want = h.view(np.float16).astype(np.float32).view(np.uint32)
    got = back.to_numpy().view(np.uint32)
    assert not (report := _mismatches("unpack", h.view(np.float16), want, got)), report


def test_host_views_reinterpret_the_same_bytes(arch):
    rng = np.random.default_rng(8)
    shape = (2, 3, 5, 64)
    h = rng.standard_normal(shape).astype(np.float16)
    plane = halves.alloc(shape)
    assert tuple(plane.shape) == (2, 3, 5, 32) and plane.dtype == ti.u32
    assert halves.halves_shape(plane) == shape
    halves.from_halves(plane, h)
    np.testing.assert_array_equal(halves.to_halves(plane), h)
    np.testing.assert_array_equal(plane.to_numpy(), h.view(np.uint32))


def test_shapes_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="head_dim 63 must be even"):
        halves.packed_shape((1, 4, 63))


def test_halves_of_another_shape_are_refused(arch):
    plane = halves.alloc((1, 4, 64))
    before = plane.to_numpy().copy()
    with pytest.raises(ValueError, match=r"halves of shape \(1, 4, 32\) do not fill a packed plane of \(1, 4, 32\) words"):
        halves.from_halves(plane, np.zeros((1, 4, 32), np.float16))
    np.testing.assert_array_equal(plane.to_numpy(), before)
