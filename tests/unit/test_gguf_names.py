"""GGUF tensor names -> our parameters (the architecture records' GGUF rules), and the undoing of
llama.cpp's converter changes."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch

from infer.assembly.build import build_empty
from infer.assembly.names import map_names
from infer.loader.config import ModelConfig
from infer.loader.source import StoredTensor
from infer.models import architecture
from infer.models.arch import Fix, unpermute_rows


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


class NamesOnly:
    """A `WeightSource` that only lists names (enough to map them)."""

    naming = "gguf"
    description = "names.gguf"

    def __init__(self, names: list[str]) -> None:
        self._tensors = {n: StoredTensor(n, (4,), torch.float32, 16) for n in names}

    def tensors(self) -> Mapping[str, StoredTensor]:
        return self._tensors

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        raise AssertionError("not read")

    def prefetch_hint(self, name: str) -> None:
        pass

    def close(self) -> None:
        pass


def _config(model_type: str, layers: int = 2, **kw: object) -> ModelConfig:
    return ModelConfig(model_type, 64, 128, layers, 4, 2, 100, 128, **kw)  # type: ignore[arg-type]


def _all_gguf_names(model_type: str, layers: int) -> list[str]:
    """Every GGUF name of a model, from the rules' tables (inverted)."""
    arch = architecture(model_type, "test")
    assert arch.gguf is not None
    layer = {v: k for k, v in arch.gguf.layer.items()}
    nonlayer = {v: k for k, v in arch.gguf.nonlayer.items()}
    names = []
    for param, _ in build_empty(_config(model_type, layers)).named_parameters():
        path, _, kind = param.rpartition(".")
        parts = path.split(".", 2)
        names.append(
            f"blk.{parts[1]}.{layer[parts[2]]}.{kind}" if parts[0] == "layers" else f"{nonlayer[path]}.{kind}"
        )
    return names


@pytest.mark.parametrize(
    ("model_type", "per_layer"),
    [("llama", 9), ("qwen3", 11), ("gemma3_text", 13), ("gpt2", 12), ("qwen2", 12), ("phi3", 6)],
)
def test_every_parameter_has_one_gguf_name(model_type: str, per_layer: int) -> None:
    names = _all_gguf_names(model_type, 3)
    assert len(names) == len(set(names))
    entries = map_names(NamesOnly(names), _config(model_type, 3), architecture(model_type, "test"))
    params = {n for n, _ in build_empty(_config(model_type, 3)).named_parameters()}
    assert set(entries) == params  # every parameter reachable, nothing extra
    assert sum(1 for n in entries if n.startswith("layers.1.")) == per_layer


def test_gpt2_names() -> None:
    entries = map_names(
        NamesOnly(["position_embd.weight", "blk.1.attn_qkv.bias", "output_norm.bias"]),
        _config("gpt2"),
        architecture("gpt2", "test"),
    )
    assert entries["embed_positions.weight"].stored.name == "position_embd.weight"
    assert entries["layers.1.attn.c_attn.bias"].stored.name == "blk.1.attn_qkv.bias"
    assert entries["norm.bias"].stored.name == "output_norm.bias"


def test_fixes() -> None:
    def fix(model_type: str, name: str) -> Fix | None:
        entries = map_names(NamesOnly([name]), _config(model_type), architecture(model_type, "test"))
        return next(iter(entries.values())).fix

    assert fix("llama", "blk.3.attn_q.weight") is Fix.PERMUTE_Q
    assert fix("llama", "blk.3.attn_q.bias") is Fix.PERMUTE_Q
    assert fix("llama", "blk.3.attn_k.weight") is Fix.PERMUTE_K
    assert fix("llama", "blk.3.attn_v.weight") is None
    assert fix("qwen3", "blk.3.attn_q.weight") is None  # NEOX RoPE in llama.cpp: not permuted
    assert fix("qwen2", "blk.3.attn_q.bias") is None
    assert fix("gemma3_text", "blk.0.attn_q_norm.weight") is Fix.UNIT_OFFSET
    assert fix("gemma3_text", "blk.0.post_ffw_norm.weight") is Fix.UNIT_OFFSET
    assert fix("gemma3_text", "output_norm.weight") is Fix.UNIT_OFFSET
    assert fix("gemma3_text", "blk.0.attn_q.weight") is None
    assert fix("gpt2", "blk.0.attn_qkv.weight") is None  # the converter already wrote [out, in]
    assert fix("gpt2", "output.weight") is None


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"names.gguf: unknown tensor name\(s\) for architecture 'llama': "):
        map_names(
            NamesOnly(["blk.0.attn_q.weight", "blk.0.mystery.weight"]),
            _config("llama"),
            architecture("llama", "t"),
        )


def test_config_tensors_are_not_parameters() -> None:
    entries = map_names(
        NamesOnly(["rope_freqs.weight", "token_embd.weight"]), _config("llama"), architecture("llama", "t")
    )
    assert list(entries) == ["embed_tokens.weight"]
