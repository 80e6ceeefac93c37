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


def test_pack_and_unpack_keep_the_f16_bits(arch):
    """pack rounds as ti.cast(x, ti.f16) (nearest even, subnormals kept) and the words hold numpy's f16
    bits, low half first; low/high give back exactly those halves as f32."""
    rng = np.random.default_rng(7)
    x = _values(rng, 512)
    x = x[: x.size // 2 * 2]
    n = x.size // 2

    @ti.kernel
    def roundtrip(src: ti.types.ndarray(dtype=ti.f32, ndim=1), words: ti.types.ndarray(dtype=ti.u32, ndim=1),
                  back: ti.types.ndarray(dtype=ti.f32, ndim=1)):
        for w in range(words.shape[0]):
            word = halves.pack(src[2 * w], src[2 * w + 1])
            words[w] = word
            back[2 * w] = halves.low(word)
            back[2 * w + 1] = halves.high(word)

    src, words, back = ti.ndarray(ti.f32, (2 * n,)), ti.ndarray(ti.u32, (n,)), ti.ndarray(ti.f32, (2 * n,))
    src.from_numpy(x)
    roundtrip(src, words, back)
    expected = x.astype(np.float16)
    np.testing.assert_array_equal(words.to_numpy(), expected.view(np.uint32))
    got = back.to_numpy()
    np.testing.assert_array_equal(got.view(np.uint32), expected.astype(np.float32).view(np.uint32))  # -0.0 too


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
