"""Geometry from a model's own configuration (muser_ti/model_config.py): transformers' and mlx-lm's forms of
Muse Glimmer's config read to the geometry configs/glimmer.yaml states by hand, and every configuration the
engine cannot compute refused with an error naming the source and the field. No engines, no kernels."""

import json
import re

import pytest

import muser_ti as mt
from muser_ti.config import ConfigError
from muser_ti.model_config import default_layer_types, weight_stream_bytes

S, F = "sliding_attention", "full_attention"

# bf16 bytes of MuseGlimmerTextConfig's default widths, counted by hand: per layer q, gate 6656 x 4096 each,
# o 4096 x 6656, k, v 6656 x 256 each, the MLP 3 x 6656 x 19968, 4 norms of 6656; 52 layers, the final norm and
# lm_head 202,048 x 6656. 26,509,949,440 parameters.
GLIMMER_BF16_BYTES = 2 * (52 * (3 * 6656 * 4096 + 2 * 6656 * 256 + 3 * 6656 * 19968 + 4 * 6656) + 6656
                          + 202_048 * 6656)

# A reduced Glimmer in mlx-community's flat form: 8 layers, window 64
SMALL = {
    "model_type": "muse_glimmer", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
    "sliding_window": 64, "max_position_embeddings": 4096,
}


def _same_geometry(a, b):
    """Field by field, everything but the name, the source and the weight stream."""
    assert (a.n_heads, a.n_kv_heads, a.head_dim, a.n_layers) == (b.n_heads, b.n_kv_heads, b.head_dim, b.n_layers)
    assert a.layer_kinds == b.layer_kinds
    assert (a.window, a.max_context, a.attention_scale) == (b.window, b.max_context, b.attention_scale)
    assert (a.swa_ring_slack, a.n_ubatch) == (b.swa_ring_slack, b.n_ubatch)


def _write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


# ---- the real clients' configs --------------------------------------------------------------------------


def test_glimmer_yaml_is_transformers_default_text_config():
    transformers = pytest.importorskip("transformers")
    yaml_geom = mt.load_config("glimmer.yaml")
    geom = mt.geometry_from_model_config(transformers.MuseGlimmerTextConfig())
    _same_geometry(geom, yaml_geom)
    assert len(geom.swa_layers) == 39 and len(geom.nope_layers) == 13
    assert geom.layer_pattern == ("swa", "swa", "swa", "nope")
    assert geom.name == "muse_glimmer_text"
    # The weight stream: the config's widths give 53.0 GB of bf16 weights a token; the chapter's 16.76 GB
    # (glimmer.yaml) is 0.316 of that, 5.06 bits a parameter: the stream of a quantized checkpoint, not of
    # the bf16 widths the config states. So the two are not compared for equality, only for that ratio.
    assert geom.weight_stream_bytes == GLIMMER_BF16_BYTES == 53_019_898_880
    bits = 16 * yaml_geom.weight_stream_bytes / geom.weight_stream_bytes
    assert 4 < bits < 8 and round(bits, 2) == 5.06


@pytest.mark.parametrize("form", ["MuseGlimmerConfig", "to_dict as config.json", "save_pretrained directory",
                                  "text to_dict as config.json"])
def test_transformers_forms_read_alike(form, tmp_path):
    transformers = pytest.importorskip("transformers")
    want = mt.geometry_from_model_config(transformers.MuseGlimmerTextConfig())
    full = transformers.MuseGlimmerConfig()
    if form == "MuseGlimmerConfig":
        source = full
    elif form == "to_dict as config.json":
        source = _write(tmp_path, full.to_dict())
    elif form == "save_pretrained directory":
        full.save_pretrained(tmp_path)
        source = tmp_path
    else:
        source = str(_write(tmp_path, transformers.MuseGlimmerTextConfig().to_dict()))
    geom = mt.geometry_from_model_config(source)
    _same_geometry(geom, want)
    assert geom.weight_stream_bytes == want.weight_stream_bytes
    if form != "MuseGlimmerConfig":
        assert geom.source == str(tmp_path / "config.json")


@pytest.mark.parametrize("attention_bias", [False, True])
def test_weight_stream_counts_transformers_parameters(attention_bias):
    """The formula against the model transformers builds: every parameter but the embedding table, plus lm_head."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    cfg = transformers.MuseGlimmerTextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                             vocab_size=100, sliding_window=16, attention_bias=attention_bias,
                                             bos_token_id=None, eos_token_id=None)
    model = transformers.MuseGlimmerTextModel(cfg)
    params = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embed_tokens."))
    lm_head = cfg.vocab_size * cfg.hidden_size
    assert mt.geometry_from_model_config(cfg).weight_stream_bytes == 2 * (params + lm_head)


def test_mlx_lm_model_args_defaults():
    mlx_glimmer = pytest.importorskip("mlx_lm.models.muse_glimmer")
    geom = mt.geometry_from_model_config(mlx_glimmer.ModelArgs())
    _same_geometry(geom, mt.load_config("glimmer.yaml"))
    assert geom.weight_stream_bytes == GLIMMER_BF16_BYTES
    assert geom.source == "<ModelArgs dataclass>" and geom.name == "muse_glimmer"


def test_mlx_lm_weight_stream_counts_its_parameters():
    mlx_glimmer = pytest.importorskip("mlx_lm.models.muse_glimmer")
    from mlx.utils import tree_flatten
    args = mlx_glimmer.ModelArgs.from_dict(SMALL)
    params = sum(v.size for name, v in tree_flatten(mlx_glimmer.Model(args).parameters())
                 if not name.startswith("model.embed_tokens."))
    assert mt.geometry_from_model_config(args).weight_stream_bytes == 2 * params


def test_hand_written_flat_glimmer():
    """mlx-community's flat config.json, every field written out; also with only model_type (all defaults)."""
    flat = {"model_type": "muse_glimmer", "hidden_size": 6656, "num_hidden_layers": 52, "intermediate_size": 19968,
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 202048,
            "sliding_window": 2048, "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "final_logit_softcapping": 20.0, "qk_scale_factor": 3.87, "tie_word_embeddings": False,
            "quantization": {"group_size": 64, "bits": 4}, "_name_or_path": "mlx-community/Muse-Glimmer-30B-4bit"}
    yaml_geom = mt.load_config("glimmer.yaml")
    for cfg in (flat, {"model_type": "muse_glimmer"}, {}):
        geom = mt.geometry_from_model_config(cfg)
        _same_geometry(geom, yaml_geom)
        assert geom.weight_stream_bytes == GLIMMER_BF16_BYTES and geom.source == "<dict>"
    assert mt.geometry_from_model_config(flat).name == "mlx-community/Muse-Glimmer-30B-4bit"


# ---- reduced and custom geometries ----------------------------------------------------------------------


def test_reduced_config():
    geom = mt.geometry_from_model_config(SMALL)
    assert (geom.n_heads, geom.n_kv_heads, geom.heads_per_kv, geom.head_dim) == (8, 2, 4, 64)
    assert geom.n_layers == 8 and geom.window == 64 and geom.max_context == 4096
    assert geom.layer_pattern == ("swa", "swa", "swa", "nope") and geom.nope_layers == (3, 7)
    assert geom.attention_scale == 64 ** -0.5
    assert geom.weight_stream_bytes == weight_stream_bytes(256, 512, 1000, 8, 8, 2, 64)
    # head_dim absent: 128, both clients' default (hidden_size // num_attention_heads would be 32)
    assert mt.geometry_from_model_config({k: v for k, v in SMALL.items() if k != "head_dim"}).head_dim == 128


@pytest.mark.parametrize("types, pattern", [
    ([S, F] * 4, ("swa", "nope")),
    ([F] * 8, ("nope",)),
    ([S] * 8, ("swa",)),
    ([F, S, S, S, S, S, S, F], ("nope", "swa", "swa", "swa", "swa", "swa", "swa")),  # layer 7 repeats layer 0
    ([F, F, S, S, S, S, S, S], ("nope", "nope", "swa", "swa", "swa", "swa", "swa", "swa")),  # no shorter period
    ([S, S, F, S, S, F, S, S], ("swa", "swa", "nope")),  # a period that does not divide the layer count
])
def test_custom_layer_types(types, pattern):
    geom = mt.geometry_from_model_config({**SMALL, "layer_types": types})
    assert geom.layer_pattern == pattern
    assert geom.layer_kinds == tuple("swa" if t == S else "nope" for t in types)
    # with matching per-layer RoPE, as transformers writes it
    thetas = [0 if t == F else 10000.0 for t in types]
    cfg = {**SMALL, "model_type": "muse_glimmer_text", "layer_types": types, "layer_rope_theta": thetas}
    assert mt.geometry_from_model_config(cfg).layer_kinds == geom.layer_kinds


def test_transformers_default_layer_types_count_back_from_the_last():
    assert default_layer_types(6) == [S, F, S, S, S, F]
    geom = mt.geometry_from_model_config({**SMALL, "model_type": "muse_glimmer_text", "num_hidden_layers": 6})
    assert geom.nope_layers == (1, 5)


def test_keywords():
    geom = mt.geometry_from_model_config(SMALL, max_context=1000, swa_ring_slack=16, name="small")
    assert (geom.max_context, geom.swa_ring_slack, geom.name, geom.window) == (1000, 16, "small", 64)
    assert geom.swa_ring_capacity == 80
    # a context shorter than the window: every token is in the window either way, so the window is capped
    assert mt.geometry_from_model_config(SMALL, max_context=32).window == 32
    # no sliding layers, no window
    geom = mt.geometry_from_model_config({**SMALL, "layer_types": [F] * 8, "sliding_window": None})
    assert geom.window == 4096 and geom.swa_layers == ()


@pytest.mark.parametrize("extra", [
    {"final_logit_softcapping": 30.0}, {"attn_logit_softcapping": None}, {"attention_chunk_size": None},
    {"sinks": False}, {"use_sliding_window": True}, {"sliding_window_pattern": 4},
    {"sliding_window_pattern": [64, 64, 64, 0]}, {"query_pre_attn_scalar": 64}, {"attention_multiplier": 0.125},
    {"max_window_layers": None}, {"vision_config": {"num_attention_heads": 16}}, {"attention_dropout": 0.1},
])
def test_harmless_fields_accepted(extra):
    geom = mt.geometry_from_model_config({**SMALL, **extra})
    _same_geometry(geom, mt.geometry_from_model_config(SMALL))


# ---- refusals -------------------------------------------------------------------------------------------


REFUSED = [
    # (change to SMALL, the field the error names, a phrase of why)
    ({"sinks": True}, "sinks", "sinks"),
    ({"attention_sinks": [0.5] * 8}, "attention_sinks", "sinks"),
    ({"use_sink": True}, "use_sink", "sinks"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping", "softcap"),
    ({"attention_chunk_size": 8192}, "attention_chunk_size", "chunked"),
    ({"layer_types": [S, S, "chunked_attention", F] * 2}, "layer_types[2]", "chunked"),
    ({"layer_types": [S, S, "linear_attention", F] * 2}, "layer_types[2]", "expected one of"),
    ({"layer_types": [S, F] * 3}, "layer_types", "num_hidden_layers=8"),
    ({"sliding_window_pattern": 6}, "sliding_window_pattern", "layer 3"),
    ({"sliding_window_pattern": [64, 64, 0]}, "sliding_window_pattern", "layer 2"),
    ({"sliding_window_pattern": [128, 128, 128, 0]}, "sliding_window_pattern", "one window"),
    ({"use_sliding_window": False}, "use_sliding_window", "turns sliding windows off"),
    ({"sliding_window": None}, "sliding_window", "needs a window"),
    ({"sliding_window": 0}, "sliding_window", "positive integer"),
    ({"max_window_layers": 28}, "max_window_layers", "window rule"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "divisor of n_heads=8"),
    ({"head_dim": 96}, "head_dim", "64, 128, 256"),
    ({"num_hidden_layers": "8"}, "num_hidden_layers", "positive integer"),
    ({"num_hidden_layers": 6}, "layer_types", "not a multiple of 4"),
    ({"layer_rope_theta": [10000.0, 10000.0, 0, 0] * 2}, "layer_rope_theta[2]", "without RoPE"),
    ({"layer_rope_theta": [10000.0] * 8}, "layer_rope_theta[3]", "no rotary"),
    ({"layer_rope_theta": [10000.0] * 4}, "layer_rope_theta", "num_hidden_layers=8"),
    ({"query_pre_attn_scalar": 256}, "query_pre_attn_scalar", "head_dim ** -0.5"),
    ({"attention_multiplier": 0.015625}, "attention_multiplier", "head_dim ** -0.5"),
    ({"model_type": "llama"}, "model_type", "misread"),
    ({"sliding_window": 1 << 20, "max_position_embeddings": 1 << 25}, "max_position_embeddings", "max_context"),
]


@pytest.mark.parametrize("change, field, why", REFUSED, ids=[r[1] + "-" + str(i) for i, r in enumerate(REFUSED)])
@pytest.mark.parametrize("as_file", [False, True], ids=["dict", "file"])
def test_refused(change, field, why, as_file, tmp_path):
    cfg = {**SMALL, **change}
    source = _write(tmp_path, cfg) if as_file else cfg
    with pytest.raises(ConfigError) as err:
        mt.geometry_from_model_config(source)
    msg = str(err.value)
    assert f"'{field}'" in msg or f"config's {field}]" in msg, msg
    assert why in msg, msg
    assert msg.startswith(str(source) if as_file else "<dict>"), msg


def test_refusals_in_nested_text_config_name_it():
    outer = {"model_type": "muse_glimmer", "vision_config": {}, "text_config": {**SMALL, "model_type": None}}
    for change, field in [({"attn_logit_softcapping": 50.0}, "text_config.attn_logit_softcapping"),
                          ({"num_key_value_heads": 3}, "text_config.num_key_value_heads"),
                          ({"layer_types": [S, F] * 4}, "text_config.layer_rope_theta[1]")]:
        cfg = {**outer, "text_config": {**outer["text_config"], **change}}
        with pytest.raises(ConfigError, match="^<dict>: .*(field '|config's )" + re.escape(field) + r"['\]]"):
            mt.geometry_from_model_config(cfg)
    # a field at the top level the text config contradicts: mlx-lm and transformers would build different models
    with pytest.raises(ConfigError, match="'sliding_window'.*transformers reads text_config's"):
        mt.geometry_from_model_config({**outer, "sliding_window": 128})
    with pytest.raises(ConfigError, match="'sinks'"):
        mt.geometry_from_model_config({**outer, "sinks": True})


def test_transformers_form_custom_layer_types_need_their_rope_thetas():
    """transformers fills layer_rope_theta by layer index, not from layer_types: custom types without thetas
    would put RoPE on a full layer."""
    with pytest.raises(ConfigError, match=r"layer_rope_theta\[1\].*transformers' default"):
        mt.geometry_from_model_config({**SMALL, "model_type": "muse_glimmer_text", "layer_types": [S, F] * 4})


def test_keyword_refusals_name_the_keyword():
    with pytest.raises(ConfigError, match=r"field 'swa_ring_slack'.*swa_ring_slack \(keyword\)"):
        mt.geometry_from_model_config(SMALL, swa_ring_slack=-1)
    with pytest.raises(ConfigError, match=r"field 'max_context'.*max_context \(keyword\)"):
        mt.geometry_from_model_config(SMALL, max_context=0)
    with pytest.raises(ConfigError, match="field 'name'"):
        mt.geometry_from_model_config(SMALL, name="")


def test_bad_sources(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        mt.geometry_from_model_config(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'config.json'}: no such file"):
        mt.geometry_from_model_config(tmp_path)  # a directory without config.json
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=f"^{bad}: not valid JSON"):
        mt.geometry_from_model_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=f"^{bad}: expected a JSON object"):
        mt.geometry_from_model_config(bad)
    with pytest.raises(ConfigError, match="text_config"):
        mt.geometry_from_model_config({"model_type": "muse_glimmer", "text_config": [1]})
    with pytest.raises(TypeError, match="source must be"):
        mt.geometry_from_model_config(42)
