"""The GPU producer's static shape and the GPU split geometry: pure arithmetic, checked on every machine."""

import numpy as np
import pytest

from muser_ti.kernels.producer import tile_plan
from muser_ti.kernels.producer.block_tile import GPU_PRODUCER_THREADS, gpu_tile_plan
from muser_ti.kernels.producer.gpu_common import SHARED_BUDGET_BYTES, tile_choice, udiv, umod
from muser_ti.kernels.producer.warp_tile import CHUNK_HALVES, WARPS, warp_tile_plan
from muser_ti.kernels.split_geometry import (GPU_MAX_WORKGROUPS, GPU_TARGET_WORKGROUPS, gpu_items_cap, gpu_split_geometry,
                                    gpu_workgroups_per_pair, splitk_geometry)

GROUPS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 48, 64, 128]
HEAD_DIMS = [64, 128, 256]


def plans():
    for arch, budget in SHARED_BUDGET_BYTES.items():
        for G in GROUPS:
            for D in HEAD_DIMS:
                try:
                    yield arch, budget, gpu_tile_plan(G, D, budget)
                except ValueError as exc:  # only when the queries and the output slices fill the budget
                    assert "fits" in str(exc) and 2 * 4 * G * D >= budget, (arch, G, D, exc)


@pytest.mark.parametrize("backend_name, budget, p", list(plans()), ids=str)
def test_plan_covers_every_score_and_output_within_budget(backend_name, budget, p):
    T = p.T
    assert T == GPU_PRODUCER_THREADS
    assert p.shared_bytes <= budget
    # scores: HG head groups x RG row groups of threads, each HB heads x RB rows, cover G x R exactly once
    assert p.HB * p.HG == p.G and p.HG * p.RG <= T and p.RG * p.RB == p.R
    # values: RS slices x HGV head groups x DG dim groups of threads, each VH heads x VD dims
    assert p.VH * p.HGV == p.G and p.VD * p.DG == p.D and p.RS * p.HGV * p.DG <= T and p.RS >= 1
    assert p.HB * p.RB <= 64  # score accumulators per thread (register pressure)
    # value accumulators: at most 4 heads x 8 dims, unless no divisor of G up to 4 lets the threads cover G
    assert p.VH <= 4 or not any(p.G % d == 0 and (p.G // d) * p.DG <= T for d in range(1, 5))
    # K chunks (R rows x DC dims) and V chunks (VR rows x D dims) move the same count, a multiple of T
    assert p.R * p.DC == p.VR * p.D and (p.R * p.DC) % T == 0 and p.D % p.DC == 0 and p.R % p.VR == 0
    assert p.BUF >= max(p.R * (p.DC + 1), p.VR * (p.D + 1)) and (p.RS == 1 or p.BUF >= p.G * p.D)
    assert p.R <= 256 and p.RG & (p.RG - 1) == 0  # tiles of a power-of-two row groups
    assert (p.R * p.DC) % (2 * T) == 0  # every thread moves whole words of a chunk


def test_glimmer_plan_is_the_measured_one():
    """The block tile docs/PERF.md measured for 16 heads per KV head, d 128: the same on every backend,
    since it fits Metal's 32 KiB too."""
    for budget in SHARED_BUDGET_BYTES.values():
        p = gpu_tile_plan(16, 128, budget)
        assert (p.T, p.HB, p.RB, p.R, p.DC, p.VR, p.VH, p.VD, p.RS) == (128, 4, 4, 128, 16, 16, 4, 8, 2)
        assert p.shared_bytes == 28352


def test_plan_refuses_groups_wider_than_the_workgroup():
    with pytest.raises(ValueError, match="heads per KV head 512 must be <= 128"):
        gpu_tile_plan(512, 128, SHARED_BUDGET_BYTES["cuda"])


def test_tile_choice_reads_words_and_refuses_anything_else(monkeypatch):
    monkeypatch.delenv("MUSER_GPU_TILE", raising=False)
    monkeypatch.delenv("MUSER_GPU_UNROLL", raising=False)
    assert tile_choice() == {}
    assert tile_choice("block") == {"tile": "block"} and tile_choice("warp") == {"tile": "warp"}
    monkeypatch.setenv("MUSER_GPU_UNROLL", "1")
    assert tile_choice("") == {"unroll": 1}
    for bad in ("WT=0", "blocks", "T=256"):  # the two-letter knobs are gone: a rejected variant is no setting
        with pytest.raises(ValueError, match="MUSER_GPU_TILE"):
            tile_choice(bad)
    for bad in ("0", "-1", "x8"):
        monkeypatch.setenv("MUSER_GPU_UNROLL", bad)
        with pytest.raises(ValueError, match="MUSER_GPU_UNROLL"):
            tile_choice("")


@pytest.mark.parametrize("n", [1, 2, 16, 128, 7, 18, 112])  # powers of two: shift/mask; the rest: C division
def test_index_helpers_match_floor_division_on_thread_coordinates(arch, n):
    """udiv/umod stand in for // and % on the producer's non-negative indices (Glimmer's tile uses the
    powers of two, Qwen2.5-7B's group of 7 the divisions by 112 and 18)."""
    import taichi as ti

    x = np.arange(0, 70_000, 3, dtype=np.int32)
    xs, quo, rem = ti.ndarray(ti.i32, x.shape), ti.ndarray(ti.i32, x.shape), ti.ndarray(ti.i32, x.shape)
    xs.from_numpy(x)

    @ti.kernel
    def split(xs: ti.types.ndarray(ti.i32, ndim=1), quo: ti.types.ndarray(ti.i32, ndim=1),
              rem: ti.types.ndarray(ti.i32, ndim=1)):
        for i in range(xs.shape[0]):
            quo[i], rem[i] = udiv(xs[i], n), umod(xs[i], n)

    split(xs, quo, rem)
    np.testing.assert_array_equal(quo.to_numpy(), x // n)
    np.testing.assert_array_equal(rem.to_numpy(), x % n)


@pytest.mark.parametrize("visible", [1, 31, 33, 1000, 2048, 2049, 4097, 32768, 131072])
@pytest.mark.parametrize("n_pairs", [1, 2, 26, 78, 300])
def test_gpu_split_is_one_wave_and_keeps_the_chapters_nsg(visible, n_pairs):
    nwg, nsg = gpu_split_geometry(visible, n_pairs)
    assert nsg == splitk_geometry(visible)[1]
    runs = -(-((visible + 31) // 32) // nsg)
    assert 1 <= nwg <= min(runs, GPU_MAX_WORKGROUPS)  # never an empty workgroup
    # one wave: never more workgroups than the target unless every pair needs at least one
    assert nwg * n_pairs <= max(GPU_TARGET_WORKGROUPS, n_pairs)
    if runs * n_pairs >= 2 * GPU_TARGET_WORKGROUPS:  # enough work: the wave is at least half full
        assert nwg * n_pairs * 2 >= GPU_TARGET_WORKGROUPS


@pytest.mark.parametrize("target", [1, 2, 7, GPU_TARGET_WORKGROUPS, 2112])
@pytest.mark.parametrize("n_pairs", [1, 2, 26, 78, 104, 300])
def test_producer_bound_holds_every_split_a_launch_can_get(target, n_pairs):
    """A GPU producer's loop bound is gpu_items_cap(target, the engine's pairs), compiled in: every launch's
    pairs x workgroups must fit under it, for every depth and any group of the engine's layers, or its
    last items would never run.  The one-dispatch step bounds each class by its most workgroups a pair."""
    cap = gpu_items_cap(target, n_pairs)
    for group in sorted({g for g in (1, 2, n_pairs // 2, n_pairs) if 1 <= g <= n_pairs}):
        for visible in (1, 33, 2048, 4097, 131072, 1 << 22):
            assert group * gpu_split_geometry(visible, group, target)[0] <= cap, (group, visible)
    # and it is not loose: a deep launch over all the pairs leaves less than one workgroup a pair empty
    deep = n_pairs * gpu_split_geometry(1 << 22, n_pairs, target)[0]
    assert deep == n_pairs * gpu_workgroups_per_pair(n_pairs, target)
    assert cap - deep < n_pairs or gpu_workgroups_per_pair(n_pairs, target) == GPU_MAX_WORKGROUPS


def test_gpu_split_target_override(monkeypatch):
    monkeypatch.setenv("MUSER_GPU_TARGET_WORKGROUPS", "1")
    assert gpu_split_geometry(131072, 2) == (1, 4)
    assert gpu_split_geometry(131072, 2, target=528) == (264, 4)


def warp_plans():
    for arch, budget in SHARED_BUDGET_BYTES.items():
        for G in GROUPS:
            for D in HEAD_DIMS:
                p = warp_tile_plan(G, D, budget, arch=arch)
                if p is not None:
                    yield arch, budget, p


@pytest.mark.parametrize("backend_name, budget, p", list(warp_plans()), ids=str)
def test_warp_plan_covers_every_score_and_output_once_within_budget(backend_name, budget, p):
    assert p.T == WARPS * 32 and p.HGL * p.RGL == 32 and p.HGL * 4 == p.G and p.RW == 4 * p.RGL
    # a lane (hg, rg) scores heads hg + HGL*i and rows rg + RGL*j; it accumulates the same heads, dims
    # 4*rg + 4*RGL*jj + e: together the lanes cover G x RW scores and G x D outputs exactly once
    scores = sorted((hg + p.HGL * i, rg + p.RGL * j) for hg in range(p.HGL) for rg in range(p.RGL)
                    for i in range(4) for j in range(4))
    assert scores == sorted((h, r) for h in range(p.G) for r in range(p.RW))
    dims = sorted(4 * rg + 4 * p.RGL * jj + e for rg in range(p.RGL) for jj in range(p.VD // 4) for e in range(4))
    assert dims == list(range(p.D)) and 4 * p.VD <= 64
    # a chunk is CHUNK_HALVES halves, K (RW rows x DC dims) or V (VR rows x D), whole words per lane
    assert p.RW * p.DC == p.VR * p.D == CHUNK_HALVES and CHUNK_HALVES % (2 * 32) == 0
    assert p.D % p.DC == 0 and p.DC % 4 == 0 and p.RW % p.VR == 0
    assert p.BUF >= max(p.RW * (p.DC + 4), p.VR * p.D) and p.BUF % 4 == 0  # 128-bit aligned per warp
    assert p.shared_bytes <= budget


def test_glimmer_takes_warp_tiles_on_cuda_and_vulkan_and_the_block_tile_on_metal():
    for arch in ("cuda", "vulkan"):
        p = tile_plan(16, 128, SHARED_BUDGET_BYTES[arch], arch)
        assert (p.HGL, p.RGL, p.RW, p.DC, p.VR, p.VD, p.shared_bytes) == (4, 8, 32, 32, 8, 16, 38144)
        assert p.WU == (8 if arch == "cuda" else 1)  # UNROLL: measured on CUDA only
    assert tile_plan(16, 128, SHARED_BUDGET_BYTES["metal"], "metal") == gpu_tile_plan(16, 128, 32 * 1024)
    # "block" asks for the block tile where warp tiles apply; unroll sets the warp tile's
    assert tile_plan(16, 128, SHARED_BUDGET_BYTES["cuda"], "cuda", tile="block") == \
        gpu_tile_plan(16, 128, SHARED_BUDGET_BYTES["cuda"])
    assert tile_plan(16, 128, SHARED_BUDGET_BYTES["cuda"], "cuda", unroll=2).WU == 2
    with pytest.raises(ValueError, match="unroll 0"):
        tile_plan(16, 128, SHARED_BUDGET_BYTES["cuda"], "cuda", unroll=0)
    # Qwen2.5-7B's 7 heads per KV head and multi-head attention keep the block tile
    assert warp_tile_plan(7, 128, SHARED_BUDGET_BYTES["cuda"]) is None
    assert warp_tile_plan(1, 256, SHARED_BUDGET_BYTES["cuda"]) is None


def test_kernels_follow_the_tile_that_muser_gpu_tile_names(arch, monkeypatch):
    """The kernel cache is keyed by the tile plan: an engine made after MUSER_GPU_TILE changes gets that
    tile's kernels, not those of the first engine of the process (nothing compiles here: Taichi compiles
    on the first launch)."""
    from muser_ti.kernels.interleaved import build_interleaved
    from muser_ti.kernels.splitk import build_splitk

    gpu = arch != "cpu"
    monkeypatch.delenv("MUSER_GPU_TILE", raising=False)
    default = build_interleaved(128, 16, 2, 32, gpu)[0], build_splitk(128, 16, 2, 32, gpu)[0]
    monkeypatch.setenv("MUSER_GPU_TILE", "block")
    block = build_interleaved(128, 16, 2, 32, gpu)[0], build_splitk(128, 16, 2, 32, gpu)[0]
    monkeypatch.delenv("MUSER_GPU_TILE")
    again = build_interleaved(128, 16, 2, 32, gpu)[0], build_splitk(128, 16, 2, 32, gpu)[0]
    assert again[0] is default[0] and again[1] is default[1]
    if gpu:  # the block tile instead of the warp tile
        assert block[0] is not default[0] and block[1] is not default[1]
    else:  # the CPU producer has no tile
        assert block[0] is default[0] and block[1] is default[1]


@pytest.mark.parametrize("n_pairs, target, window", [(26, GPU_TARGET_WORKGROUPS, 0), (78, GPU_TARGET_WORKGROUPS, 4096),
                                                     (2, 528, 0), (1, 2, 300), (2048, 264, 0)])
def test_split_computed_in_a_kernel_matches_gpu_split_geometry(arch, n_pairs, target, window):
    """The one-dispatch step computes each class's split from the position (split_geometry.gpu_split_func):
    the same (workgroups, simdgroups) as the host's rule, at every depth where either changes."""
    import taichi as ti

    from muser_ti.kernels.split_geometry import gpu_split_func

    split = gpu_split_func(n_pairs, target, window)
    positions = np.unique(np.concatenate([np.arange(0, 4200), np.geomspace(4200, 1 << 20, 400).astype(np.int64),
                                          np.array([2047, 2048, 8191, 32767, 131071, 131072])]))
    pos = ti.ndarray(ti.i32, positions.shape)
    pos.from_numpy(positions.astype(np.int32))
    got = ti.ndarray(ti.i32, positions.shape + (2,))

    @ti.kernel
    def evaluate(pos: ti.types.ndarray(dtype=ti.i32, ndim=1), got: ti.types.ndarray(dtype=ti.i32, ndim=2)):
        for i in range(pos.shape[0]):
            nwg, nsg = split(pos[i])
            got[i, 0] = nwg
            got[i, 1] = nsg

    evaluate(pos, got)
    visible = positions + 1 if window == 0 else np.minimum(positions + 1, window)
    want = np.array([gpu_split_geometry(int(n), n_pairs, target) for n in visible])
    np.testing.assert_array_equal(got.to_numpy(), want)
