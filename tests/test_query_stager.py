"""The GPU producers' query copy (gpu_common.query_stager) alone: every query, times the attention scale,
lands in its cell, once, at shapes the engine's geometries do not reach (a last trip that only some threads
take, more trips than one batch of QUERY_LOADS_IN_FLIGHT loads, a padded row stride)."""

import numpy as np
import pytest
import taichi as ti

from muser_ti.kernels.producer.gpu_common import QUERY_LOADS_IN_FLIGHT, query_stager

LAYERS = 3
SENTINEL = -7.5  # the destination's fill: a cell the copy must not touch keeps it


# (G, D, T, stride): heads, head_dim, threads, destination row stride
@pytest.mark.parametrize("G, D, T, stride", [
    (16, 128, 128, 132),  # Glimmer's warp tile: 16 trips, one batch, rows padded by 4
    (3, 64, 128, 64),  # 192 queries over 128 threads: the second trip only for threads 0-63
    (40, 128, 128, 128),  # 40 trips: three batches, the last of 8
    (7, 128, 96, 130),  # a thread count that is not a power of 2, and 896 = 9 x 96 + 32
    (1, 256, 128, 260),  # one head (MHA)
])
@pytest.mark.parametrize("scale", ["auto", 0.7])
def test_query_copy_puts_every_query_in_its_cell_once(arch, G, D, T, stride, scale):
    stage = query_stager(G, D, T, stride)
    scale = 1.0 / np.sqrt(D) if scale == "auto" else scale  # a geometry's "auto" scale, or a config's own
    heads = 2 * G + 1  # the copy reads heads head0 .. head0 + G - 1 of a layer with more
    rng = np.random.default_rng(G * 1000 + D + T)
    q_host = rng.standard_normal((LAYERS, heads, D)).astype(np.float32) * 50.0
    q = ti.ndarray(ti.f32, q_host.shape)
    q.from_numpy(q_host)
    dst = ti.ndarray(ti.f32, (G * stride + 8,))
    dst.from_numpy(np.full(G * stride + 8, SENTINEL, np.float32))

    @ti.kernel
    def copy(q: ti.types.ndarray(ndim=3), dst: ti.types.ndarray(ndim=1), layer: ti.i32, head0: ti.i32,
             scale: ti.f32):
        for tid in range(T):  # each "thread" of a workgroup runs the copy with its own id
            stage(q, dst, layer, head0, tid, scale)

    layer, head0 = 1, G + 1
    copy(q, dst, layer, head0, scale)
    got = dst.to_numpy()
    want = np.full_like(got, SENTINEL)
    cells = (np.arange(G)[:, None] * stride + np.arange(D)[None, :]).ravel()
    want[cells] = (q_host[layer, head0:head0 + G] * np.float32(scale)).ravel()  # one f32 rounding, as the copy
    wrong = np.flatnonzero(got != want)
    assert wrong.size == 0, (
        f"G={G}, D={D}, T={T}, stride={stride}, scale={scale}: {wrong.size} cells differ from the scaled queries, "
        f"first at {wrong[0]} (got {got[wrong[0]]}, want {want[wrong[0]]}; batches of {QUERY_LOADS_IN_FLIGHT})")
