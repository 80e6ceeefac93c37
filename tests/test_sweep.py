"""muser-sweep (muser_ti/cli/sweep.py): sweep files are validated before any engine is built, and sweeps resume."""

from pathlib import Path

import pytest
import yaml

import muser_ti as mt
from muser_ti.cli import sweep


TINY = dict(name="tiny-test", n_heads=4, n_kv_heads=2, head_dim=64, n_layers=2, layer_pattern=["swa", "nope"],
            window=8, max_context=64, attention_scale="auto", weight_stream_bytes=1_000_000)


def _write(tmp_path, axes, fixed=None, run=None, name="t"):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    doc = {"name": name, "base": "tiny.yaml", "axes": axes, "fixed": fixed or {"arch": "cpu"},
           "run": run or {"steps": 1, "warmup": 1}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def no_engine(monkeypatch):
    """Any engine construction during validation is a test failure."""
    def boom(*a, **k):
        raise AssertionError("an Engine was built before the sweep was validated")
    monkeypatch.setattr(mt, "Engine", boom)


@pytest.mark.parametrize("axes, fixed, match", [
    ({"heads": [1, 2]}, None, "unknown axis"),
    ({"n_kv_heads": [1, 3]}, None, "n_kv_heads"),            # 3 does not divide n_heads=4
    ({"head_dim": [64, 96]}, None, "head_dim"),
    ({"depth": [1, 65]}, None, "max_context"),
    ({"depth": [0]}, None, "positive integer"),
    ({"depth": []}, None, "non-empty list"),
    ({"arch": ["tpu"]}, None, "arch"),
    ({"capacity": [4]}, {"arch": "cpu", "depth": 8}, "capacity"),  # a 4-row ring cannot hold an 8-row window
    ({"depth": [10, 20]}, {"arch": "cpu", "capacity": 16}, "NoPE plane"),  # 20 > a NoPE plane capped at 16
    ({"layer_pattern": [["swa", "rope"]]}, None, "layer_pattern"),
])
def test_bad_sweep_files_fail_before_anything_runs(tmp_path, no_engine, axes, fixed, match):
    with pytest.raises(sweep.SweepError, match=match):
        sweep.load_sweep(_write(tmp_path, axes, fixed))


def test_unknown_run_option_and_top_level_key(tmp_path, no_engine):
    with pytest.raises(sweep.SweepError, match="unknown option"):
        sweep.load_sweep(_write(tmp_path, {"depth": [1]}, run={"stepz": 2}))
    p = _write(tmp_path, {"depth": [1]})
    doc = yaml.safe_load(p.read_text()) | {"axis": {}}
    p.write_text(yaml.safe_dump(doc))
    with pytest.raises(sweep.SweepError, match="unknown key"):
        sweep.load_sweep(p)


@pytest.mark.parametrize("axes, fixed", [({"pinned": ["off", "on"]}, None),
                                         ({"graph": ["teacher", "serving"]}, {"arch": "cpu", "pinned": "on"})])
def test_pinned_on_or_serving_rejected_without_the_library(tmp_path, no_engine, monkeypatch, axes, fixed):
    monkeypatch.setattr(mt, "pinned_library_status", lambda *a, **k: (False, "no library in this test"))
    with pytest.raises(sweep.SweepError, match="needs the pinned llama library.*no library in this test"):
        sweep.load_sweep(_write(tmp_path, axes, fixed))


def test_serving_needs_pinned_on(tmp_path, no_engine):
    """pinned=auto never takes the rung (its f16 accumulator), so the serving graph asks for pinned=on."""
    with pytest.raises(sweep.SweepError, match="graph=serving .* needs pinned=on"):
        sweep.load_sweep(_write(tmp_path, {"graph": ["teacher", "serving"]}))


def test_yaml_bare_off_means_pinned_off(tmp_path, no_engine):
    p = tmp_path / "s.yaml"
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    p.write_text("base: tiny.yaml\naxes:\n  pinned: [off]\n")
    assert sweep.load_sweep(p).points[0].engine["pinned"] == "off"


def test_sweep_runs_writes_outputs_and_resumes(tmp_path):
    path = _write(tmp_path, {"depth": [1, 9, 12], "pinned": ["off"]}, run={"steps": 1, "warmup": 1, "floor_gbps": 10.0})
    out = tmp_path / "out"
    first = sweep.run_sweep(sweep.load_sweep(path), out, quiet=True)
    assert (first["executed"], first["skipped"]) == (3, 0)
    rows = sweep.read_rows(first["csv"], sweep.columns(sweep.load_sweep(path)))
    assert [int(r["depth"]) for r in rows] == [1, 9, 12]
    for r in rows:  # the own routes, checked against the float64 reference; bytes from the arithmetic
        assert r["routes"] == "splitk:1;interleaved:1"
        assert float(r["err_max"]) <= mt.tolerances.F32_ROUTE_RTOL
        assert int(r["kv_bytes"]) == int(r["kv_bytes_model"])
        assert float(r["splitk_s"]) > 0 and float(r["interleaved_s"]) > 0
    assert int(rows[2]["kv_bytes"]) == (8 + 12) * 2 * 2 * 64 * 2  # SWA capped at the window, NoPE at depth
    assert all(p.stat().st_size > 0 for p in first["png"]) and first["md"].read_text().count("\n| ") >= 4

    # Interrupted sweep: drop the last row, then run again: only that point runs.
    lines = first["csv"].read_text().splitlines(keepends=True)
    first["csv"].write_text("".join(lines[:-1]))
    again = sweep.run_sweep(sweep.load_sweep(path), out, quiet=True, plots=False)
    assert (again["executed"], again["skipped"]) == (1, 2)
    # Complete: the second run executes zero points.
    done = sweep.run_sweep(sweep.load_sweep(path), out, quiet=True, plots=False)
    assert (done["executed"], done["skipped"]) == (0, 3)
    assert len(first["csv"].read_text().splitlines()) == 4


# ---- where a user's sweep reads and writes ----------------------------------------------------------------
def test_bare_sweep_names_resolve_to_configs_sweeps(tmp_path, monkeypatch, no_engine):
    """`muser-sweep --config tiny.yaml` finds configs/sweeps/tiny.yaml, as muser-decode finds configs/NAME."""
    from muser_ti.config import SWEEP_DIR

    monkeypatch.chdir(tmp_path)
    s = sweep.load_sweep("tiny.yaml")
    assert s.path == SWEEP_DIR / "tiny.yaml" and s.name == "tiny"
    (tmp_path / "tiny.yaml").write_text("not: a sweep")  # a file of that name here is a path, as for configs
    with pytest.raises(sweep.SweepError, match="unknown key"):
        sweep.load_sweep("tiny.yaml")


def test_a_users_sweep_writes_outside_the_tracked_tree(tmp_path, monkeypatch):
    """The default output folder is out/sweeps/ under the current folder, which git ignores: from a fresh
    clone the README's command measures every point (the committed docs/sweeps/ results are not a run to
    resume), and only a command that names docs/sweeps/ writes there."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    assert sweep.DEFAULT_OUT == Path("out") / "sweeps"
    ignored = subprocess.run(["git", "check-ignore", "-q", "out/sweeps/tiny.csv"], cwd=root)
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0  # .gitignore's /out/
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs" / "sweeps").mkdir(parents=True)  # a clone's committed results, all of t's points
    path = _write(tmp_path, {"depth": [4]}, run={"steps": 1, "warmup": 0, "floor_gbps": 10.0, "per_route": False})
    committed = tmp_path / "docs" / "sweeps" / "t.csv"
    committed.write_text("the committed results\n")
    assert sweep.main(["--config", str(path), "--no-plots"]) == 0
    assert committed.read_text() == "the committed results\n"
    rows = sweep.read_rows(tmp_path / "out" / "sweeps" / "t.csv", sweep.columns(sweep.load_sweep(path)))
    assert len(rows) == 1
    made_by = (tmp_path / "out" / "sweeps" / "t.md").read_text()
    assert "--out out/sweeps`" in made_by


# ---- what a user sees of a sweep ---------------------------------------------------------------------------
def _committed_tiny(out: Path) -> Path:
    """The committed tiny sweep's CSV, copied where a run may resume from it (its 42 points all measured)."""
    import shutil

    out.mkdir()
    return Path(shutil.copy(Path(__file__).resolve().parent.parent / "docs" / "sweeps" / "tiny.csv", out))


def test_a_resumed_sweep_says_what_it_resumed(tmp_path):
    """Every point already in the CSV: one line saying so, no '0/0' bar; a partial CSV: a run that says it resumed."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "sweep.py"
    out = tmp_path / "out"
    _committed_tiny(out)
    done = subprocess.run([sys.executable, str(script), "--config", "tiny.yaml", "--out", str(out), "--no-plots"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"tiny: all 42 points already in {out / 'tiny.csv'}; nothing to run" in done.stdout
    assert "0/0" not in done.stdout + done.stderr and "done before" not in done.stdout + done.stderr
    assert sweep.outcome("tiny", 2, 40, Path("t.csv")) == "tiny: resumed: ran 2 point(s) after the 40 already in t.csv"
    assert sweep.outcome("tiny", 42, 0, Path("t.csv")) == "tiny: ran 42 point(s) into t.csv"


def test_a_sweeps_panels_lie_in_a_grid_readable_at_a_pages_width(tmp_path):
    """tiny.yaml's 14 panels once made one 8,470-pixel row; three a row, they fit a page's width."""
    import matplotlib.image

    from muser_ti.cli.sweep_report import grid, write_plots

    assert [grid(n) for n in (1, 2, 3, 4, 7, 14)] == [(1, 1), (1, 2), (1, 3), (2, 2), (3, 3), (5, 3)]
    s = sweep.load_sweep("tiny.yaml")
    rows = sweep.read_rows(_committed_tiny(tmp_path / "out"), sweep.columns(s))
    for png in write_plots(s, rows, tmp_path / "out"):
        height, width = matplotlib.image.imread(png).shape[:2]
        assert width <= 1700 and height <= 2200, (png.name, width, height)
