"""The commands as a user runs them: scripts/*.py from a checkout and the installed console entry points."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import muser_ti as mt

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
    # the same keys on a run that differs in everything optional: no --check, a ring that never wraps
    plain = subprocess.run([sys.executable, str(ROOT / "scripts" / "decode.py"), "--config", str(config), "--arch",
                            "cpu", "--pinned", "off", "--start-depth", "10", "--tokens", "3", "--json"],
                           capture_output=True, text=True, timeout=600, cwd=tmp_path)
    other = json.loads(plain.stdout)
    assert set(other) == set(summary) and set(other["swa_ring"]) == set(summary["swa_ring"])
    assert other["max_rel_error"] is None and other["swa_ring"]["wrapped_during"] is None
    assert summary["swa_ring"]["wrapped_during"] == "prefill" and summary["swa_ring"]["wrapped_at_token"] is None


def test_decode_reports_bad_input_on_stderr_with_status_2(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "decode.py"), "--config", str(tmp_path / "absent.yaml"),
                          "--json"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert "absent.yaml" in out.stderr


@pytest.mark.parametrize("command", ["muser-decode", "muser-sweep", "muser-bench", "muser-model"])
def test_console_entry_points_are_installed(command):
    exe = Path(sys.executable).parent / command
    if not exe.exists():
        pytest.skip(f"{command}: the package is not installed in this environment (scripts/setup.sh installs it)")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr


# ---- what a newcomer gets when something is wrong: one `error:` line, status 2, no traceback ---------------
def run_command(script: str, *args: str, cwd=None, env=None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / f"{script}.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=env)


def assert_one_error_line(out: subprocess.CompletedProcess, *words: str) -> str:
    """Status 2, exactly one `error:` line on stderr (the last), no traceback anywhere; returns the line."""
    both = out.stdout + out.stderr
    assert "Traceback" not in both, both
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1, both
    assert out.stderr.strip().splitlines()[-1] == errors[0]
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


def _tiny_config(tmp_path) -> Path:
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    return config


@pytest.mark.parametrize("args, words", [
    (["--tokens", "0"], ["--tokens", ">= 1", "'0'"]),
    (["--tokens", "-5"], ["--tokens", ">= 1", "'-5'"]),
    (["--start-depth", "-1"], ["--start-depth", ">= 0"]),
    (["--tokens", "abc"], ["--tokens", "'abc'"]),
    # one minimum, the session's: its NoPE planes keep all 2,064 tokens, more than the rings' window of 2,048
    (["--capacity", "100"], ["--capacity 100", "needs 2064 rows", "NoPE planes keep all 2064", "the last 2048 (its "
                             "window)", ">= 2064"]),
    (["--capacity", "40", "--start-depth", "40", "--tokens", "4"], ["--capacity 40", "needs 44 rows", ">= 44"]),
    (["--start-depth", "131072"], ["max_context of 131072"]),
    (["--config", "absent.yaml"], ["absent.yaml", "no such config file"]),
    (["--arch", "metal"], ["macOS", "Metal"]),
    (["--arch", "tpu"], ["--arch", "invalid choice"]),
    (["--route", "splitk", "--pinned", "sideways"], ["--pinned"]),
])
def test_decode_bad_input_is_one_error_line(tmp_path, args, words):
    assert_one_error_line(run_command("decode", *args, cwd=tmp_path), *words)


# Each way a config path can be wrong, through one command each: every command reads its config (and muser-sweep
# its sweep file) with muser_ti.config.read_yaml, so one command per case covers the path every command takes
# (test_config.py checks each case on the API; muser-sweep's top-level check is its own, so it gets a case too).
@pytest.mark.parametrize("script, case", [
    ("decode", "not UTF-8"),
    ("bench", "unreadable"),
    ("sweep", "a directory"),
    ("model", "not YAML"),
    ("decode", "not a mapping"),
    ("sweep", "not a mapping"),
    ("bench", "a device"),
    ("decode", "too large"),
    ("model", "empty"),
])
def test_every_bad_config_path_is_one_error_line(tmp_path, script, case):
    from test_config import bad_paths

    if script == "model":
        pytest.importorskip("transformers")  # muser-model asks for its framework before it reads --config
    path, words = bad_paths(tmp_path)[case]
    out = run_command(script, "--config", str(path), *([] if script == "sweep" else ["--arch", "cpu"]), cwd=tmp_path)
    if script == "sweep" and case == "not a mapping":
        words = [str(path), "expected a mapping with keys name, base", "got a list"]
    assert_one_error_line(out, *words)


@pytest.mark.parametrize("command", ["decode", "sweep", "bench", "model"])
def test_every_option_has_help_that_shows_its_default(command):
    """`--help` tells a newcomer what each option does and what it is when left out."""
    import importlib

    ap = importlib.import_module(f"muser_ti.cli.{command}").parser()
    formatter = ap._get_formatter()
    for action in ap._actions:
        if action.dest == "help":
            continue
        assert action.help, f"muser-{command} {action.option_strings[0]} has no help text"
        shown = formatter._expand_help(action)
        assert "default" in shown.lower(), f"muser-{command} {action.option_strings[0]}: {shown!r}"
    out = run_command(command, "--help")
    assert out.returncode == 0 and "(default: glimmer.yaml)" in out.stdout or command == "sweep", out.stdout


def test_decode_without_cuda_says_what_would_make_it_available(tmp_path):
    from muser_ti import backend

    if backend._cuda_available():
        pytest.skip("this machine has a CUDA driver: --arch cuda starts")
    assert_one_error_line(run_command("decode", "--arch", "cuda", cwd=tmp_path), "cuda", "NVIDIA GPU", "driver")


def test_vulkan_unavailable_names_the_packages(monkeypatch):
    """The message for a machine without Vulkan (not this one, maybe): what to install."""
    from muser_ti import backend

    monkeypatch.setattr(backend, "has_vulkan", lambda: False)
    monkeypatch.setattr(backend, "_active", None)
    with pytest.raises(mt.BackendError, match="libvulkan1 mesa-vulkan-drivers"):
        backend.activate("vulkan")


def test_backend_error_is_exported():
    from muser_ti import errors

    assert mt.BackendError is errors.BackendError and "BackendError" in mt.__all__


@pytest.mark.parametrize("args, words", [
    (["--layer-depths", "abc"], ["--layer-depths", "'abc'"]),
    (["--step-depths", "2048,x"], ["--step-depths", "'x' in '2048,x'"]),
    (["--config", "typo.yaml"], ["typo.yaml", "no such config file"]),
    (["--routes", "fast"], ["--routes", "splitk, interleaved"]),
    (["--rounds", "0"], ["--rounds", ">= 1"]),
    (["--arch", "metal"], ["--arch", "invalid choice"]),
])
def test_bench_bad_input_is_one_error_line(tmp_path, args, words):
    assert_one_error_line(run_command("bench", *args, cwd=tmp_path), *words)


def test_sweep_bad_input_is_one_error_line(tmp_path):
    assert_one_error_line(run_command("sweep", "--config", "typo.yaml", cwd=tmp_path), "typo.yaml", "configs/sweeps")
    assert_one_error_line(run_command("sweep", cwd=tmp_path), "--config")
    (tmp_path / "a-file").write_text("")  # --out names a file: mkdir's error, as one line
    assert_one_error_line(run_command("sweep", "--config", "tiny.yaml", "--out", "a-file", cwd=tmp_path), "a-file")


def test_sweep_on_a_missing_backend_fails_before_writing(tmp_path):
    """A sweep over arch: [metal] on Linux: one error line saying what Metal needs, and no CSV begun."""
    if sys.platform == "darwin":
        pytest.skip("macOS has Metal")
    sweep_file = tmp_path / "metal.yaml"
    sweep_file.write_text(yaml.safe_dump({"name": "metal-try", "base": "glimmer.yaml",
                                          "fixed": {k: TINY[k] for k in ("n_heads", "n_kv_heads", "head_dim", "n_layers",
                                                                         "window", "max_context")},
                                          "axes": {"arch": ["metal"], "depth": [4]}}))
    out = run_command("sweep", "--config", str(sweep_file), "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert_one_error_line(out, "metal", "macOS")
    assert not (tmp_path / "o").exists()


def test_commands_without_rich_say_what_to_install(tmp_path):
    """rich and matplotlib are the [cli] extra: a command without them says how to get them, in one line."""
    code = ("import sys; sys.modules['rich'] = None; from muser_ti.cli.decode import main; "
            f"sys.exit(main(['--config', {str(_tiny_config(tmp_path))!r}, '--arch', 'cpu', '--tokens', '1', "
            "'--start-depth', '1']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert_one_error_line(out, "rich", f"pip install -e '.[cli]' in {ROOT}")  # this checkout is installed editable


def test_the_install_hint_follows_how_the_package_was_installed(tmp_path, monkeypatch):
    """An editable checkout installs an extra from the checkout (as the README says); a wheel from the index."""
    import muser_ti.cli as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "checkout", lambda: None)
    assert cli.install_hint("hf") == "pip install 'muser-ti[hf]'"
    monkeypatch.setattr(cli, "checkout", lambda: tmp_path)
    assert cli.install_hint("hf") == "pip install -e '.[hf]'"
    monkeypatch.setattr(cli, "checkout", lambda: ROOT)
    assert cli.install_hint("mlx") == f"pip install -e '.[mlx]' in {ROOT}"


def test_an_editable_install_is_found_from_pips_record(tmp_path, monkeypatch):
    """PEP 610's direct_url.json names the checkout of an editable install; a wheel's says nothing editable."""
    import importlib.metadata as metadata

    import muser_ti.cli as cli

    class Dist:
        def __init__(self, record):
            self.record = record

        def read_text(self, name):
            return json.dumps(self.record) if name == "direct_url.json" else None

    editable = {"dir_info": {"editable": True}, "url": f"file://{tmp_path}/my%20checkout"}
    monkeypatch.setattr(metadata, "distributions", lambda name: [Dist(editable)])
    assert cli.checkout() == tmp_path / "my checkout"
    monkeypatch.setattr(metadata, "distributions", lambda name: [Dist({"url": "https://x/muser_ti.whl",
                                                                          "archive_info": {}})])
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "muser_ti" / "cli" / "__init__.py"))
    assert cli.checkout() is None


def sigint_default_in_child():
    """preexec_fn of a child the test interrupts: SIGINT's default action whatever this process inherited (a
    suite started as a background job inherits it ignored); Python then installs its KeyboardInterrupt handler."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_decode_interrupted_prints_one_line_after_the_token(tmp_path):
    """Ctrl-C mid-decode: one `interrupted after N of M decoded tokens` line, status 130, no traceback."""
    import signal
    import time

    geometry = dict(TINY, max_context=200_000)
    config = tmp_path / "long.yaml"
    config.write_text(yaml.safe_dump(geometry))
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "decode.py"), "--config", str(config), "--arch", "cpu",
                             "--pinned", "off", "--start-depth", "70", "--tokens", "100000", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            preexec_fn=sigint_default_in_child)
    try:
        seen = ""
        deadline = time.monotonic() + 240
        while "Starting on arch" not in seen and proc.poll() is None and time.monotonic() < deadline:
            seen += proc.stderr.readline()  # the engine is being built
        time.sleep(3.0)  # into the decode (or the first token's compile, which the interrupt waits for)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    stderr = seen + stderr
    assert "Traceback" not in stderr + stdout, stderr
    assert proc.returncode == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted after ") and "of 100000 decoded tokens" in last, last
    assert stdout == ""  # --json: no summary for a session cut short


def test_decode_says_when_it_compiles(tmp_path):
    """A cold kernel cache (a fresh Taichi cache folder) gets the "compiling kernels" line and a first step that
    says it compiled; the next run neither: its first step says its kernels came from the cache."""
    config = _tiny_config(tmp_path)
    env = dict(os.environ, TI_OFFLINE_CACHE_FILE_PATH=str(tmp_path / "ticache"))
    args = ["--config", str(config), "--arch", "cpu", "--pinned", "off", "--start-depth", "70", "--tokens", "2", "--json"]
    cold = run_command("decode", *args, cwd=tmp_path, env=env)
    assert cold.returncode == 0, cold.stderr
    assert "compiling kernels (the first run of tiny-cli with these options; Glimmer's took 64 s" in cold.stderr
    assert json.loads(cold.stdout)["first_step_compiled"] is True
    warm = run_command("decode", *args, cwd=tmp_path, env=env)
    assert warm.returncode == 0, warm.stderr
    assert "compiling kernels" not in warm.stderr
    assert json.loads(warm.stdout)["first_step_compiled"] is False


class FakeCache:
    """Taichi's cache folder for kernel_cache.Watch, without Taichi: a folder, and a release that 'writes'."""

    def __init__(self, folder: Path, monkeypatch):
        from muser_ti import backend
        from muser_ti.cli import kernel_cache

        self.folder, self.compiled = folder, []
        folder.mkdir(exist_ok=True)
        monkeypatch.setattr(kernel_cache, "_cache_folder", lambda: folder)
        monkeypatch.setattr(backend, "release", lambda: [(folder / f"T{k}.tic").write_text("") for k in self.compiled])


def test_the_cache_watch_predicts_from_the_files_a_session_left(tmp_path, monkeypatch):
    """Warm is a marker listing the session's kernel files, every one still there; a run compiled iff Taichi wrote
    new files by the time it ended."""
    from muser_ti.cli.kernel_cache import Watch

    fake = FakeCache(tmp_path / "ticache", monkeypatch)
    first = Watch("session-a")
    assert first.cold
    fake.compiled = ["k1", "k2"]
    assert first.finish() is True
    again = Watch("session-a")
    assert not again.cold
    fake.compiled = []
    assert again.finish() is False and not Watch("session-a").cold
    assert Watch("session-b").cold  # another geometry or option: its own marker
    (fake.folder / "Tk2.tic").unlink()  # a cache cleaned under the marker: cold again
    assert Watch("session-a").cold


def test_the_sessions_key_leaves_out_files_that_define_no_kernel():
    """Editing the engine's bookkeeping must not make a cached session "compile": only the files that define
    Taichi kernels or functions name it (with Taichi's version, the arch, the geometry and the options)."""
    from muser_ti.cli import kernel_cache

    names = {p.relative_to(kernel_cache.PACKAGE).as_posix() for p in kernel_cache.kernel_sources()}
    assert "kernels/reducer.py" in names and "kernels/producer/cpu.py" in names
    assert not {"engine.py", "token.py", "launch.py", "planes.py", "cli/decode.py"} & names
    cfg = mt.load_config("glimmer.yaml")
    key = kernel_cache.session_key(cfg, "cpu", pinned="auto")
    assert key == kernel_cache.session_key(cfg.with_overrides(name="renamed"), "cpu", pinned="auto")
    assert key != kernel_cache.session_key(cfg, "cpu", pinned="off")
    assert key != kernel_cache.session_key(cfg.with_overrides(n_layers=4), "cpu", pinned="auto")


def test_the_first_step_says_compile_only_when_it_compiled(capsys):
    from muser_ti.cli.decode import print_summary, ring_wrap

    summary = {"model": "muse-glimmer", "config": "glimmer.yaml", "arch": "cpu", "graph": "teacher",
               "pinned_loaded": False, "pinned": "off", "tokens": 24, "routes_per_class": {"swa": {"splitk": 24}},
               "swa_ring": None, "tokens_per_s": 1.0, "median_step_s": 1.0, "first_step_s": 4.059,
               "launches_per_token": 5, "kv_bytes_per_token": 1, "kv_gb_per_s": 1.0}
    print_summary(summary | {"first_step_compiled": False})
    text = " ".join(capsys.readouterr().out.split())
    assert "first step 4059 ms, its kernels loaded from Taichi's cache)" in text and "compil" not in text
    print_summary(summary | {"first_step_compiled": True})
    assert "first step 4059 ms, incl. compiling its kernels)" in " ".join(capsys.readouterr().out.split())


def test_the_pinned_line_says_one_thing_on_a_gpu_arch(capsys):
    """On Vulkan the library is loaded but cannot read the planes: the line says it is not in use, and why, not
    "not loaded: ... is loaded"."""
    from muser_ti.cli.decode import print_summary
    from muser_ti.pinned.llama_rung import pinned_status

    loaded, why = pinned_status("vulkan")
    assert not loaded
    summary = {"model": "m", "config": "c.yaml", "arch": "vulkan", "graph": "teacher", "pinned_loaded": loaded,
               "pinned": why, "tokens": 1, "routes_per_class": {}, "swa_ring": None, "tokens_per_s": 1.0,
               "median_step_s": 1.0, "first_step_s": 1.0, "launches_per_token": 1, "kv_bytes_per_token": 1,
               "kv_gb_per_s": 1.0}
    print_summary(summary)
    line = " ".join(capsys.readouterr().out.split()).split("pinned llama library: ")[1]
    assert line.startswith("not in use: ") and "not loaded" not in line and line.count("not in use") == 1
    assert "is loaded" not in why  # nor does the engine's own refusal of pinned='on' there ("not loaded: ...")


def test_the_capacity_minimum_is_the_planes_own(monkeypatch):
    """The minimum --capacity muser-decode names holds the session in the planes' own checks (a prefill in
    256-token chunks, then one token at a time), and one row less does not: for NoPE-bound, window-bound and
    short sessions alike."""
    from muser_ti.cli.decode import capacity_needed
    from muser_ti.planes import PlaneError, PlaneSet

    def holds(cfg, start, tokens, capacity) -> bool:
        try:
            for kind, layers in (("swa", cfg.swa_layers), ("nope", cfg.nope_layers)):
                if not layers:
                    continue
                planes = PlaneSet(cfg, kind, layers, capacity if kind == "swa" else min(capacity, cfg.max_context))
                done = 0
                while done < start:
                    n = min(256, start - done)
                    planes.state = planes.check_prefill(done, n)
                    done += n
                for position in range(start, start + tokens):
                    planes.state = planes.check_append(position)
        except PlaneError:
            return False
        return True

    glimmer = mt.load_config("glimmer.yaml")
    swa_only = glimmer.with_overrides(layer_pattern=["swa"])
    for cfg, start, tokens in ((glimmer, 2040, 24), (glimmer, 40, 4), (swa_only, 2040, 24), (swa_only, 2040, 4),
                               (swa_only, 3000, 5)):
        rows, why = capacity_needed(cfg, start + tokens)
        assert holds(cfg, start, tokens, rows) and not holds(cfg, start, tokens, rows - 1), (cfg.layer_pattern, start,
                                                                                              tokens, rows, why)


def test_capacity_at_the_named_minimum_runs(tmp_path):
    config = _tiny_config(tmp_path)  # 70 prefilled + 3 decoded: its NoPE plane keeps 73 rows, its rings 64
    args = ["--config", str(config), "--arch", "cpu", "--pinned", "off", "--start-depth", "70", "--tokens", "3"]
    assert_one_error_line(run_command("decode", *args, "--capacity", "72", cwd=tmp_path), "needs 73 rows", ">= 73")
    out = run_command("decode", *args, "--capacity", "73", "--json", cwd=tmp_path)
    assert out.returncode == 0 and json.loads(out.stdout)["final_position"] == 73, out.stderr


def test_a_forced_pinned_route_names_the_option_that_allows_it(tmp_path):
    out = run_command("decode", "--config", str(_tiny_config(tmp_path)), "--arch", "cpu", "--route", "llama_vec_swa",
                      "--start-depth", "70", "--tokens", "4", cwd=tmp_path)
    if mt.pinned_library_status("cpu")[0]:
        assert_one_error_line(out, "--route llama_vec_swa", "(--pinned auto)", "--pinned on puts it in use")
    else:
        assert_one_error_line(out, "--route llama_vec_swa", "the pinned library is unavailable here")


def test_no_progress_bar_is_left_behind_an_error(tmp_path):
    """A route forced on a plane its predicate refuses fails at the first decoded token, mid-progress: the
    error line is all that is left (the bars are cleared), and nothing is left on stdout."""
    if not mt.pinned_library_status("cpu")[0]:
        pytest.skip("the pinned library is not loadable here: --pinned on is refused before any bar")
    out = run_command("decode", "--config", str(_tiny_config(tmp_path)), "--arch", "cpu", "--pinned", "on", "--route",
                      "llama_vec_swa", "--start-depth", "10", "--tokens", "4", cwd=tmp_path)
    assert_one_error_line(out, "'llama_vec_swa' forced on layer 0", "len 11 is not a multiple of 32")
    assert "prefill" not in out.stderr + out.stdout and "decode" not in out.stderr and out.stdout == ""


# ---- what the decode prints ---------------------------------------------------------------------------------
def test_ring_wrap_is_placed_by_the_geometry():
    from muser_ti.cli.decode import ring_wrap

    # Glimmer's 2,048-row ring: prefilled 30,000 deep, it first wrapped at 2,048, in the prefill
    assert ring_wrap(2048, 30000, 24) == {"wrapped_at_position": 2048, "wrapped_during": "prefill",
                                          "wrapped_at_token": None}
    # the default session: 2,040 prefilled, the 9th decoded token (position 2,048) wraps it
    assert ring_wrap(2048, 2040, 24) == {"wrapped_at_position": 2048, "wrapped_during": "decode", "wrapped_at_token": 9}
    assert ring_wrap(2048, 2048, 1) == {"wrapped_at_position": 2048, "wrapped_during": "decode", "wrapped_at_token": 1}
    # not wrapped: the same keys, null (a --json reader indexes them on every run)
    assert ring_wrap(2048, 2047, 1) == {"wrapped_at_position": None, "wrapped_during": None, "wrapped_at_token": None}


def test_summary_says_where_the_ring_wrapped(capsys):
    from muser_ti.cli.decode import print_summary, ring_wrap

    ring = {"len": 2048, "capacity": 2048, "origin_logical": 28000, "origin_physical": 1376}
    summary = {"model": "muse-glimmer", "config": "glimmer.yaml", "arch": "cpu", "graph": "teacher",
               "pinned_loaded": False, "pinned": "off", "tokens": 24, "routes_per_class": {"swa": {"splitk": 24}},
               "swa_ring": ring | ring_wrap(2048, 30000, 24), "tokens_per_s": 1.0, "median_step_s": 1.0,
               "first_step_s": 1.0, "launches_per_token": 5, "kv_bytes_per_token": 1, "kv_gb_per_s": 1.0}
    print_summary(summary)
    text = " ".join(capsys.readouterr().out.split())
    assert "first wrapped at position 2048, during the prefill" in text
    assert "glimmer.yaml" in text and "/" not in text.split("glimmer.yaml")[0].split("(")[-1]


def test_config_and_paths_are_shown_as_a_user_names_them(tmp_path, monkeypatch):
    from muser_ti.cli.decode import config_shown, paths_shown
    from muser_ti.config import CONFIG_DIR

    monkeypatch.chdir(tmp_path)
    assert config_shown(str(CONFIG_DIR / "glimmer.yaml")) == "glimmer.yaml"
    assert config_shown(str(tmp_path / "sub" / "x.yaml")) == "sub/x.yaml"
    assert paths_shown(f"at {tmp_path}/.venv/lib/libggml.so is there") == "at .venv/lib/libggml.so is there"
