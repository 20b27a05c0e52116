"""Bad values in configs, GGUF metadata and weights: refused at load with the file and key named.

Each case used to load and then emit token 0 forever, fail later with a raw error
(ZeroDivisionError, a reshape error, a huggingface_hub dataclass error), or allocate
memory and time in proportion to a corrupt count before failing.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFValueType, GGUFWriter
from gguf_copy import copy_tensors_and_close
from safetensors.torch import load_file, save_file

import infer
from infer.gguf import GGUFFile, config_from_gguf
from infer.gguf.reader import StringArray
from infer.gguf.writer import write_gguf
from infer.inspect import inspect_checkpoint
from infer.testing import build_tokenizer, tiny_hf_model


def _config_copy(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    (dst / "config.json").write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"num_attention_heads": 0}, "'num_attention_heads' = 0, expected a positive integer"),
        ({"hidden_size": "64"}, "'hidden_size' = '64', expected an integer"),
        ({"num_hidden_layers": 2**31}, "'num_hidden_layers' = 2147483648, expected an integer in [1, 10000]"),
        ({"rms_norm_eps": math.nan}, "'rms_norm_eps' = nan, expected a finite number"),
        ({"rms_norm_eps": -1.0}, "'rms_norm_eps' = -1.0, expected a number > 0"),
        ({"rope_theta": 0}, "'rope_theta' = 0.0, expected a number > 0"),
        ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
        ({"head_dim": None, "hidden_size": 66}, "hidden_size 66 is not divisible by num_attention_heads 4"),
        (
            {"eos_token_id": 5000},
            "special token id 5000 (bos_token_id / eos_token_id) is outside the vocabulary",
        ),
        ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' = 'yes', expected true or false"),
        (
            {"layer_types": ["full_attention", "mystery", "full_attention"]},
            "unsupported layer type(s) ['mystery']",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported RoPE scaling type 'yarn'"),
        ({"hidden_act": ""}, "'hidden_act' = '', expected one of ['gelu', 'gelu_new'"),
        ({"layer_types": "full"}, "'layer_types' = 'full', expected a list of num_hidden_layers=3"),
        ({"rope_parameters": [1]}, "'rope_parameters' = [1], expected an object"),
        # found by benchmarks/fuzz.py: a null theta was a raw TypeError when RoPE was computed
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": None}},
            "'rope_theta' = None, expected a finite number",
        ),
        (
            {"rope_parameters": {"full_attention": 3}},
            "'rope_parameters.full_attention' = 3, expected an object",
        ),
        ({"torch_dtype": "float99"}, "'torch_dtype' = 'float99' is not a dtype models compute in"),
        # Sizes past what torch's kernels index (was an 8 GiB RoPE table, then a raw TypeError from
        # torch.empty for 10**30: found by benchmarks/fuzz.py).
        ({"head_dim": 2**31}, "'head_dim' = 2147483648, expected a positive integer below 2^31, or null"),
        ({"head_dim": 10**30}, "expected a positive integer below 2^31, or null"),
        (
            {"intermediate_size": 2**40},
            "'intermediate_size' = 1099511627776, expected a positive integer below 2^31",
        ),
        # Checked against the weights before any buffer sized by it exists.
        ({"head_dim": 2**20}, "has shape [64, 64], expected [4194304, 64]"),
    ],
)
def test_config_values(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path, changes: dict[str, Any], needle: str
) -> None:
    path = _config_copy(tiny_ckpt_factory("llama"), tmp_path / "bad", **changes)
    if "rope_scaling" in changes or "rope_theta" in changes:  # the file's rope_parameters would win
        data = json.loads((path / "config.json").read_text())
        data.pop("rope_parameters", None)
        (path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        infer.load(path)
    message = str(info.value)
    print(message)
    assert needle in message and str(path) in message


@pytest.mark.parametrize("text", [b"\xff\xfe{", b"[" * 100_000 + b"]" * 100_000], ids=["utf16", "nested"])
def test_unreadable_config_json(tiny_ckpt_factory: Callable[..., Path], tmp_path: Path, text: bytes) -> None:
    path = _config_copy(tiny_ckpt_factory("llama"), tmp_path / "bad")
    (path / "config.json").write_bytes(text)
    with pytest.raises(ValueError, match="not valid JSON") as info:
        infer.load(path)
    assert str(path / "config.json") in str(info.value)


def test_inspect_names_a_layer_past_the_config(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """A stored layer the config lacks: `inspect` reports it (was an `IndexError`); a load refuses it."""
    path = tmp_path / "extra"
    shutil.copytree(tiny_ckpt_factory("llama"), path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.7.input_layernorm.weight"] = tensors[
        "model.layers.0.input_layernorm.weight"
    ].clone()
    save_file(tensors, path / "model.safetensors")
    report = inspect_checkpoint(path)
    print(report.splitlines()[-2])
    assert "layer 7 (past the config's 3 layers: a load refuses it" in report
    positions = infer.loader.config.load_config(path).max_position_embeddings
    with pytest.raises(
        ValueError, match=rf"context {positions + 1} is past the model's {positions} positions"
    ):
        inspect_checkpoint(path, context=positions + 1)
    with pytest.raises(ValueError, match="unexpected"):
        infer.load(path)


def test_integer_weights_refused(tiny_ckpt_factory: Callable[..., Path], tmp_path: Path) -> None:
    """A weight stored as integers is refused at load, resident or streamed (was a matmul error)."""
    path = tmp_path / "int"
    shutil.copytree(tiny_ckpt_factory("llama"), path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.int64)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    for streaming in (None, infer.StreamingConfig(memory_budget="64MB", max_resident_layers=0)):
        with pytest.raises(ValueError, match=f"tensor '{name}' has dtype torch.int64, expected a floating"):
            infer.load(path, streaming=streaming)


def test_layer_count_checked_against_the_tensors(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path
) -> None:
    path = _config_copy(tiny_ckpt_factory("llama"), tmp_path / "bad", num_hidden_layers=9999)
    with pytest.raises(
        ValueError, match=r"num_hidden_layers is 9999, but the checkpoint has 3 layer\(s\) \(0..2\)"
    ):
        infer.load(path)


def _nan_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = math.nan
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_non_finite_weights_refused(tiny_ckpt_factory: Callable[..., Path], tmp_path: Path) -> None:
    path = _nan_checkpoint(tiny_ckpt_factory("llama"), tmp_path / "nan")
    for quantize in (None, "int8"):
        with pytest.raises(
            ValueError, match=r"tensor 'model.layers.1.mlp.down_proj.weight' holds a non-finite value"
        ):
            infer.load(path, quantize=quantize)
    assert infer.load(path, validate=False).model is not None  # the caller's choice
    streamed = infer.load(path, streaming=infer.StreamingConfig(memory_budget="64MB", max_resident_layers=0))
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.down_proj.weight' holds a non-finite value"):
        streamed.generate("hello", max_new_tokens=2)  # streamed weights are checked when first read


# --------------------------------------------------------------------------- GGUF


def test_a_packed_embedding_with_a_nan_scale_is_refused(tmp_path: Path) -> None:
    """The packed embedding's check reads only its blocks' fp16 scales (exact: `scale_fields_finite`);
    a NaN there is still found, and named with its row, as the full check named it."""
    hf = tiny_hf_model("llama", tie_word_embeddings=False)
    path = write_gguf(tmp_path / "m.gguf", hf, build_tokenizer(tmp_path / "tok"), qtype="Q8_0")
    infer.load(path, cache=False)  # loads while every scale is finite
    info = GGUFFile(path).tensors["token_embd.weight"]
    with path.open("r+b") as f:
        f.seek(info.offset + 7 * 34)  # block 7's d (Q8_0 blocks: fp16 d, 32 int8)
        f.write(bytes([0x00, 0x7E]))  # fp16 NaN
    with pytest.raises(ValueError, match=r"tensor 'token_embd.weight' holds a non-finite value \(nan"):
        infer.load(path, cache=False)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("good")
    return write_gguf(d / "llama.gguf", tiny_hf_model("llama"), build_tokenizer(d / "tok"), qtype="Q8_0")


def rewrite(src: Path, dst: Path, meta: dict[str, Any], arch: str | None = None) -> Path:
    """A copy of ``src`` with metadata ``meta`` changed (values typed as the original's, or given types)."""
    f = GGUFFile(src)
    w = GGUFWriter(str(dst), arch or f.architecture)
    for key, value in f.metadata.items():
        if key == "general.architecture":
            continue
        if arch is not None and key.startswith(f"{f.architecture}."):
            key = f"{arch}." + key.split(".", 1)[1]
        types = f.value_types[key if key in f.value_types else f"{f.architecture}." + key.split(".", 1)[1]]
        if key in meta:
            value = meta[key]
        if types[0] == GGUFValueType.ARRAY:
            items = value.tolist() if isinstance(value, StringArray | np.ndarray) else list(value)
            w.add_key_value(key, items, GGUFValueType.ARRAY, GGUFValueType(types[1]))
        else:
            w.add_key_value(key, value, GGUFValueType(types[0]))
    copy_tensors_and_close(f, w)
    return dst


@pytest.mark.parametrize(
    ("meta", "needle"),
    [
        (
            {"llama.block_count": 32769},
            "'llama.block_count' = 32769, but the tensor table has 3 block(s) (0..2)",
        ),
        (
            {"llama.block_count": 2**31},
            "'llama.block_count' = 2147483648, but the tensor table has 3 block(s)",
        ),
        (
            {"llama.embedding_length": 2**29},
            "'llama.embedding_length' = 536870912, but token_embd.weight has 64",
        ),
        (
            {"llama.embedding_length": 2**30},
            "'llama.embedding_length' = 1073741824, but token_embd.weight has 64",
        ),
        (
            {"llama.attention.layer_norm_rms_epsilon": math.nan},
            "rms_epsilon' = nan, expected a finite number > 0",
        ),
        (
            {"llama.attention.layer_norm_rms_epsilon": -1.0},
            "rms_epsilon' = -1.0, expected a finite number > 0",
        ),
        ({"llama.rope.freq_base": 0.0}, "'llama.rope.freq_base' = 0.0, expected a finite number > 0"),
        ({"llama.rope.freq_base": -1.0}, "'llama.rope.freq_base' = -1.0, expected a finite number > 0"),
        ({"llama.attention.head_count_kv": 3}, "'llama.attention.head_count' = 4 is not a multiple of"),
        (
            {"tokenizer.ggml.eos_token_id": 10**6},
            "'tokenizer.ggml.eos_token_id': expected an integer token id in 0..",
        ),
    ],
)
def test_gguf_metadata_values(good: Path, tmp_path: Path, meta: dict[str, Any], needle: str) -> None:
    bad = rewrite(good, tmp_path / "bad.gguf", meta)
    for load in (lambda: infer.load(bad), lambda: inspect_checkpoint(bad)):
        with pytest.raises(ValueError) as info:
            load()
        print(info.value)
        assert needle in str(info.value) and str(bad) in str(info.value)


def test_gguf_architecture_gpt_is_gpt2(tmp_path: Path) -> None:
    """The GGUF spec names GPT-2 files "gpt2" or "gpt"."""
    d = tmp_path / "gpt"
    src = write_gguf(d / "gpt2.gguf", tiny_hf_model("gpt2"), build_tokenizer(d / "tok"), qtype="F32")
    bad = rewrite(src, d / "gpt.gguf", {}, arch="gpt")
    config = config_from_gguf(GGUFFile(bad))
    assert config.model_type == "gpt2" and config.num_hidden_layers == 3
    ids = torch.randint(0, 260, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(infer.load(bad).model(ids), infer.load(src).model(ids))


def test_llama3_rope_freqs_are_the_converters(good: Path) -> None:
    """Llama 3.1+ files carry llama3 RoPE scaling as rope_freqs; it becomes per-frequency divisors."""
    from infer.gguf.writer import llama3_rope_factors

    gguf = GGUFFile(good)
    assert "rope_freqs.weight" in gguf.tensors
    config = config_from_gguf(gguf)
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "freq_factors"
    hf = tiny_hf_model("llama")
    from infer.loader.config import config_from_dict

    expected = llama3_rope_factors(config_from_dict(hf.config.to_dict()))
    np.testing.assert_array_equal(np.array(config.rope_scaling["factors"], np.float32), expected)
    assert expected.min() == 1.0 and expected.max() == 8.0  # high frequencies kept, low ones / factor
