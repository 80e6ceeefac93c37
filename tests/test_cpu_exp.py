"""The CPU producer's own exp (kernels/producer/cpu.py): within 2 ulp of exp on every x <= 0 it can be given,
0 below the underflow edge, and exact at 0, against float64 on a dense grid, random draws and the edges."""

import numpy as np
import pytest
import taichi as ti

from muser_ti import backend
from muser_ti.kernels.producer.cpu import EXP_UNDERFLOW, exp_nonpositive

@pytest.fixture(scope="module")
def exp_kernel():
    backend.activate("cpu")

    @ti.kernel
    def apply(x: ti.types.ndarray(dtype=ti.f32, ndim=1), out: ti.types.ndarray(dtype=ti.f32, ndim=1)):
        for i in range(x.shape[0]):
            out[i] = exp_nonpositive(x[i])

    def run(x):
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        apply(x, out)
        return out

    return run


def inputs():
    rng = np.random.default_rng(0)
    grid = -np.linspace(0.0, 87.0, 200_001)
    near_zero = -np.geomspace(1e-30, 1.0, 10_000)
    draws = -rng.exponential(5.0, 100_000)
    halves = -np.arange(0, 126) * np.log(2.0)  # the range reduction's seams, n ln 2
    seams = np.concatenate([halves, np.nextafter(halves.astype(np.float32), -np.inf), halves - 0.5 * np.log(2.0)])
    return np.concatenate([grid, near_zero, draws, seams, [0.0, -0.0]]).astype(np.float32)


def test_within_two_ulp_of_exp_where_it_is_normal(exp_kernel):
    x = inputs()
    x = x[x >= EXP_UNDERFLOW]
    got = exp_kernel(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    ulp = np.exp2(np.floor(np.log2(want)) - 23)  # an f32 ulp at want (numpy's spacing flushes tiny ones to 0 here)
    err = np.abs(got - want) / ulp
    assert err.max() <= 2.0, (x[err.argmax()], got[err.argmax()], want[err.argmax()])
    assert exp_kernel(np.array([0.0, -0.0]))[0] == 1.0


@pytest.mark.parametrize("x", [EXP_UNDERFLOW - 1e-3, -100.0, -1e4, -3.4028235e38, -np.inf])
def test_zero_below_the_underflow_edge(exp_kernel, x):
    """Below the edge exp(x) < 2**-126: 0 (the running max starts at -3.4e38, so that case is reached)."""
    assert exp_kernel(np.array([x]))[0] == 0.0
