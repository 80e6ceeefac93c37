"""Per-token host copies (muser_ti/transfer.py): the bits arrive and come back unchanged on every backend,
by the driver's memcpy on CUDA and by Taichi's copies elsewhere, in step with the kernels around them."""

import numpy as np
import pytest
import taichi as ti

from muser_ti.transfer import Transfer


@pytest.mark.parametrize("shape", [(3, 5, 7), (52, 32, 128)])
def test_upload_then_download_is_bit_exact(arch, shape):
    rng = np.random.default_rng(1)
    a = rng.standard_normal(shape, dtype=np.float32) * np.float32(1e30)  # large magnitudes, every bit pattern in play
    a.flat[::97] = np.float32(1e-40)  # and subnormals, which a flush-to-zero path would lose
    t = Transfer()
    assert t.path == ("cuMemcpy" if arch == "cuda" else "taichi")
    dev = ti.ndarray(ti.f32, shape)
    t.upload(dev, a)
    np.testing.assert_array_equal(dev.to_numpy(), a)  # Taichi's own read agrees with the upload
    got = t.download(dev, shape)
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got, a)


def test_int32_arrays_round_trip_and_other_dtypes_are_refused(arch):
    t = Transfer()
    flags = np.array([0, -1, 2**31 - 1, -2**31, 7], np.int32)
    dev = ti.ndarray(ti.i32, flags.shape)
    t.upload(dev, flags)
    got = t.download(dev, flags.shape)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, flags)
    with pytest.raises(ValueError, match="expected the same shape, float32 or int32"):
        t.download(ti.ndarray(ti.f16, (5,)), (5,))


def test_copies_are_ordered_with_kernels(arch):
    """A kernel that reads the uploaded array and writes another sees this upload and is seen by the download."""

    @ti.kernel
    def double(src: ti.types.ndarray(dtype=ti.f32, ndim=1), dst: ti.types.ndarray(dtype=ti.f32, ndim=1)):
        for i in src:
            dst[i] = 2 * src[i]

    t = Transfer()
    n = 1 << 16
    src, dst = ti.ndarray(ti.f32, (n,)), ti.ndarray(ti.f32, (n,))
    for round_ in range(3):  # each round's upload must land before the kernel, each result after it
        a = np.arange(n, dtype=np.float32) + round_
        t.upload(src, a)
        double(src, dst)
        np.testing.assert_array_equal(t.download(dst, (n,)), 2 * a)


def test_a_mismatched_shape_is_refused_before_any_copy(arch):
    t = Transfer()
    dev = ti.ndarray(ti.f32, (4, 8))
    t.upload(dev, np.ones((4, 8), np.float32))
    with pytest.raises(ValueError, match=r"host shape \(4, 9\) against a device array \(4, 8\)"):
        t.upload(dev, np.zeros((4, 9), np.float32))
    with pytest.raises(ValueError, match="host shape"):
        t.download(dev, (8, 8))
    np.testing.assert_array_equal(t.download(dev, (4, 8)), np.ones((4, 8), np.float32))  # untouched
