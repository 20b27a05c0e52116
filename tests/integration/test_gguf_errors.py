"""Bad GGUF files: each problem is a ``ValueError`` naming the file, the tensor or key, expected and found."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

import infer
from infer.gguf import GGUFFile
from infer.gguf.reader import StringArray
from infer.gguf.writer import write_gguf
from infer.testing import build_tokenizer, tiny_hf_model

LLAMA_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("good")
    return write_gguf(
        d / "llama.gguf",
        tiny_hf_model("llama", rope_parameters=LLAMA_ROPE),
        build_tokenizer(d / "tok"),
        qtype="Q8_0",
    )


def rewrite(
    src: Path,
    dst: Path,
    *,
    drop: tuple[str, ...] = (),
    add: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]] | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """A copy of ``src`` without ``drop``, with extra tensors ``add`` and metadata ``meta`` changed."""
    f = GGUFFile(src)
    w = GGUFWriter(str(dst), (meta or {}).get("general.architecture", f.architecture))
    for key, value in f.metadata.items():
        if key in ("general.architecture", *(meta or {})):
            continue
        types = f.value_types[key]
        if types[0] == GGUFValueType.ARRAY:
            items = value.tolist() if isinstance(value, StringArray | np.ndarray) else list(value)
            w.add_key_value(key, items, GGUFValueType.ARRAY, GGUFValueType(types[1]))
        else:
            w.add_key_value(key, value, GGUFValueType(types[0]))
    for key, value in (meta or {}).items():
        if value is not None:
            w.add_key_value(
                key, value, GGUFValueType.STRING if isinstance(value, str) else GGUFValueType.UINT32
            )
    for name, info in f.tensors.items():
        if name in drop:
            continue
        raw = np.array(f.raw(name))
        if info.ggml_type == GGMLQuantizationType.F32:
            w.add_tensor(name, raw.view(np.float32).reshape(info.shape))
        else:
            w.add_tensor(name, raw.reshape(info.shape[0], -1), raw_dtype=info.ggml_type)
    for name, (array, raw_dtype) in (add or {}).items():
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def expect_error(path: Path, *needles: str) -> str:
    with pytest.raises(ValueError) as info:
        infer.load(path, dtype=torch.float32)
    message = str(info.value)
    print(f"\n{message}")
    assert str(path) in message
    for needle in needles:
        assert needle in message, needle
    return message


def test_the_good_file_loads(good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # keep the tokenizer cache out of ~/.cache
    llm = infer.load(good, dtype=torch.float32)
    assert llm.config.model_type == "llama" and len(llm.model.layers) == 3 and llm.tokenizer.eos_token_ids


def test_missing_tensor(good: Path, tmp_path: Path) -> None:
    bad = rewrite(good, tmp_path / "bad.gguf", drop=("blk.1.ffn_up.weight",))
    expect_error(bad, "missing tensor(s)", "blk.1.ffn_up.weight", "layers.1.mlp.up_proj.weight")


def test_missing_output_norm(good: Path, tmp_path: Path) -> None:
    bad = rewrite(good, tmp_path / "bad.gguf", drop=("output_norm.weight",))
    expect_error(bad, "output_norm.weight")


def test_shape_mismatch(good: Path, tmp_path: Path) -> None:
    wrong = np.ones(32, np.float32)  # the norm has 64 entries
    name = "blk.0.attn_norm.weight"
    bad = rewrite(good, tmp_path / "bad.gguf", drop=(name,), add={name: (wrong, None)})
    expect_error(bad, "'blk.0.attn_norm.weight' has shape [32], expected [64]")


def test_shape_mismatch_packed(good: Path, tmp_path: Path) -> None:
    from gguf.quants import quantize

    wrong = quantize(np.ones((96, 64), np.float32), GGMLQuantizationType.Q8_0)  # q_proj is [64, 64]
    bad = rewrite(
        good,
        tmp_path / "bad.gguf",
        drop=("blk.2.attn_q.weight",),
        add={"blk.2.attn_q.weight": (wrong, GGMLQuantizationType.Q8_0)},
    )
    expect_error(bad, "'blk.2.attn_q.weight' has shape [96, 64], expected [64, 64]")


def test_unknown_tensor(good: Path, tmp_path: Path) -> None:
    bad = rewrite(good, tmp_path / "bad.gguf", add={"blk.0.mystery.weight": (np.ones(64, np.float32), None)})
    expect_error(bad, "unknown tensor name(s) for architecture 'llama'", "blk.0.mystery.weight")


def test_unexpected_bias(good: Path, tmp_path: Path) -> None:
    bad = rewrite(
        good, tmp_path / "bad.gguf", add={"blk.0.attn_output.bias": (np.ones(64, np.float32), None)}
    )
    expect_error(bad, "blk.0.attn_output.bias")


def test_bad_rope_freqs_are_refused(good: Path, tmp_path: Path) -> None:
    short = rewrite(good, tmp_path / "short.gguf", add={"rope_freqs.weight": (np.ones(5, np.float32), None)})
    expect_error(short, "RoPE frequency factors must be 8 positive finite numbers")
    values = np.ones(8, np.float32)
    values[3] = np.nan
    nan = rewrite(good, tmp_path / "nan.gguf", add={"rope_freqs.weight": (values, None)})
    expect_error(nan, "tensor 'rope_freqs.weight' holds values that are not finite and > 0")


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_1, GGMLQuantizationType.IQ4_NL])
def test_unsupported_quant_type(good: Path, tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    name = "blk.0.ffn_down.weight"  # [64, 128]
    raw = np.zeros((64, 128 // block * size), np.uint8)
    bad = rewrite(good, tmp_path / "bad.gguf", drop=(name,), add={name: (raw, qtype)})
    expect_error(bad, f"'{name}' has unsupported quant type {qtype.name}", "supported:")


def test_unsupported_architecture(good: Path, tmp_path: Path) -> None:
    bad = rewrite(good, tmp_path / "bad.gguf", meta={"general.architecture": "rwkv6"})
    expect_error(bad, "unsupported architecture 'rwkv6'", "general.architecture")


def test_truncated_file(good: Path, tmp_path: Path) -> None:
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    expect_error(bad, "truncated")
