"""GGUF tensor-name tables and the undoing of llama.cpp's converter changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer.gguf.names import Fix, fix_for, gguf_weight_map, unpermute_rows
from infer.loader.config import ModelConfig
from infer.loader.weight_map import get_weight_map


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as published."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize(("rows", "heads"), [(576, 9), (192, 3), (64, 1), (8, 4)])
def test_unpermute_inverts_llama_cpp(rows: int, heads: int) -> None:
    hf = np.random.default_rng(0).standard_normal((rows, 5)).astype(np.float32)
    stored = _llama_cpp_permute(hf, heads)
    restored = torch.from_numpy(stored)[unpermute_rows(rows, heads)]
    np.testing.assert_array_equal(restored.numpy(), hf)


def _config(model_type: str, layers: int = 2) -> ModelConfig:
    return ModelConfig(model_type, 64, 128, layers, 4, 2, 100, 128)


@pytest.mark.parametrize(
    ("arch", "model_type", "per_layer"),
    [("llama", "llama", 9), ("qwen3", "qwen3", 11), ("gemma3", "gemma3_text", 13)],
)
def test_maps_cover_the_safetensors_maps(arch: str, model_type: str, per_layer: int) -> None:
    gguf = gguf_weight_map(arch, 3)
    assert len(gguf) == 3 + 3 * per_layer
    ours = set(get_weight_map(_config(model_type, 3)).values())
    assert set(gguf.values()) == ours  # every parameter reachable, nothing extra


def test_gpt2_map() -> None:
    gguf = gguf_weight_map("gpt2", 2)
    assert gguf["position_embd.weight"] == "embed_positions.weight"
    assert gguf["blk.1.attn_qkv.bias"] == "layers.1.attn.c_attn.bias"
    assert gguf["output_norm.bias"] == "norm.bias"
    hf = set(get_weight_map(_config("gpt2")).values())
    assert set(gguf.values()) == hf


def test_biases_are_optional_entries() -> None:
    assert "blk.0.attn_q.bias" not in gguf_weight_map("llama", 1)
    with_bias = gguf_weight_map("llama", 1, biases=True)
    assert with_bias["blk.0.attn_q.bias"] == "layers.0.self_attn.q_proj.bias"
    assert "blk.0.attn_norm.bias" not in with_bias


def test_fixes() -> None:
    assert fix_for("llama", "blk.3.attn_q.weight") is Fix.PERMUTE_Q
    assert fix_for("llama", "blk.3.attn_k.weight") is Fix.PERMUTE_K
    assert fix_for("llama", "blk.3.attn_v.weight") is None
    assert fix_for("qwen3", "blk.3.attn_q.weight") is None  # NEOX RoPE in llama.cpp: not permuted
    assert fix_for("gemma3", "blk.0.attn_q_norm.weight") is Fix.UNIT_OFFSET
    assert fix_for("gemma3", "output_norm.weight") is Fix.UNIT_OFFSET
    assert fix_for("gpt2", "blk.0.attn_qkv.weight") is Fix.TRANSPOSE
    assert fix_for("gpt2", "blk.0.attn_qkv.bias") is None
    assert fix_for("gpt2", "output.weight") is None


def test_unknown_architecture() -> None:
    with pytest.raises(ValueError, match="no GGUF tensor map for architecture 'mamba'"):
        gguf_weight_map("mamba", 1)
