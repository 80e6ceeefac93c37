"""The README's "In a model" snippets run as written, on the CPU.

Each ```python block of that section is taken from README.md verbatim and run in a process of its own (a
snippet starts Taichi; this process's arch belongs to the other tests).  Two things are added around a snippet,
and nothing in it is changed:

* ``arch="auto"`` would take a GPU where there is one; the snippet runs on the CPU wherever the tests run, so
  the prelude makes "auto" mean the CPU (backend.resolve_arch, the one place that reads it);
* the per-layer snippet (``with eng.token() as t: ... t.attend(layer, ...)``) is a fragment of a model's forward:
  it is given the names it assumes, a one-layer engine and that layer's q, k and v, and one token is then in.
"""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRELUDE = textwrap.dedent("""
    import muser_ti.backend as backend
    _resolve = backend.resolve_arch
    backend.resolve_arch = lambda arch: _resolve("cpu" if arch == "auto" else arch)
""")
PER_LAYER_CONTEXT = textwrap.dedent("""
    import numpy as np
    import muser_ti as mt
    cfg = mt.geometry_from_dict(dict(name="one-layer", n_heads=8, n_kv_heads=2, head_dim=64, n_layers=1,
                                     layer_pattern=["swa"], window=64, max_context=256, attention_scale="auto"))
    eng = mt.Engine(cfg, arch="auto", pinned="off")
    rng = np.random.default_rng(0)
    layer = 0
    q_l, k_l, v_l = (rng.standard_normal(shape, dtype=np.float32) for shape in ((8, 64), (2, 64), (2, 64)))
""")
PER_LAYER_CHECK = "assert eng.position == 1 and out_l.shape == (8, 64) and np.isfinite(out_l).all()\n"


def section(name: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {name}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", section("In a model"), re.S)


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=ROOT)


def test_the_section_has_the_snippets_these_tests_run():
    found = snippets()
    assert len(found) == 5, found
    assert "eng.token()" in found[0] and "transformers_model(" in found[1] and "mlx_model(" in found[2]
    assert "attention_mask" in found[3] and "BatchGenerator" in found[4]


def test_the_per_layer_snippet():
    out = run(PRELUDE + PER_LAYER_CONTEXT + snippets()[0] + PER_LAYER_CHECK)
    assert out.returncode == 0, out.stderr


def test_the_transformers_snippet():
    """From the random-weight builder to generate() with the engine as the attention: 8 new tokens."""
    pytest.importorskip("transformers")
    out = run(PRELUDE + snippets()[1] + "assert out.shape == (1, 4 + 8), out.shape\n")
    assert out.returncode == 0, out.stderr


def test_the_mlx_lm_snippet():
    pytest.importorskip("mlx_lm")
    out = run(PRELUDE + snippets()[2] + "assert len(tokens) == 8 and all(0 <= t < 1000 for t in tokens), tokens\n")
    assert out.returncode == 0, out.stderr


def test_the_transformers_batch_snippet():
    """Two left-padded prompts through generate: 8 new tokens a row, the prompts kept as they were."""
    pytest.importorskip("transformers")
    check = ("assert out.shape == (2, 5 + 8), out.shape\n"
             "assert torch.equal(out[:, :5], input_ids) and bool(((out >= 0) & (out < 1000)).all())\n")
    out = run(PRELUDE + snippets()[3] + check)
    assert out.returncode == 0, out.stderr


def test_the_mlx_lm_batch_snippet():
    pytest.importorskip("mlx_lm")
    check = "assert [len(t) for t in tokens.values()] == [8, 8] and all(0 <= t < 1000 for v in tokens.values() for t in v)\n"
    out = run(PRELUDE + snippets()[4] + check)
    assert out.returncode == 0, out.stderr
