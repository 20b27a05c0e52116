"""GGUF metadata -> `ModelConfig`: the real files, each architecture, and the errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter

from infer.gguf.config import config_from_gguf
from infer.gguf.reader import GGUFFile
from infer.realmodels import gemma3_270m_path, smollm2_path

# fmt: off
# The shipped real GGUF files -> the values of their hub config.json (and their tensor types).
REAL_EXPECTED: dict[str, dict[str, Any]] = {
    "smollm2": dict(  # HuggingFaceTB/SmolLM2-135M-Instruct
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, computed_head_dim=64, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=100000.0, rope_scaling=None, tie_word_embeddings=True,
        hidden_act="silu", bos_token_id=1, eos_token_id=2, pad_token_id=2,
    ),
    "gemma3_270m": dict(  # google/gemma-3-270m
        model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, computed_head_dim=256, vocab_size=262144,
        max_position_embeddings=32768, rope_theta=1_000_000.0, rope_local_base_freq=10000.0,
        rope_scaling=None, sliding_window=512, query_pre_attn_scalar=256.0, tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    ),
}
# fmt: on
REAL_PATHS = {"smollm2": smollm2_path, "gemma3_270m": gemma3_270m_path}
REAL_EPS = {"smollm2": 1e-5, "gemma3_270m": 1e-6}
REAL_FULL_LAYERS = {"smollm2": list(range(30)), "gemma3_270m": [5, 11, 17]}


@pytest.mark.realmodel
@pytest.mark.parametrize("model", list(REAL_EXPECTED))
def test_real_model_config(model: str) -> None:
    c = config_from_gguf(GGUFFile(REAL_PATHS[model]()))
    expected = REAL_EXPECTED[model]
    got = {key: getattr(c, key) for key in expected}
    wrong = {key: (got[key], value) for key, value in expected.items() if got[key] != value}
    assert not wrong, f"{model}: (got, expected) {wrong}"
    assert c.rms_norm_eps == pytest.approx(REAL_EPS[model])
    full = [i for i in range(c.num_hidden_layers) if c.layer_type(i) == "full_attention"]
    assert full == REAL_FULL_LAYERS[model]
    if model == "smollm2":
        assert c.extra["gguf"]["tensor_types"] == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    else:
        assert c.layer_types is not None


def _write(path: Path, arch: str, meta: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> Path:
    w = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    if tensors is None:
        tensors = {"token_embd.weight": np.zeros((100, 64), np.float32)}
    if not any(name.startswith("blk.") for name in tensors):  # one tensor per block the metadata declares
        blocks = meta.get(f"{arch}.block_count")
        for i in range(blocks if isinstance(blocks, int) else 0):
            tensors[f"blk.{i}.attn_norm.weight"] = np.ones(64, np.float32)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _base(arch: str) -> dict[str, Any]:
    return {
        f"{arch}.context_length": 128,
        f"{arch}.embedding_length": 64,
        f"{arch}.block_count": 2,
        f"{arch}.feed_forward_length": 96,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 5000.0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def test_qwen3_head_dim_from_key_length(tmp_path: Path) -> None:
    meta = {**_base("qwen3"), "qwen3.attention.key_length": 32, "qwen3.attention.value_length": 32}
    zeros = np.zeros((100, 64), np.float32)
    tensors = {"token_embd.weight": zeros, "output.weight": zeros}
    c = config_from_gguf(GGUFFile(_write(tmp_path / "q.gguf", "qwen3", meta, tensors)))
    assert c.model_type == "qwen3" and c.computed_head_dim == 32 and c.num_key_value_heads == 2
    assert c.rope_theta == 5000.0 and c.vocab_size == 100 and not c.tie_word_embeddings


def test_eot_token_is_a_stop_token(tmp_path: Path) -> None:
    meta = {**_base("llama"), "tokenizer.ggml.eot_token_id": 7}
    c = config_from_gguf(GGUFFile(_write(tmp_path / "l.gguf", "llama", meta)))
    assert c.eos_token_ids == [2, 7]


def test_gpt2(tmp_path: Path) -> None:
    sizes = {"context_length": 128, "embedding_length": 64, "block_count": 3, "feed_forward_length": 256}
    meta: dict[str, Any] = {f"gpt2.{k}": v for k, v in (sizes | {"attention.head_count": 4}).items()}
    meta["gpt2.attention.layer_norm_epsilon"] = 1e-5
    c = config_from_gguf(GGUFFile(_write(tmp_path / "g.gguf", "gpt2", meta)))
    assert c.model_type == "gpt2" and c.num_key_value_heads == 4 and c.computed_head_dim == 16
    assert c.attention_bias and c.mlp_bias and c.hidden_act == "gelu_new" and c.layer_types is None


def test_gemma3_pattern_and_linear_rope(tmp_path: Path) -> None:
    meta = {
        **_base("gemma3"),
        "gemma3.block_count": 4,
        "gemma3.attention.key_length": 32,
        "gemma3.attention.value_length": 32,
        "gemma3.attention.sliding_window": 16,
        "gemma3.attention.sliding_window_pattern": [True, False, True, False],
        "gemma3.rope.scaling.type": "linear",
        "gemma3.rope.scaling.factor": 8.0,
    }
    c = config_from_gguf(GGUFFile(_write(tmp_path / "g.gguf", "gemma3", meta)))
    assert c.layer_types == ["sliding_attention", "full_attention"] * 2
    assert c.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert c.query_pre_attn_scalar == 32.0


@pytest.mark.parametrize(
    ("arch", "change", "needle"),
    [
        ("mamba", {}, "unsupported architecture 'mamba'"),
        ("llama", {"llama.embedding_length": None}, "missing metadata key 'llama.embedding_length'"),
        ("llama", {"llama.block_count": "two"}, "'llama.block_count' = 'two', expected an integer"),
        ("llama", {"llama.block_count": 0}, "'llama.block_count' = 0, expected an integer > 0"),
        ("llama", {"llama.rope.dimension_count": 24}, "'llama.rope.dimension_count' = 24, expected an even"),
        ("llama", {"llama.rope.dimension_count": 7}, "'llama.rope.dimension_count' = 7, expected an even"),
        ("llama", {"llama.vocab_size": 99}, "'llama.vocab_size' = 99 but token_embd.weight has 100 rows"),
        (
            "llama",
            {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0},
            "unsupported RoPE scaling",
        ),
        (
            "qwen3",
            {"qwen3.attention.key_length": 32, "qwen3.attention.value_length": 16},
            "'qwen3.attention.key_length' = 32 differs",
        ),
    ],
)
def test_errors_name_the_key(tmp_path: Path, arch: str, change: dict[str, Any], needle: str) -> None:
    meta = {k.replace("llama", arch, 1): v for k, v in _base("llama").items()}
    meta.update(change)
    path = _write(tmp_path / "bad.gguf", arch, {k: v for k, v in meta.items() if v is not None})
    with pytest.raises(ValueError) as info:
        config_from_gguf(GGUFFile(path))
    print(info.value)
    assert needle in str(info.value) and str(path) in str(info.value)


def test_missing_token_embedding(tmp_path: Path) -> None:
    norm_only = {"output_norm.weight": np.ones(64, np.float32)}
    path = _write(tmp_path / "bad.gguf", "llama", _base("llama"), norm_only)
    with pytest.raises(ValueError, match=r"missing required tensor 'token_embd\.weight'"):
        config_from_gguf(GGUFFile(path))
