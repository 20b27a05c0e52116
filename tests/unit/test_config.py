"""`load_config` / `config_from_dict`: hub configs of the dev models and transformers-written ones."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

import infer.models  # noqa: F401  (registers the architectures with the config reader)
from infer.loader.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    config_from_dict,
    load_config,
    supported_model_types,
)


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(data))
    return path


# --------------------------------------------------------------------------- the dev models


# The dev models' config.json (conftest.DEV_CONFIGS) -> the fields we expect, each checked.
# fmt: off
DEV_EXPECTED: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        head_dim=64, computed_head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        rope_local_base_freq=None, attention_bias=False, mlp_bias=False, hidden_act="silu",
        query_pre_attn_scalar=None, attention_scale=64**-0.5, sliding_window=None,
        sliding_window_pattern=None, layer_types=None, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009], eos_token_ids=[128001, 128008, 128009], torch_dtype="bfloat16",
    ),
    "qwen3": dict(
        model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, vocab_size=151936, max_position_embeddings=40960,
        head_dim=128, computed_head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,  # the JSON has the integer 1000000
        rope_scaling=None, sliding_window=None,  # JSON nulls
        layer_types=None, hidden_act="silu", tie_word_embeddings=True, attention_scale=128**-0.5,
        eos_token_id=151645, eos_token_ids=[151645],
    ),
    "gemma3": dict(
        model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, vocab_size=262144, max_position_embeddings=32768,
        head_dim=256, rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling=None,
        hidden_act="gelu_pytorch_tanh",  # from hidden_activation
        query_pre_attn_scalar=256.0, attention_scale=256**-0.5, sliding_window=512, sliding_window_pattern=6,
        # gemma-3-1b-it's config.json has no tie_word_embeddings: transformers' default (True) applies.
        tie_word_embeddings=True,
        final_logit_softcapping=None, attn_logit_softcapping=None, eos_token_id=[1, 106], pad_token_id=0,
    ),
}
# fmt: on
# Global (full-attention) layers of each dev model.
DEV_FULL_LAYERS = {"llama": list(range(16)), "qwen3": list(range(28)), "gemma3": [5, 11, 17, 23]}


@pytest.mark.parametrize("model", list(DEV_EXPECTED))
def test_dev_model_configs(tmp_path: Path, dev_configs: dict[str, dict[str, Any]], model: str) -> None:
    cfg = load_config(write_config(tmp_path, dev_configs[model]))
    expected = DEV_EXPECTED[model]
    got = {key: getattr(cfg, key) for key in expected}
    wrong = {key: (got[key], value) for key, value in expected.items() if got[key] != value}
    assert not wrong, f"{model}: (got, expected) {wrong}"
    for key in ("rope_theta", "rope_local_base_freq"):  # typed float even when JSON writes an integer
        assert getattr(cfg, key) is None or isinstance(getattr(cfg, key), float), key
    full = [i for i in range(cfg.num_hidden_layers) if cfg.layer_type(i) == FULL_ATTENTION]
    assert full == DEV_FULL_LAYERS[model]


def test_str_and_path_inputs(tmp_path: Path, dev_configs: dict[str, dict[str, Any]]) -> None:
    path = write_config(tmp_path, dev_configs["qwen3"])
    from_path = load_config(path)
    assert load_config(str(path)) == from_path
    assert load_config(path / "config.json") == from_path  # the file itself
    assert load_config(str(path / "config.json")) == from_path
    assert isinstance(from_path, ModelConfig)


# --------------------------------------------------------------------------- errors


def test_unsupported_model_type_names_file_and_supported_set(
    tmp_path: Path, dev_configs: dict[str, dict[str, Any]]
) -> None:
    data = dev_configs["llama"] | {"model_type": "mamba"}
    path = write_config(tmp_path, data)
    with pytest.raises(ValueError, match="unsupported model_type 'mamba'") as info:
        load_config(path)
    message = str(info.value)
    assert str(path / "config.json") in message
    for supported in ("llama", "qwen3", "gemma3_text"):
        assert supported in message
    assert set(supported_model_types()) >= {"llama", "qwen3", "gemma3_text"}


def test_missing_model_type(tmp_path: Path, dev_configs: dict[str, dict[str, Any]]) -> None:
    data = dev_configs["llama"]
    del data["model_type"]
    path = write_config(tmp_path, data)
    with pytest.raises(ValueError, match="model_type") as info:
        load_config(path)
    assert str(path / "config.json") in str(info.value)
    assert "gemma3_text" in str(info.value)


@pytest.mark.parametrize(
    "field",
    ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"],
)
def test_missing_required_field(tmp_path: Path, dev_configs: dict[str, dict[str, Any]], field: str) -> None:
    data = dev_configs["qwen3"]
    del data[field]
    path = write_config(tmp_path, data)
    with pytest.raises(ValueError, match=field) as info:
        load_config(path)
    assert str(path / "config.json") in str(info.value)


def test_required_field_null_is_missing(dev_configs: dict[str, dict[str, Any]]) -> None:
    data = dev_configs["llama"] | {"hidden_size": None}
    with pytest.raises(ValueError, match="hidden_size"):
        config_from_dict(data)


def test_no_config_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_config(tmp_path)


def test_invalid_json_names_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json"):
        load_config(tmp_path)


def test_json_not_an_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_config(tmp_path)


def test_layer_types_length_mismatch(dev_configs: dict[str, dict[str, Any]]) -> None:
    data = dev_configs["gemma3"] | {"layer_types": [FULL_ATTENTION] * 3}
    with pytest.raises(ValueError, match="'layer_types' = 3 entries, expected a list of num_hidden_layers="):
        config_from_dict(data)


# --------------------------------------------------------------------------- normalization


def test_hidden_activation_mapped_to_hidden_act(dev_configs: dict[str, dict[str, Any]]) -> None:
    data = dev_configs["gemma3"]
    assert "hidden_act" not in data
    assert config_from_dict(data).hidden_act == "gelu_pytorch_tanh"
    # When both are present (older Gemma configs), transformers' Gemma MLP reads hidden_activation.
    both = data | {"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"}
    assert config_from_dict(both).hidden_act == "gelu_pytorch_tanh"
    null_activation = data | {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": None}
    assert config_from_dict(null_activation).hidden_act == "gelu_pytorch_tanh"


def _gemma3_text_config() -> dict[str, Any]:
    """The text part of a multimodal Gemma 3 config (4B-style values, spelled out in full)."""
    return {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    }


@pytest.mark.parametrize("inner_model_type", [True, False], ids=["inner-model-type", "no-inner-model-type"])
def test_text_config_extraction(inner_model_type: bool) -> None:
    text = _gemma3_text_config()
    if inner_model_type:
        text["model_type"] = "gemma3_text"
    data = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "mm_tokens_per_image": 256,
        "text_config": text,
        "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"},
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    cfg = config_from_dict(data)
    assert cfg.model_type == "gemma3_text"
    assert cfg.hidden_size == 2560
    assert cfg.num_hidden_layers == 34
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.rope_local_base_freq == 10000.0
    assert cfg.sliding_window == 1024
    assert cfg.layer_types is not None
    assert [i for i, t in enumerate(cfg.layer_types) if t == FULL_ATTENTION] == [5, 11, 17, 23, 29]
    assert cfg.tie_word_embeddings is False  # from the outer config
    assert cfg.torch_dtype == "bfloat16"


GEMMA_3_4B_IT: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def test_gemma_3_4b_it_text_config_written_as_a_diff() -> None:
    """transformers saves a nested config as its difference from the defaults: they fill the gaps."""
    before = copy.deepcopy(GEMMA_3_4B_IT)
    cfg = config_from_dict(GEMMA_3_4B_IT)
    assert before == GEMMA_3_4B_IT
    assert cfg.model_type == "gemma3_text"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (2560, 10240, 34)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.computed_head_dim) == (8, 4, 256)
    assert cfg.vocab_size == 262208
    assert cfg.query_pre_attn_scalar == 256.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert (cfg.rope_theta, cfg.rope_local_base_freq) == (1_000_000.0, 10_000.0)
    assert cfg.sliding_window == 1024
    assert cfg.layer_types is not None
    assert [i for i, t in enumerate(cfg.layer_types) if t == FULL_ATTENTION] == [5, 11, 17, 23, 29]
    assert cfg.eos_token_id == [1, 106]  # from the wrapper
    assert cfg.tie_word_embeddings is True
    assert cfg.torch_dtype == "bfloat16"


def test_gemma_3_4b_it_agrees_with_transformers() -> None:
    from transformers import Gemma3Config, Gemma3TextConfig

    hf_text = Gemma3Config.from_dict(copy.deepcopy(GEMMA_3_4B_IT)).text_config
    assert isinstance(hf_text, Gemma3TextConfig)
    ours = config_from_dict(GEMMA_3_4B_IT)
    theirs = config_from_dict(hf_text.to_dict())
    for field in ModelConfig.__dataclass_fields__:
        if field not in (
            "extra",
            "sliding_window_pattern",
            "eos_token_id",
            "bos_token_id",
            "pad_token_id",
            "torch_dtype",
        ):
            assert getattr(ours, field) == getattr(theirs, field), field
    assert hf_text.layer_types is not None
    assert ours.layer_types == list(hf_text.layer_types)


def test_text_config_own_values_win_over_outer() -> None:
    text = _gemma3_text_config() | {"model_type": "gemma3_text", "tie_word_embeddings": True}
    cfg = config_from_dict({"model_type": "gemma3", "text_config": text, "tie_word_embeddings": False})
    assert cfg.tie_word_embeddings is True


def test_unknown_fields_ignored(dev_configs: dict[str, dict[str, Any]]) -> None:
    data = dev_configs["llama"] | {"foo": 1, "quantization_config": {"bits": 4}, "auto_map": {"x": "y"}}
    assert config_from_dict(data) == config_from_dict(dev_configs["llama"])


def test_json_nulls_fall_back_to_defaults(dev_configs: dict[str, dict[str, Any]]) -> None:
    data = dev_configs["llama"] | {
        "mlp_bias": None,
        "attention_bias": None,
        "rms_norm_eps": None,
        "rope_theta": None,
        "hidden_act": None,
        "head_dim": None,
        "tie_word_embeddings": None,
        "rope_scaling": None,
        "num_key_value_heads": None,
    }
    cfg = config_from_dict(data)
    defaults = {f: ModelConfig.__dataclass_fields__[f].default for f in ModelConfig.__dataclass_fields__}
    assert cfg.mlp_bias is False and defaults["mlp_bias"] is False
    assert cfg.attention_bias is False
    assert cfg.rms_norm_eps == defaults["rms_norm_eps"] == 1e-5
    assert cfg.rope_theta == defaults["rope_theta"] == 10000.0
    assert cfg.hidden_act == defaults["hidden_act"] == "silu"
    assert cfg.head_dim is None
    assert cfg.computed_head_dim == 2048 // 32
    assert cfg.tie_word_embeddings is False
    assert cfg.rope_scaling is None
    assert cfg.num_key_value_heads == cfg.num_attention_heads  # missing -> MHA, as transformers does


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_input_not_mutated(tmp_path: Path, dev_configs: dict[str, dict[str, Any]], name: str) -> None:
    data = dev_configs[name]
    before = copy.deepcopy(data)
    config_from_dict(data)
    assert data == before
    nested = {"model_type": "gemma3", "text_config": _gemma3_text_config(), "tie_word_embeddings": True}
    nested_before = copy.deepcopy(nested)
    config_from_dict(nested)
    assert nested == nested_before


def test_legacy_rope_scaling_type_key(dev_configs: dict[str, dict[str, Any]]) -> None:
    data = dev_configs["llama"] | {"rope_scaling": {"type": "linear", "factor": 2.0}}
    assert config_from_dict(data).rope_scaling == {"rope_type": "linear", "factor": 2.0}
    default = dev_configs["llama"] | {"rope_scaling": {"rope_type": "default"}}
    assert config_from_dict(default).rope_scaling is None


# --------------------------------------------------------------------------- head_dim


def test_computed_head_dim_explicit(dev_configs: dict[str, dict[str, Any]]) -> None:
    data = dev_configs["qwen3"] | {"head_dim": 96}
    assert config_from_dict(data).computed_head_dim == 96


def test_computed_head_dim_inferred(dev_configs: dict[str, dict[str, Any]]) -> None:
    data = dev_configs["llama"]
    del data["head_dim"]
    cfg = config_from_dict(data)
    assert cfg.head_dim is None
    assert cfg.computed_head_dim == 2048 // 32 == 64


def test_computed_head_dim_decoupled(dev_configs: dict[str, dict[str, Any]]) -> None:
    cfg = config_from_dict(dev_configs["gemma3"])
    assert cfg.hidden_size // cfg.num_attention_heads == 288
    assert cfg.computed_head_dim == 256


# --------------------------------------------------------------------------- layer_types


def test_layer_types_from_sliding_window_pattern(dev_configs: dict[str, dict[str, Any]]) -> None:
    cfg = config_from_dict(dev_configs["gemma3"] | {"num_hidden_layers": 13})
    expected = [SLIDING_ATTENTION] * 5 + [FULL_ATTENTION] + [SLIDING_ATTENTION] * 5 + [FULL_ATTENTION]
    assert cfg.layer_types == [*expected, SLIDING_ATTENTION]
    assert cfg.layer_type(5) == FULL_ATTENTION and cfg.layer_type(0) == SLIDING_ATTENTION


def test_no_layer_types_without_pattern(dev_configs: dict[str, dict[str, Any]]) -> None:
    data = dev_configs["gemma3"]
    del data["sliding_window_pattern"]
    cfg = config_from_dict(data)
    assert cfg.layer_types is None
    assert cfg.layer_type(0) == FULL_ATTENTION


def test_explicit_layer_types_preserved(dev_configs: dict[str, dict[str, Any]]) -> None:
    explicit = [FULL_ATTENTION if i % 2 else SLIDING_ATTENTION for i in range(26)]
    data = dev_configs["gemma3"] | {"layer_types": explicit}  # disagrees with sliding_window_pattern=6
    cfg = config_from_dict(data)
    assert cfg.layer_types == explicit
    assert cfg.layer_types is not explicit  # a copy, not the caller's list


# --------------------------------------------------------------------------- transformers-written configs


def test_gemma3_rope_parameters_per_layer_type(tmp_path: Path) -> None:
    from transformers import Gemma3TextConfig

    hf = Gemma3TextConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=48,
        query_pre_attn_scalar=40,
        sliding_window=64,
        max_position_embeddings=4096,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=False,
    )
    hf.save_pretrained(str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in raw and "layer_types" in raw and "rope_theta" not in raw
    cfg = load_config(tmp_path)
    assert cfg.model_type == "gemma3_text"
    assert cfg.rope_theta == 1_000_000.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.rope_local_base_freq == 10_000.0
    assert hf.layer_types is not None
    assert cfg.layer_types == list(hf.layer_types)
    assert [i for i, t in enumerate(cfg.layer_types) if t == FULL_ATTENTION] == [5]
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.head_dim == 48
    assert cfg.query_pre_attn_scalar == 40.0
    assert cfg.sliding_window == 64
    assert cfg.tie_word_embeddings is False


def test_gemma3_default_transformers_config() -> None:
    from transformers import Gemma3TextConfig

    hf = Gemma3TextConfig()
    cfg = config_from_dict(hf.to_dict())
    assert hf.layer_types is not None and hf.rope_parameters is not None
    assert cfg.layer_types == list(hf.layer_types)
    assert cfg.rope_theta == hf.rope_parameters[FULL_ATTENTION]["rope_theta"]
    assert cfg.rope_local_base_freq == hf.rope_parameters[SLIDING_ATTENTION]["rope_theta"]
    assert cfg.rope_scaling is None
    assert cfg.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert cfg.tie_word_embeddings is hf.tie_word_embeddings


def test_llama_rope_parameters(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    }
    LlamaConfig(
        hidden_size=256, num_attention_heads=4, num_hidden_layers=2, rope_parameters=rope
    ).save_pretrained(str(tmp_path))
    cfg = load_config(tmp_path)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert cfg.layer_types is None


def test_qwen3_sliding_layer_types_from_transformers() -> None:
    from transformers import Qwen3Config

    hf = Qwen3Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    cfg = config_from_dict(hf.to_dict())
    assert hf.layer_types is not None
    assert cfg.layer_types == list(hf.layer_types)
    assert cfg.layer_types.count(SLIDING_ATTENTION) == 2
    assert cfg.sliding_window == 16
    assert cfg.rope_scaling is None


def test_scaled_rope_on_sliding_layers_rejected() -> None:
    from transformers import Gemma3TextConfig

    data = Gemma3TextConfig(num_hidden_layers=6).to_dict()
    data["rope_parameters"][SLIDING_ATTENTION] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="sliding"):
        config_from_dict(data)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_hub_and_transformers_rewritten_configs_agree(
    dev_configs: dict[str, dict[str, Any]], name: str
) -> None:
    """A hub config and the same config re-written by transformers (rope_parameters, layer_types) agree."""
    from transformers import CONFIG_MAPPING

    hub = dev_configs[name]
    rewritten = CONFIG_MAPPING[hub["model_type"]].from_dict(copy.deepcopy(hub)).to_dict()
    a, b = config_from_dict(hub), config_from_dict(rewritten)
    for field in ModelConfig.__dataclass_fields__:
        if field in ("layer_types", "extra"):
            continue
        assert getattr(a, field) == getattr(b, field), field
    assert [a.layer_type(i) for i in range(a.num_hidden_layers)] == [
        b.layer_type(i) for i in range(b.num_hidden_layers)
    ]


def test_tiny_checkpoint_configs(tiny_ckpt_factory: Any, arch: str) -> None:
    """The configs `infer.testing` writes (transformers style) read back with their distinguishing traits."""
    cfg = load_config(tiny_ckpt_factory(arch))
    expected_type = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3_text"}[arch]
    assert cfg.model_type == expected_type
    assert cfg.num_key_value_heads * 2 == cfg.num_attention_heads
    if arch == "llama":
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
        assert cfg.tie_word_embeddings is False
    if arch == "qwen3":
        assert cfg.computed_head_dim == 24 != cfg.hidden_size // cfg.num_attention_heads
        assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    if arch == "gemma3":
        assert cfg.layer_types == [SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION]
        assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
        assert cfg.rope_local_base_freq == 10000.0
        assert cfg.sliding_window == 8
        assert cfg.query_pre_attn_scalar == 24.0
        assert cfg.final_logit_softcapping == 30.0
        assert cfg.hidden_act == "gelu_pytorch_tanh"
