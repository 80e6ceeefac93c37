"""§16.7's bandwidth arithmetic, checked against figures computed here by hand from the geometry
fields (never against constants copied from the chapter or from bandwidth.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import muser_ti as mt
from muser_ti import bandwidth as bw

ROOT = Path(__file__).resolve().parent.parent


def _by_hand(g, depth):
    """Independent arithmetic: count layer kinds from the pattern, multiply out the row."""
    kinds = [g.layer_pattern[i % len(g.layer_pattern)] for i in range(g.n_layers)]
    n_swa, n_nope = kinds.count("swa"), kinds.count("nope")
    row = g.n_kv_heads * 2 * g.head_dim * 2  # K and V, f16
    return row, n_swa * min(depth, g.window) * row, n_nope * depth * row


@pytest.mark.parametrize("depth", [1, 100, 2048, 32768, 131072])
def test_glimmer_figures(depth):
    g = mt.load_config("glimmer.yaml")
    row, swa, nope = _by_hand(g, depth)
    r = bw.at_depth(g, depth)
    assert bw.row_bytes(g) == row == 1024
    assert (r.swa_bytes, r.nope_bytes, r.kv_bytes) == (swa, nope, swa + nope)
    assert r.share == pytest.approx((swa + nope) / g.weight_stream_bytes, rel=1e-12)


def test_glimmer_chapter_claims_that_hold_and_that_do_not():
    g = mt.load_config("glimmer.yaml")
    # Holds: the SWA total at the window is ~81.8 MB and 131,072 tokens are ~10.9 % of the weights.
    assert bw.swa_bytes(g, g.window) == 39 * 2048 * 1024
    assert round(100 * bw.at_depth(g, 131072).share, 1) == 10.9
    # Does not hold: at D = 2,048 the KV read is 52 layers x 2,048 rows, ~0.109 GB (0.65 %), not 0.17 GB;
    # at 32,768 it is ~0.518 GB = 3.09 % of the weights, not 2.7 %.
    r = bw.at_depth(g, 2048)
    assert r.kv_bytes == 52 * 2048 * 1024 and round(r.kv_bytes / 1e9, 3) == 0.109
    assert round(100 * bw.at_depth(g, 32768).share, 2) == 3.09


def test_glimmer_crossover_none_within_context():
    g = mt.load_config("glimmer.yaml")
    c = bw.crossover(g)
    assert not c.within_context and c.depth > g.max_context
    row, swa_at_window, _ = _by_hand(g, g.window)
    n_nope = len(g.nope_layers)
    # smallest D with swa_at_window + n_nope*D*row >= weights (the chapter's 1.26 M drops the SWA term)
    want = -(-(g.weight_stream_bytes - swa_at_window) // (n_nope * row))
    assert c.depth == want
    assert bw.kv_bytes(g, g.max_context) < g.weight_stream_bytes


def test_crossover_inside_context_for_a_kv_heavy_model():
    # A small-weights, wide-KV model: 8 KV heads of 128, 4 NoPE layers, 1 GB of weights.
    g = mt.geometry_from_dict(dict(name="kv-heavy", n_heads=32, n_kv_heads=8, head_dim=128, n_layers=8,
                                   layer_pattern=["swa", "nope"], window=512, max_context=65536,
                                   attention_scale="auto", weight_stream_bytes=1_000_000_000))
    row, swa, _ = _by_hand(g, g.window)
    assert row == 4096
    c = bw.crossover(g)
    assert c.within_context
    # check the defining property directly rather than a closed form
    assert bw.kv_bytes(g, c.depth) >= g.weight_stream_bytes > bw.kv_bytes(g, c.depth - 1)
    assert c.depth == -(-(g.weight_stream_bytes - swa) // (4 * row))


def test_other_config_and_short_depths():
    # head_dim 64, 1 KV head, windows larger than the depth: the SWA term is not yet constant.
    g = mt.geometry_from_dict(dict(name="small", n_heads=4, n_kv_heads=1, head_dim=64, n_layers=6,
                                   layer_pattern=["swa", "swa", "nope"], window=100, max_context=1000,
                                   attention_scale="auto", weight_stream_bytes=10_000_000))
    for depth in (1, 50, 100, 101, 1000):
        row, swa, nope = _by_hand(g, depth)
        r = bw.at_depth(g, depth)
        assert row == 256 and (r.swa_bytes, r.nope_bytes) == (swa, nope)
    with pytest.raises(ValueError):
        bw.at_depth(g, 1001)


def test_swa_only_and_no_weights():
    g = mt.geometry_from_dict(dict(name="swa-only", n_heads=4, n_kv_heads=2, head_dim=64, n_layers=4,
                                   layer_pattern=["swa"], window=64, max_context=4096, attention_scale="auto",
                                   weight_stream_bytes=10_000_000))
    assert bw.crossover(g).depth is None  # saturates at 4*64*512 B
    g0 = g.with_overrides(weight_stream_bytes=0)
    assert bw.crossover(g0).depth is None and bw.at_depth(g0, 10).share is None


def test_decode_explain_prints_the_table():
    env = {k: v for k, v in os.environ.items() if k not in ("MUSER_GPU_TILE", "MUSER_GPU_UNROLL")}  # the default tiles
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "decode.py"), "--config", "glimmer.yaml", "--explain"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "1,024 B" in out.stdout and "10.90 %" in out.stdout and "none within max_context" in out.stdout
    # the GPU producer's tile per backend, from the same arithmetic tests/test_gpu_plan.py pins
    assert "cuda: warp tiles, 128 threads, each warp its own 32 rows of a 128-row tile" in out.stdout
    assert "loops unrolled x8; 37.2 of 48 KiB shared" in out.stdout and "loops unrolled x1" in out.stdout  # vulkan
    assert "metal: 128 threads; 128-row tiles" in out.stdout and "27.7 of 32 KiB shared" in out.stdout
    assert "chunks pipelined (packed halves in flight)" in out.stdout
