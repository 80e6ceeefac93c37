"""The commands as a user runs them: scripts/*.py from a checkout and the installed console entry points."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
# a small geometry the route tests compile too (tests/sessions.py's gqa4-d64), so its kernels come from the cache
TINY = dict(name="tiny-cli", n_heads=8, n_kv_heads=2, head_dim=64, n_layers=4, layer_pattern=["swa", "swa", "swa", "nope"],
            window=64, max_context=4096, attention_scale="auto", weight_stream_bytes=1_000_000)


def test_decode_json_writes_only_json_to_stdout(tmp_path):
    """`decode.py --json | jq .` must work: Taichi's banners and logs go to stderr, the summary alone to stdout."""
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "decode.py"), "--config", str(config), "--arch", "cpu",
                          "--pinned", "off", "--start-depth", "70", "--tokens", "3", "--check", "--json"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)  # the whole of stdout, nothing before or after
    assert summary["model"] == "tiny-cli" and summary["final_position"] == 73
    assert summary["routes_per_class"] == {"swa": {"splitk": 9}, "nope": {"interleaved": 3}}
    assert summary["max_rel_error"] <= summary["rel_error_bound"]
    assert "[Taichi]" in out.stderr  # the banner is not lost, only moved


def test_decode_reports_bad_input_on_stderr_with_status_2(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "decode.py"), "--config", str(tmp_path / "absent.yaml"),
                          "--json"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert "absent.yaml" in out.stderr


@pytest.mark.parametrize("command", ["muser-decode", "muser-sweep", "muser-bench"])
def test_console_entry_points_are_installed(command):
    exe = Path(sys.executable).parent / command
    if not exe.exists():
        pytest.skip(f"{command}: the package is not installed in this environment (scripts/setup.sh installs it)")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr
