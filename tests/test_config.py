import dataclasses
import math
from pathlib import Path

import pytest
import yaml

import muser_ti as mt
from muser_ti.config import CONFIG_DIR, ConfigError, resolve_config_path


def test_glimmer_geometry():
    cfg = mt.load_config("glimmer.yaml")
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers) == (32, 2, 128, 52)
    assert cfg.heads_per_kv == 16
    assert len(cfg.swa_layers) == 39 and len(cfg.nope_layers) == 13
    assert cfg.layer_kinds[:8] == ("swa", "swa", "swa", "nope") * 2
    assert cfg.window == 2048 and cfg.max_context == 131072
    assert cfg.attention_scale == pytest.approx(1 / math.sqrt(128)) and round(cfg.attention_scale, 7) == 0.0883883
    assert cfg.weight_stream_bytes == 16_756_681_056
    assert cfg.kv_bytes_per_row == 1024


def test_geometry_is_immutable():
    cfg = mt.load_config("glimmer.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_heads = 4


def test_bare_name_resolves_to_configs_and_path_is_a_path(tmp_path):
    assert resolve_config_path("glimmer.yaml") == CONFIG_DIR / "glimmer.yaml"
    p = tmp_path / "g.yaml"
    p.write_text((CONFIG_DIR / "glimmer.yaml").read_text())
    assert mt.load_config(p).n_layers == 52


BASE = yaml.safe_load((CONFIG_DIR / "glimmer.yaml").read_text())


@pytest.mark.parametrize("changes", [
    dict(n_heads=8, n_kv_heads=8, head_dim=64),
    dict(n_heads=12, n_kv_heads=3, head_dim=256),
    dict(n_heads=32, n_kv_heads=1),
    dict(window=1),
    dict(window=100, layer_pattern=["nope"]),
    dict(layer_pattern=["swa", "nope", "nope"], n_layers=7),
    dict(attention_scale=0.5),
])
def test_other_geometries_load(tmp_path, changes):
    raw = dict(BASE, **changes)
    p = tmp_path / "g.yaml"
    p.write_text(yaml.safe_dump(raw))
    cfg = mt.load_config(p)
    for key, value in changes.items():
        got = getattr(cfg, key)
        assert (list(got) if isinstance(got, tuple) else got) == value


@pytest.mark.parametrize("changes, field, fragment", [
    (dict(head_dim=96), "head_dim", "one of the integers [64, 128, 256]"),
    (dict(n_kv_heads=3), "n_kv_heads", "divisor of n_heads=32"),
    (dict(window=0), "window", "[1, 131072]"),
    (dict(window=200000), "window", "[1, 131072]"),
    (dict(layer_pattern=["swa", "full"]), "layer_pattern[1]", "one of ['swa', 'nope']"),
    (dict(layer_pattern=[]), "layer_pattern", "non-empty list"),
    (dict(n_heads="32"), "n_heads", "an integer"),
    (dict(n_layers=True), "n_layers", "an integer"),
    (dict(attention_scale=-1.0), "attention_scale", "a number in (0, "),
    (dict(max_context=0), "max_context", "[1,"),
    (dict(max_context=1 << 24), "max_context", "nope plane under 2**31 elements (13 layers x n_kv_heads=2 x 16777216"),
    (dict(max_context=1 << 24, window=1 << 23, layer_pattern=["swa"]), "window", "swa plane under 2**31 elements"),
])
def test_bad_values_name_field_value_and_range(tmp_path, changes, field, fragment):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(dict(BASE, **changes)))
    with pytest.raises(ConfigError) as info:
        mt.load_config(p)
    msg = str(info.value)
    assert str(p) in msg and f"field '{field}'" in msg and fragment in msg


def test_unknown_and_missing_fields(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(dict(BASE, heads=3)))
    with pytest.raises(ConfigError, match="unknown field.*heads"):
        mt.load_config(p)
    raw = dict(BASE)
    del raw["window"]
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"missing required field.*window"):
        mt.load_config(p)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        mt.load_config(tmp_path / "nope.yaml")
    p = tmp_path / "broken.yaml"
    p.write_text("n_heads: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        mt.load_config(p)
    p.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        mt.load_config(p)


# Every way a config path can fail gives mt.ConfigError naming the path and what is wrong, never another
# exception: read_yaml is the one reader of every command's config and sweep files (test_commands.py runs each
# case through a command).  Unreadable as root too: /proc/self/mem is a regular file whose read fails (EIO);
# chmod 000 would not stop root, and a FIFO would block the reader.
def bad_paths(tmp_path) -> dict:
    """{case: (path, words the error must hold)} for each way a config path can be wrong."""
    (tmp_path / "latin1.yaml").write_bytes("name: caf\u00e9\n".encode("latin-1"))
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "broken.yaml").write_text("n_heads: [1, 2\n")
    (tmp_path / "list.yaml").write_text("- just\n- a list\n")
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "huge.yaml").write_text("# padding\n" * 200_000)
    return {
        "missing": (tmp_path / "absent.yaml", ["absent.yaml", "no such config file"]),
        "not UTF-8": (tmp_path / "latin1.yaml", ["latin1.yaml", "not UTF-8", "0xe9", "offset 9"]),
        "unreadable": (Path("/proc/self/mem"), ["/proc/self/mem", "cannot be read", "Input/output error"]),
        "a directory": (tmp_path / "a-folder", ["a-folder", "is a directory"]),
        "a device": (Path("/dev/zero"), ["/dev/zero", "is a character device"]),
        "too large": (tmp_path / "huge.yaml", ["huge.yaml", "larger than 1,048,576 bytes"]),
        "not YAML": (tmp_path / "broken.yaml", ["broken.yaml", "not valid YAML", "line 1"]),
        "not a mapping": (tmp_path / "list.yaml", ["list.yaml", "expected a mapping", "got a list"]),
        "empty": (tmp_path / "empty.yaml", ["empty.yaml", "expected a mapping", "an empty document"]),
    }


BAD_CASES = ["missing", "not UTF-8", "unreadable", "a directory", "a device", "too large", "not YAML",
             "not a mapping", "empty"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_every_bad_config_path_is_one_config_error(tmp_path, case):
    path, words = bad_paths(tmp_path)[case]
    with pytest.raises(ConfigError) as info:
        mt.load_config(path)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_a_bare_name_that_is_a_folder_here_is_named_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "glimmer.yaml").mkdir()  # exists here, so the bare name is this path, not configs/'s file
    with pytest.raises(ConfigError, match="glimmer.yaml: is a directory"):
        mt.load_config("glimmer.yaml")
