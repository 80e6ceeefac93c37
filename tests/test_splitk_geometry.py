"""The splitk geometry rule and block ownership: pinned to the chapter, and checked in the kernels."""

import numpy as np
import pytest
import taichi as ti

from muser_ti.kernels import halves
from muser_ti.kernels.common import on_gpu
from muser_ti.kernels.interleaved import build_interleaved
from muser_ti.kernels.common import VISIT_OWNER
from muser_ti.kernels.split_geometry import CPU_TARGET_ITEMS, block_owner, cpu_split_geometry, splitk_geometry
from muser_ti.kernels.splitk import build_splitk


@pytest.mark.parametrize("visible, expected", [
    (1, (1, 1)), (31, (1, 1)), (32, (1, 1)), (33, (2, 1)), (1000, (32, 1)), (1024, (32, 1)),
    (2048, (32, 1)), (2049, (32, 2)), (4096, (32, 2)), (4097, (32, 4)), (32768, (32, 4)), (131072, (32, 4)),
])
def test_geometry_is_the_chapters_rule(visible, expected):
    """nwg = min(blocks, 32); nsg grows 1 -> 4 while 2*nwg*nsg*32 < visible (llama's launch rule)."""
    assert splitk_geometry(visible) == expected


@pytest.mark.parametrize("visible", range(1, 5000, 37))
def test_rule_never_leaves_a_simdgroup_empty(visible):
    nwg, nsg = splitk_geometry(visible)
    blocks = (visible + 31) // 32
    assert nwg == min(blocks, 32) and nsg in (1, 2, 4)
    assert nwg * nsg <= blocks


@pytest.mark.parametrize("n_pairs", [1, 2, 3, 26, 78, 200])
@pytest.mark.parametrize("visible", [1, 33, 2048, 2049, 32768, 131072])
def test_cpu_split_keeps_the_chapters_simdgroups_and_enough_items(n_pairs, visible):
    """The CPU shares CPU_TARGET_ITEMS workgroups over the launch's pairs: at least one a pair, never more
    than the chapter's, and the chapter's nsg (so its ownership)."""
    nwg, nsg = cpu_split_geometry(visible, n_pairs)
    chapter_nwg, chapter_nsg = splitk_geometry(visible)
    assert nsg == chapter_nsg and 1 <= nwg <= chapter_nwg
    assert nwg == chapter_nwg or n_pairs * nwg >= CPU_TARGET_ITEMS  # fewer only where the items still fill it
    assert n_pairs * (nwg - 1) < CPU_TARGET_ITEMS or nwg == 1  # and no more than it takes


@pytest.mark.parametrize("nwg", [1, 2, 3, 7, 32])
@pytest.mark.parametrize("nsg", [1, 2, 4])
@pytest.mark.parametrize("blocks", [1, 5, 64, 129, 4096])
def test_every_block_owned_exactly_once(nwg, nsg, blocks):
    owners = [block_owner(b, nwg, nsg) for b in range(blocks)]
    assert all(0 <= wg < nwg and 0 <= sg < nsg for wg, sg in owners)
    # round-robin: block = (k*nwg + wg)*nsg + sg, stepping nwg*nsg
    for b, (wg, sg) in enumerate(owners):
        k = b // (nwg * nsg)
        assert b == (k * nwg + wg) * nsg + sg


def run_recording(family, visible, nwg, nsg):
    """Run a producer in record mode on a tiny geometry; return visits per block."""
    D, G, KV, H = 64, 2, 1, 2
    gpu = on_gpu()
    capacity, window = visible, 0
    if family == "splitk":
        producer = build_splitk(D, G, KV, H, gpu, record=True)[0]
        plane_shape = (1, capacity, KV, D)
    else:
        producer = build_interleaved(D, G, KV, H, gpu, record=True)[0]
        plane_shape = (1, KV, capacity, D)
    rng = np.random.default_rng(0)
    kp, vp = halves.alloc(plane_shape), halves.alloc(plane_shape)
    halves.from_halves(kp, rng.standard_normal(plane_shape).astype(np.float16))
    halves.from_halves(vp, rng.standard_normal(plane_shape).astype(np.float16))
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    kc = rng.standard_normal((1, KV, D)).astype(np.float32)
    partials = np.zeros((1, H, 32, 2 + D), np.float32)
    blocks = (visible + 31) // 32
    visits = np.zeros((1, blocks), np.int32)
    layers = np.zeros(1, np.int32)
    args = [q, kc, kc.copy(), kp, vp, partials, visits, layers, layers, 1, visible - 1,
            window, capacity, 0, 0, nwg, nsg, 0.125]
    if gpu:  # GPU kernels take device arrays
        args = [_dev(a) if isinstance(a, np.ndarray) else a for a in args]
        producer(*args)
        return args[6].to_numpy()[0]
    producer(*args)
    return visits[0]


def _dev(a):
    d = ti.ndarray(ti.types.primitive_types.f32 if a.dtype == np.float32 else ti.i32, a.shape)
    d.from_numpy(a)
    return d


@pytest.mark.parametrize("family", ["splitk", "interleaved"])
@pytest.mark.parametrize("visible, nwg, nsg", [
    (1, 1, 1), (33, 2, 1), (95, 3, 1), (2049, 32, 2), (5000, 32, 4), (777, 5, 4), (4096, 7, 2),
] + [(v,) + splitk_geometry(v) for v in (64, 1000, 2048, 4097)])
def test_kernels_visit_each_block_once_by_its_owner(arch, family, visible, nwg, nsg):
    visits = run_recording(family, visible, nwg, nsg)
    counts, owners = visits % VISIT_OWNER, visits // VISIT_OWNER
    assert counts.tolist() == [1] * len(visits), "a block was skipped or visited twice"
    assert owners.tolist() == [block_owner(b, nwg, nsg)[0] for b in range(len(visits))]
