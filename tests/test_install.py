"""Installing: a non-editable install ships configs/ and runs outside the checkout; the dependencies an embedding
application gets are ranges, not pins (except where the kernels depend on the release)."""

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_wheel_ships_the_configs_and_runs_outside_the_checkout(tmp_path):
    """Build the wheel (no network: no build isolation, no dependencies), install it into a scratch venv that
    sees this environment's packages (taichi, numpy, ...) but not the checkout, and from a folder outside the
    checkout run muser-decode --help, load_config("glimmer.yaml") and a bare sweep name."""
    src = tmp_path / "src"  # what the wheel is built from: a copy, so the checkout's build/ is left alone
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("muser_ti", "configs"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel, = (tmp_path / "dist").glob("muser_ti-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                                "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # this environment's packages, after the venv's own (a plain path: its .pth files, the editable install's
    # finder among them, are not run, so the checkout's muser_ti stays out of sight)
    (Path(purelib) / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    help_ = subprocess.run([str(venv / "bin" / "muser-decode"), "--help"], capture_output=True, text=True, cwd=outside,
                           env=env, timeout=120)
    assert help_.returncode == 0 and "usage: muser-decode" in help_.stdout, help_.stderr
    probe = ("import muser_ti as mt, muser_ti.config as c; from muser_ti.cli import sweep; "
             "g = mt.load_config('glimmer.yaml'); s = sweep.load_sweep('tiny.yaml'); "
             "print(mt.__file__, c.CONFIG_DIR, g.name, g.n_layers, s.name, sep='|')")
    out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=outside, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    module, config_dir, name, n_layers, sweep_name = out.stdout.strip().splitlines()[-1].split("|")
    assert Path(module).is_relative_to(venv) and Path(config_dir).is_relative_to(venv)  # the wheel's, not ours
    assert (name, n_layers, sweep_name) == ("muse-glimmer", "52", "tiny")


def test_checkout_configs_are_the_top_level_folder():
    """In a checkout muser_ti/configs is a link to configs/ (DESIGN.md's layout keeps it at the top level)."""
    from muser_ti.config import CONFIG_DIR, SWEEP_DIR

    assert CONFIG_DIR == (ROOT / "configs").resolve() and SWEEP_DIR == CONFIG_DIR / "sweeps"
    assert (ROOT / "muser_ti" / "configs").resolve() == CONFIG_DIR


def _name(requirement: str) -> str:
    return requirement.split(";")[0].split("[")[0].replace(">", "=").replace("<", "=").split("=")[0].strip().lower()


def test_dependencies_are_ranges_except_the_pinned_kernels_and_rung():
    deps = {_name(r): r for r in PYPROJECT["project"]["dependencies"]}
    pinned = {"taichi", "ggml-python"}  # the kernels' code generator; the llama rung's named version
    for name, requirement in deps.items():
        if name in pinned:
            assert "==" in requirement, requirement
        else:
            assert "==" not in requirement and ">=" in requirement and "<" in requirement, requirement
    assert {"numpy", "pyyaml", "safetensors"} <= set(deps)
    assert not {"rich", "matplotlib"} & set(deps), "the commands' packages are the [cli] extra"
    assert {_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["cli"]} == {"rich", "matplotlib"}


def test_setup_installs_what_the_tests_and_commands_need():
    text = (ROOT / "scripts" / "setup.sh").read_text()
    assert '-e ".[cli]"' in text and "test,cli" in text
    # it says what apt installs before apt installs it
    announce, install = text.index("installing system-wide with apt-get"), text.index("apt-get install -y")
    assert announce < install


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_setup_refuses_an_unknown_option():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--tset"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "usage:" in out.stderr
