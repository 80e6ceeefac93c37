"""The reducer (kernels/reducer.py) alone: per-workgroup [M, S, O] partials merged into the output, against
the float64 merge, at split widths on both sides of the GPU reducer's load batches."""

import numpy as np
import pytest
import taichi as ti

from muser_ti.kernels.common import MAX_WORKGROUPS, RUNNING_MAX_INIT, on_gpu
from muser_ti.kernels.reducer import build_reduce

D, H, LAYERS = 64, 4, 3
# both sides of the GPU reducer's batches (32 and 64 partials; 16 before run 21) up to a deep split's 264; the
# CPU reducer merges at most MAX_WORKGROUPS
GPU_WIDTHS = (1, 2, 15, 16, 17, 31, 33, 63, 64, 65, 100, 132, 264)
CPU_WIDTHS = (1, 2, 15, 31, MAX_WORKGROUPS)


def _partials(rng, nwg: int, spread: str) -> np.ndarray:
    """[2 groups, H, nwg + 3, 2 + D] partials as producers leave them: M a workgroup's max score, S >= 1 its
    sum of exp(score - M), O its weighted sum of values; some workgroups own no rows (M at RUNNING_MAX_INIT,
    S = O = 0).  The 3 slots past nwg hold NaN: a reducer that reads past its split fails loudly."""
    p = np.full((2, H, nwg + 3, 2 + D), np.nan, np.float32)
    shape = (2, H, nwg)
    if spread == "normal":
        m = rng.standard_normal(shape) * 3.0
    elif spread == "peaked":  # one workgroup holds nearly all the weight
        m = rng.standard_normal(shape)
        m[..., rng.integers(nwg)] += 40.0
    else:  # large magnitudes: most factors exp(M_i - gmax) underflow to 0
        m = rng.uniform(-3e4, 3e4, shape)
    s = 1.0 + rng.exponential(20.0, shape)
    o = rng.standard_normal(shape + (D,)) * s[..., None] * 5.0
    if nwg > 2:
        empty = rng.random(shape) < 0.15
        empty[..., 0] = False  # at least one workgroup with rows per head
        m[empty], s[empty], o[empty] = RUNNING_MAX_INIT, 0.0, 0.0
    p[:, :, :nwg, 0], p[:, :, :nwg, 1], p[:, :, :nwg, 2:] = m, s, o
    return p


def _merge64(p: np.ndarray, nwg: int) -> tuple[np.ndarray, np.ndarray]:
    """The float64 merge and, per output, the scale its f32 error is measured against (sum |O_i| f_i / S)."""
    q = p[:, :, :nwg].astype(np.float64)
    m, s, o = q[..., 0], q[..., 1], q[..., 2:]
    f = np.exp(m - m.max(axis=2, keepdims=True))
    total = (s * f).sum(axis=2)[..., None]
    return (o * f[..., None]).sum(axis=2) / total, (np.abs(o) * f[..., None]).sum(axis=2) / total


@pytest.mark.parametrize("spread", ["normal", "peaked", "large"])
def test_reducer_matches_the_float64_merge_at_every_split_width(arch, spread):
    gpu = on_gpu()
    reduce = build_reduce(D, H, gpu, ti.f32)
    rng = np.random.default_rng(7)
    for nwg in GPU_WIDTHS if gpu else CPU_WIDTHS:
        p = _partials(rng, nwg, spread)
        partials = ti.ndarray(ti.f32, p.shape)
        partials.from_numpy(p)
        out = ti.ndarray(ti.f32, (LAYERS, H, D))
        out.from_numpy(np.full((LAYERS, H, D), 7.0, np.float32))
        layers = ti.ndarray(ti.i32, (2,))
        layers.from_numpy(np.array([2, 0], np.int32))  # group g writes model layer layers[g]
        reduce(partials, out, layers, 2, nwg)
        got = out.to_numpy()
        want, scale = _merge64(p, nwg)
        assert (got[1] == 7.0).all(), f"nwg={nwg}: layer 1 is no group's and was written"
        for g, layer in enumerate((2, 0)):
            err = np.abs(got[layer] - want[g]) / scale[g]
            assert np.isfinite(got[layer]).all() and err.max() < 1e-5, (
                f"nwg={nwg}, {spread}: group {g}'s output is {err.max():.2e} of its scale off the float64 merge")
