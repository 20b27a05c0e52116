"""HF checkpoint names -> our module names, per architecture."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from infer.assembly.weight_map import (
    gemma3_weight_map,
    get_weight_map,
    llama_weight_map,
    qwen3_weight_map,
)
from infer.loader.config import config_from_dict

MAPS: dict[str, Callable[[int], dict[str, str]]] = {
    "llama": llama_weight_map,
    "qwen3": qwen3_weight_map,
    "gemma3_text": gemma3_weight_map,
}
PER_LAYER = {"llama": 9, "qwen3": 11, "gemma3_text": 13}
GLOBALS = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")


def per_layer_modules(mapping: dict[str, str], layer: int) -> set[str]:
    out = set()
    for name in mapping:
        m = LAYER_RE.match(name)
        if m and int(m.group(1)) == layer:
            out.add(m.group(2))
    return out


@pytest.mark.parametrize("model_type", list(MAPS))
@pytest.mark.parametrize("num_layers", [1, 2, 5])
def test_per_layer_and_total_counts(model_type: str, num_layers: int) -> None:
    mapping = MAPS[model_type](num_layers)
    for i in range(num_layers):
        assert len(per_layer_modules(mapping, i)) == PER_LAYER[model_type]
    assert len(mapping) == PER_LAYER[model_type] * num_layers + 3
    assert per_layer_modules(mapping, num_layers) == set()  # nothing past the last layer


def test_llama_modules() -> None:
    assert per_layer_modules(llama_weight_map(1), 0) == {
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    }


def test_qk_norm_only_in_qwen3_and_gemma3() -> None:
    qk = {"self_attn.q_norm", "self_attn.k_norm"}
    assert not qk & per_layer_modules(llama_weight_map(2), 1)
    assert qk <= per_layer_modules(qwen3_weight_map(2), 1)
    assert qk <= per_layer_modules(gemma3_weight_map(2), 1)


def test_gemma3_sandwich_norms() -> None:
    norms = {m for m in per_layer_modules(gemma3_weight_map(1), 0) if m.endswith("layernorm")}
    assert norms == {
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    }
    for build in (llama_weight_map, qwen3_weight_map):
        assert {m for m in per_layer_modules(build(1), 0) if m.endswith("layernorm")} == {
            "input_layernorm",
            "post_attention_layernorm",
        }


@pytest.mark.parametrize("model_type", list(MAPS))
def test_globals_always_present(model_type: str) -> None:
    for n in (0, 1, 3):
        mapping = MAPS[model_type](n)
        assert set(mapping) >= GLOBALS
        assert mapping["model.embed_tokens.weight"] == "embed_tokens.weight"
        assert mapping["model.norm.weight"] == "norm.weight"
        assert mapping["lm_head.weight"] == "lm_head.weight"


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_lm_head_listed_whether_tied_or_not(
    dev_configs: dict[str, dict[str, Any]], name: str, tie: bool
) -> None:
    config = config_from_dict(dev_configs[name] | {"tie_word_embeddings": tie})
    assert "lm_head.weight" in get_weight_map(config)


@pytest.mark.parametrize(
    ("name", "model_type", "layers"),
    [("llama", "llama", 16), ("qwen3", "qwen3", 28), ("gemma3", "gemma3_text", 26)],
)
def test_dispatcher_at_dev_model_sizes(
    dev_configs: dict[str, dict[str, Any]], name: str, model_type: str, layers: int
) -> None:
    config = config_from_dict(dev_configs[name])
    assert config.model_type == model_type and config.num_hidden_layers == layers
    mapping = get_weight_map(config)
    assert mapping == MAPS[model_type](layers)
    assert len(mapping) == PER_LAYER[model_type] * layers + 3
    assert per_layer_modules(mapping, layers - 1) and not per_layer_modules(mapping, layers)


def test_dispatcher_uses_num_hidden_layers(dev_configs: dict[str, dict[str, Any]]) -> None:
    config = config_from_dict(dev_configs["qwen3"] | {"num_hidden_layers": 3})
    assert get_weight_map(config) == qwen3_weight_map(3)


def test_dispatcher_unknown_model_type(dev_configs: dict[str, dict[str, Any]]) -> None:
    config = config_from_dict(dev_configs["llama"])
    config.model_type = "mamba"
    with pytest.raises(ValueError, match="mamba"):
        get_weight_map(config)


@pytest.mark.parametrize("model_type", list(MAPS))
def test_internal_name_is_hf_name_without_model_prefix(model_type: str) -> None:
    for hf, ours in MAPS[model_type](4).items():
        assert ours == hf.removeprefix("model."), hf


@pytest.mark.parametrize("model_type", list(MAPS))
def test_bijective(model_type: str) -> None:
    mapping = MAPS[model_type](6)
    assert len(set(mapping.values())) == len(mapping)


def test_qwen3_is_llama_plus_qk_norm() -> None:
    llama, qwen = llama_weight_map(4), qwen3_weight_map(4)
    assert set(llama) < set(qwen)
    extra = set(qwen) - set(llama)
    assert {LAYER_RE.match(n).group(2) for n in extra} == {"self_attn.q_norm", "self_attn.k_norm"}  # type: ignore[union-attr]
    assert len(extra) == 2 * 4


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_map_matches_transformers_and_our_model_at_dev_size(
    dev_configs: dict[str, dict[str, Any]], name: str
) -> None:
    """Map keys are exactly transformers' parameter names, values exactly ours (built on meta)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from infer.assembly.build import build_empty

    data = dev_configs[name]
    config = config_from_dict(data)
    mapping = get_weight_map(config)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(CONFIG_MAPPING[data["model_type"]].from_dict(data))  # type: ignore[no-untyped-call]
        ours = build_empty(config)
    assert set(hf.state_dict()) == set(mapping)  # state_dict lists a tied lm_head too
    assert set(ours.state_dict()) == set(mapping.values())


def test_map_matches_tiny_checkpoint_files(tiny_ckpt_factory: Any, arch: str, sharded: bool) -> None:
    """Every tensor saved by transformers is mapped; only a tied lm_head may be absent from the files."""
    from infer.loader.config import load_config
    from infer.loader.weights import SafetensorsSource

    path = tiny_ckpt_factory(arch, sharded)
    config = load_config(path)
    mapping = get_weight_map(config)
    saved = set(SafetensorsSource(path).keys())
    assert saved <= set(mapping)
    missing = set(mapping) - saved
    assert missing == ({"lm_head.weight"} if config.tie_word_embeddings else set())
