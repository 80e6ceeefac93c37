"""replay.GraphReplay: one compiled graph per dispatch structure, the caller's arrays keyed by their place,
rank and which of them are the same array, the engine's by identity; both run paths give the same bits."""

import numpy as np
import pytest
import taichi as ti

from muser_ti import replay


@pytest.fixture(scope="module")
def kernels(arch):
    @ti.kernel
    def shift(src: ti.types.ndarray(dtype=ti.f32, ndim=1), dst: ti.types.ndarray(dtype=ti.f32, ndim=1), by: ti.i32,
              scale: ti.f32):
        for i in range(src.shape[0]):
            dst[i] = src[i] * scale + by

    @ti.kernel
    def bump(a: ti.types.ndarray(dtype=ti.f32, ndim=1), by: ti.i32):
        for i in range(a.shape[0]):
            a[i] += by

    return shift, bump


def device(values) -> ti.Ndarray:
    a = ti.ndarray(ti.f32, (len(values),))
    a.from_numpy(np.asarray(values, np.float32))
    return a


def fresh(rng, n=6) -> np.ndarray:
    return rng.standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("jit_run", [True, False], ids=["jit_run", "graph_run"])
def test_replay_runs_what_the_dispatches_say(kernels, jit_run):
    shift, bump = kernels
    rng = np.random.default_rng(7)
    src = fresh(rng)
    a, b = device(src), device(fresh(rng))
    r = replay.GraphReplay()
    r.run([(shift, (a, b, 3, 0.5)), (bump, (b, -2))])  # compiles
    (compiled,) = r._compiled.values()
    if not jit_run:  # the fallback a Taichi without jit_run takes: Graph.run with the same arguments
        compiled.jit_run = None
    for by, scale, bumped in ((3, 0.5, -2), (5, 2.0, 1)):  # new scalars, the same graph
        b.from_numpy(fresh(rng))
        r.run([(shift, (a, b, by, scale)), (bump, (b, bumped))])
        want = (src * np.float32(scale) + np.float32(by)) + np.float32(bumped)  # the kernels round twice, in f32
        np.testing.assert_array_equal(b.to_numpy(), want)
    assert len(r) == 1


def test_caller_arrays_are_keyed_by_place_not_identity(kernels):
    shift, _ = kernels
    rng = np.random.default_rng(8)
    r = replay.GraphReplay()
    for _ in range(3):  # new caller arrays every call, as step_device's may be: one graph
        src = fresh(rng)
        a, b = device(src), device(fresh(rng))
        r.run([(shift, (a, b, 1, 1.0))], external=(a, b))
        np.testing.assert_array_equal(b.to_numpy(), src + np.float32(1))
    assert len(r) == 1


def test_a_caller_array_passed_twice_gets_a_graph_of_its_own(kernels):
    shift, _ = kernels
    rng = np.random.default_rng(9)
    r = replay.GraphReplay()
    a, b = device(fresh(rng)), device(fresh(rng))
    r.run([(shift, (a, b, 1, 1.0))], external=(a, b))
    src = fresh(rng)
    c = device(src)
    r.run([(shift, (c, c, 2, 2.0))], external=(c, c))  # in place: src and dst are one graph argument
    assert len(r) == 2
    # scales are powers of two: GPUs contract x * scale + by into one FMA, exact only when the product is
    # (a scale of 3 failed this on the H200's CUDA and Vulkan, run 16)
    np.testing.assert_array_equal(c.to_numpy(), src * np.float32(2) + np.float32(2))
    d, e = device(fresh(rng)), device(fresh(rng))
    r.run([(shift, (d, e, 1, 1.0))], external=(d, e))  # two arrays again: the first graph
    assert len(r) == 2


def test_engine_arrays_are_keyed_by_identity(kernels):
    shift, _ = kernels
    rng = np.random.default_rng(10)
    r = replay.GraphReplay()
    a, b, c = device(fresh(rng)), device(fresh(rng)), device(fresh(rng))
    r.run([(shift, (a, b, 1, 1.0))])
    r.run([(shift, (a, b, 2, 1.0))])
    assert len(r) == 1
    r.run([(shift, (a, c, 1, 1.0))])  # another array bound (a reallocated plane): another graph
    assert len(r) == 2


def test_a_caller_array_of_another_rank_gets_a_graph_of_its_own(arch):
    @ti.kernel
    def total(src: ti.types.ndarray(dtype=ti.f32), dst: ti.types.ndarray(dtype=ti.f32, ndim=1)):
        for I in ti.grouped(src):
            dst[0] += src[I]

    rng = np.random.default_rng(11)
    r = replay.GraphReplay()
    for shape in ((6,), (2, 3)):  # the same place, rank 1 then rank 2: a graph argument fixes the rank
        src = ti.ndarray(ti.f32, shape)
        host = rng.integers(-8, 8, shape).astype(np.float32)  # small integers: the sum is exact in any order
        src.from_numpy(host)
        dst = device([0.0])
        r.run([(total, (src, dst))], external=(src, dst))
        assert dst.to_numpy()[0] == host.sum()
    assert len(r) == 2
