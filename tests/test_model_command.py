"""muser-model, the user's path to the whole model: transformers' and mlx-lm's own Glimmer with the engine as its
decode attention, as a user runs it (a subprocess): its JSON, its agreement with the framework's own attention,
and one error line for what it cannot do."""

import json

import pytest

from test_commands import assert_one_error_line, run_command


@pytest.mark.parametrize("framework, module", [("transformers", "transformers"), ("mlx", "mlx_lm")])
def test_the_model_runs_with_the_engine_as_its_attention(framework, module):
    """Four layers (three sliding, one full) of the random-weight Glimmer, a 70-token prompt, 6 decoded tokens on
    the CPU: every decoded token's attention ran on the engine's routes, the NoPE plane grew past its first 64 rows
    while decoding, and the logits agree with the framework's own attention within the f16 planes' bound."""
    pytest.importorskip(module)
    out = run_command("model", "--framework", framework, "--layers", "4", "--prompt-tokens", "60", "--tokens", "6",
                      "--arch", "cpu", "--json", timeout=600)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)  # only JSON on stdout
    assert "prompt:" not in out.stderr  # --json: no progress bars, as muser-decode's
    assert s["framework"] == framework and s["layers"] == 4 and len(s["generated"]) == 6
    assert s["routes"] == {"splitk": 3 * 6, "interleaved": 6}
    assert s["planes"]["nope"]["len"] == 66 and s["planes"]["nope"]["capacity"] == 128
    a = s["agreement"]
    assert a["steps"] == 6 and a["within_bound"], a
    assert a["greedy_same_where_decided"] == a["greedy_decided_steps"], a
    assert 0 < s["attention_share"] < 1 and s["tokens_per_s"] > 0


@pytest.mark.parametrize("framework, module", [("transformers", "transformers"), ("mlx", "mlx_lm")])
def test_a_batch_of_sequences(framework, module):
    """--batch 3: three prompts decoded at once on the engine (a batch: each sequence its own engine), every
    sequence's logits within the bound of the framework's own batch, and its tokens/s beside the engine's."""
    pytest.importorskip(module)
    out = run_command("model", "--framework", framework, "--layers", "4", "--prompt-tokens", "60", "--tokens", "6",
                      "--batch", "3", "--arch", "cpu", "--json", timeout=600)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["batch"] == 3 and len(s["generated"]) == 3 and all(len(g) == 6 for g in s["generated"])
    assert s["routes"] == {"splitk": 3 * 6 * 3, "interleaved": 6 * 3}  # every sequence's layer-steps
    assert s["planes"]["nope"]["len"] == 66
    a = s["agreement"]
    assert a["steps"] == 6 and a["sequences"] == 3 and a["within_bound"], a
    assert a["greedy_same_where_decided"] == a["greedy_decided_steps"] > 0, a
    assert s["tokens_per_s"] > 0 and s["framework_tokens_per_s"] > 0


def test_a_missing_checkpoint_is_one_error_line(tmp_path):
    pytest.importorskip("transformers")
    out = run_command("model", "--checkpoint", str(tmp_path / "absent"), "--arch", "cpu", timeout=300)
    assert_one_error_line(out, "absent")


def test_too_many_layers_is_one_error_line():
    out = run_command("model", "--layers", "60", "--arch", "cpu", timeout=300)
    assert_one_error_line(out, "--layers 60", "52 layers")


@pytest.mark.parametrize("framework, module, extra", [("transformers", "transformers", "hf"), ("mlx", "mlx_lm", "mlx")])
def test_a_missing_framework_says_how_to_install_it_as_installed_here(tmp_path, framework, module, extra):
    """This checkout is installed editable, so the hint is the README's: pip install -e '.[hf]' from the checkout."""
    import subprocess
    import sys

    from test_commands import ROOT

    code = (f"import sys; sys.modules[{module!r}] = None; from muser_ti.cli.model import main; "
            f"sys.exit(main(['--framework', {framework!r}, '--arch', 'cpu']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert_one_error_line(out, f"--framework {framework} needs {module}", f"pip install -e '.[{extra}]'")


def test_the_model_says_what_it_is_doing(tmp_path):
    """Each phase is a progress bar on standard error that names it (an mlx run printed nothing for minutes);
    standard output holds the report alone."""
    pytest.importorskip("transformers")
    out = run_command("model", "--layers", "4", "--prompt-tokens", "60", "--tokens", "2", "--arch", "cpu", timeout=600)
    assert out.returncode == 0, out.stderr
    bars = [line for line in out.stderr.splitlines() if not line.startswith("[Taichi]")]
    for words in ("build: transformers' Glimmer, 4 random layers", "1/1", "prompt: 60 tokens; layers' K/V into the "
                  "engine", "4/4", "decode: the engine's attention on cpu", "2/2", "check: 60 + 2 tokens on transformers' "
                  "attention", "3/3"):
        assert any(words in line for line in bars), (words, bars)
    assert out.stdout.startswith("transformers: random-weight Glimmer") and "━" not in out.stdout
