"""Each own route against the float64 reference in every plane state the chapter names.

Every step of every scenario is checked (Session.step asserts the bound); each scenario also
asserts that it really reached the plane state it is named after.
"""

import zlib

import numpy as np
import pytest

import muser_ti as mt
from muser_ti import EngineError
from muser_ti.kernels.producer import active_tile_plan
from muser_ti.kernels.producer.warp_tile import WarpTilePlan
from sessions import DISTRIBUTIONS, GEOMETRIES, Session, covering_product, geometry, own_routes_only


def swa_state(s):
    return s.eng.planes["swa"].state


def nope_state(s):
    return s.eng.planes["nope"].state


def scenario_visible_1_and_before_wrap(s):
    s.step()  # position 0: visible = 1 on every layer
    assert s.eng.kv_bytes_last_step() == s.cfg.n_layers * s.cfg.kv_bytes_per_row
    for _ in range(40):  # len passes 32 and stays short of the 64-row window
        s.step()
    st = swa_state(s)
    assert st.origin_physical == 0 and st.len == 41 < st.capacity


def scenario_exactly_full(s):
    s.prefill(62)
    s.step()
    s.step()  # position 63: len == capacity == window, origin still 0
    st = swa_state(s)
    assert st.len == st.capacity == 64 and st.origin_physical == 0


def scenario_wrapped_and_full(s):
    s.prefill(100)
    for _ in range(40):
        s.step()
    st = swa_state(s)
    assert st.len == st.capacity and st.origin_physical != 0


def scenario_partially_wrapped_slack(s):
    # ring of 64 + 16 slack: full and wrapped, then a rollback of 8 leaves it partially wrapped
    s.prefill(100)
    s.step()
    s.rewind(s.eng.position - 8)
    s.step()
    st = swa_state(s)
    assert st.origin_physical != 0 and st.len < st.capacity, st
    for _ in range(12):  # through the refill back to full
        s.step()
    assert swa_state(s).len == swa_state(s).capacity


def scenario_rewind_without_slack(s):
    # a ring with capacity == window can roll back exactly one token (the new one takes its slot)
    s.prefill(100)
    s.step()
    before = s.eng.planes_snapshot()
    with pytest.raises(EngineError, match="cannot rewind"):
        s.eng.rewind(s.eng.position - 2)
    after = s.eng.planes_snapshot()
    for kind in before:
        assert before[kind][2] == after[kind][2]
        np.testing.assert_array_equal(before[kind][0], after[kind][0])
        np.testing.assert_array_equal(before[kind][1], after[kind][1])
    s.rewind(s.eng.position - 1)
    assert swa_state(s).len == swa_state(s).capacity - 1 and swa_state(s).origin_physical != 0
    s.step()
    s.step()


def scenario_nope_growth(s):
    s.prefill(60)
    for _ in range(10):  # the head-major plane grows 64 -> 128 mid-stream
        s.step()
    assert nope_state(s).capacity == 128 and nope_state(s).len == 70


SCENARIOS = {
    "visible1-before-wrap": (scenario_visible_1_and_before_wrap, {}),
    "exactly-full": (scenario_exactly_full, {}),
    "wrapped-full": (scenario_wrapped_and_full, {}),
    "partially-wrapped-slack": (scenario_partially_wrapped_slack, dict(slack=16)),
    "rewind-no-slack": (scenario_rewind_without_slack, {}),
    "nope-growth": (scenario_nope_growth, {}),
}


# every plane state the chapter names, in every geometry (the GPU producer's tiles and index paths); lavapipe runs a
# covering set: each state once, each geometry at least once
@pytest.mark.parametrize("scenario, geom", covering_product(list(SCENARIOS), list(GEOMETRIES)))
def test_own_routes_match_reference(arch, geom, scenario):
    run, extra = SCENARIOS[scenario]
    cfg = geometry(window=64, **GEOMETRIES[geom], **extra)
    s = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=zlib.crc32(f"{geom}{scenario}".encode()))
    run(s)
    assert own_routes_only(s.eng) and s.eng.routes[0] == "splitk" and s.eng.routes[3] == "interleaved"


# 48: len never a multiple of 32 once full (a ring of one and a half vec blocks); 64: two whole blocks.  48 is
# test_step_device's window and 64 this module's: on a GPU each window is a compile of the one-dispatch step
# (minutes on lavapipe), which these share.  lavapipe runs each distribution once, the windows alternating
@pytest.mark.parametrize("dist, window", covering_product(DISTRIBUTIONS, [48, 64]))
def test_distributions_through_the_wrap(arch, dist, window):
    cfg = geometry(window=window, **GEOMETRIES["gqa16-d128"])
    s = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=window, dist=dist)
    s.prefill(window - 5)
    for _ in range(12):
        s.step()
    assert swa_state(s).origin_physical != 0


def test_tiny_session_capacity_below_32(arch):
    """The chapter's deliberately tiny raw session: every plane smaller than one 32-row vec block."""
    cfg = geometry(window=8, **GEOMETRIES["gqa4-d64"])
    s = Session(mt.Engine(cfg, arch=arch, pinned="off", capacity=16), seed=5)
    for _ in range(16):
        out = s.step()
        assert np.isfinite(out).all()  # no read past a small allocation poisons the distribution
    assert swa_state(s).capacity == 16 and nope_state(s).capacity == 16 and nope_state(s).len == 16
    before = s.eng.planes_snapshot()
    with pytest.raises(EngineError, match="NoPE plane is at its capacity of 16"):
        s.step()
    after = s.eng.planes_snapshot()
    assert s.eng.position == 16 and before["nope"][2] == after["nope"][2]
    np.testing.assert_array_equal(before["swa"][0], after["swa"][0])


def test_tiny_ring_wraps(arch):
    cfg = geometry(window=8, pattern=("swa",), n_layers=2, **GEOMETRIES["gqa4-d64"])
    s = Session(mt.Engine(cfg, arch=arch, pinned="off", capacity=16), seed=7)
    for _ in range(40):
        assert np.isfinite(s.step()).all()
    st = swa_state(s)
    assert st.capacity == 16 < 32 and st.origin_physical != 0 and st.len == 16


def test_tiny_ring_smaller_than_window_is_refused(arch):
    cfg = geometry(window=64, pattern=("swa",), n_layers=2, **GEOMETRIES["gqa4-d64"])
    s = Session(mt.Engine(cfg, arch=arch, pinned="off", capacity=16), seed=6)
    for _ in range(16):
        s.step()
    with pytest.raises(EngineError, match="cannot hold the .* rows its window sees"):
        s.step()
    assert s.eng.position == 16


# Every lane split of the GPU producer's warp tile (kernels/producer/warp_tile.py): 4 head groups x 8 row
# groups (Glimmer's 16 heads per KV head), 2 x 16 (8 heads, d 64) and 1 x 32 (4 heads, d 128); and the block
# tile at Glimmer's shape.  The split is forced down to one workgroup per (layer, KV head), so a workgroup
# owns every visible row and all its warps work through several tiles (128 rows at 4 warps), the current
# token landing in a later warp's rows; at the default split a few hundred rows give each workgroup one
# 32-row block, which only the first warp sees.
@pytest.mark.parametrize("n_heads, head_dim, tile", [(32, 128, ""), (16, 64, ""), (8, 128, ""), (32, 128, "block")])
def test_warp_tiles_with_every_warp_busy_match_reference(arch, n_heads, head_dim, tile, monkeypatch):
    if arch == "cpu":
        pytest.skip("the CPU producer has no GPU tiles")
    monkeypatch.setenv("MUSER_GPU_TILE", tile)
    if tile != "block" and not isinstance(active_tile_plan(head_dim, n_heads // 2), WarpTilePlan):
        pytest.skip(f"{arch} runs the block tile for this shape (its shared memory, warp_tile.warp_tile_plan)")
    monkeypatch.setenv("MUSER_GPU_TARGET_WORKGROUPS", "2")
    cfg = geometry(window=64, n_heads=n_heads, head_dim=head_dim)
    s = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=n_heads + head_dim)
    # the tiles through the graph route's producers: the one-dispatch step runs the same tile functions
    # (test_step_device holds its bits to the graph route's), and its compile for this split target (its
    # constant) would cost minutes on lavapipe for no path of its own
    s.eng.launcher.step_kernel = None
    s.prefill(300)
    for _ in range(5):  # NoPE: 301-305 rows in one workgroup, 2.4 tiles; SWA: 64 rows, two warps' worth
        s.step()
    assert own_routes_only(s.eng) and s.eng.split_geometry(s.eng.position, 1)[0] == 1
