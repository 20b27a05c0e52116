"""Bad input gets one clear error that names what is wrong."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import infer


@pytest.fixture(scope="module")
def llm(tiny_ckpt_factory: Callable[..., Path]) -> infer.LLM:
    return infer.load(tiny_ckpt_factory("llama"))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_empty_prompt(llm: infer.LLM) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([])
    with pytest.raises(ValueError, match="empty"):
        list(llm.stream(""))


def test_prompt_longer_than_context(llm: infer.LLM) -> None:
    context = llm.config.max_position_embeddings
    with pytest.raises(
        ValueError, match=rf"prompt has {context + 5} tokens; the model's context is {context}"
    ):
        llm.generate([1] * (context + 5))


def test_token_ids_out_of_range(llm: infer.LLM) -> None:
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([1, 2, llm.config.vocab_size])


def test_unknown_hub_id_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(
        FileNotFoundError, match=r"'nobody/no-such-model' is not on disk.*huggingface-cli download"
    ):
        infer.load("nobody/no-such-model")


def test_missing_path() -> None:
    with pytest.raises(FileNotFoundError, match=r"no such file or directory: \./does/not/exist"):
        infer.load("./does/not/exist")


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} has no config.json"):
        infer.load(tmp_path)


# (what is changed, tensors set, tensors deleted, the error)
EDITED_TENSORS: list[tuple[str, dict[str, torch.Tensor], list[str], str]] = [
    (
        "wrong-shape",
        {"model.layers.1.self_attn.k_proj.weight": torch.zeros(8, 64)},
        [],
        r"tensor 'model.layers.1.self_attn.k_proj.weight' has shape \[8, 64\], expected \[32, 64\]",
    ),
    (
        "missing",
        {},
        ["model.layers.2.mlp.up_proj.weight"],
        r"missing tensor\(s\) \['model.layers.2.mlp.up_proj.weight'\] "
        r"\(for parameters \['layers.2.mlp.up_proj.weight'\]",
    ),
    (
        "unexpected",
        {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)},
        [],
        r"unexpected tensor\(s\).*q_proj.bias",
    ),
    (
        "untied-without-lm-head",
        {},
        ["lm_head.weight"],
        r"model.safetensors: no 'lm_head.weight' and tie_word_embeddings",
    ),
]


def _edited_copy(src: Path, dst: Path, set_: dict[str, torch.Tensor], delete: list[str]) -> Path:
    """Checkpoint ``src`` copied to ``dst``, with tensors ``set_`` added or replaced and ``delete`` gone."""
    path = _copy(src, dst)
    tensors = load_file(path / "model.safetensors")
    for name in delete:
        del tensors[name]
    tensors.update(set_)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("case,set_,delete,message", EDITED_TENSORS, ids=[c[0] for c in EDITED_TENSORS])
def test_edited_checkpoint_is_refused(
    case: str,
    set_: dict[str, torch.Tensor],
    delete: list[str],
    message: str,
    tiny_ckpt_factory: Callable[..., Path],
    tmp_path: Path,
) -> None:
    path = _edited_copy(tiny_ckpt_factory("llama"), tmp_path / case, set_, delete)
    with pytest.raises(ValueError, match=message):
        infer.load(path)


def test_tied_checkpoint_with_stored_lm_head_reuses_embedding(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Like Qwen3-1.7B: tied, yet lm_head.weight stored (a copy of the embedding): loads tied.

    A stored head that differs is refused (transformers would keep it, untied):
    tests/integration/test_config_fields.py measures both.
    """
    src = tiny_ckpt_factory("qwen3")
    embedding = load_file(src / "model.safetensors")["model.embed_tokens.weight"]
    path = _edited_copy(src, tmp_path / "tied", {"lm_head.weight": embedding.clone()}, [])
    llm = infer.load(path)
    assert llm.model.lm_head.weight is llm.model.embed_tokens.weight
    zeros = _edited_copy(src, tmp_path / "zeros", {"lm_head.weight": torch.zeros_like(embedding)}, [])
    with pytest.raises(ValueError, match=r"'lm_head\.weight' .* differs from the embedding"):
        infer.load(zeros)


def test_unsupported_model_type(tiny_ckpt_factory: Callable[..., Path], tmp_path: Path) -> None:
    path = _copy(tiny_ckpt_factory("llama"), tmp_path / "mamba")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: unsupported model_type 'mamba'; supported: \["):
        infer.load(path)


def test_bad_dtype(tiny_ckpt_factory: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="unsupported dtype 'float8'"):
        infer.load(tiny_ckpt_factory("llama"), dtype="float8")


def test_default_dtype_is_the_checkpoints(tiny_ckpt_factory: Callable[..., Path]) -> None:
    assert infer.load(tiny_ckpt_factory("llama", dtype=torch.bfloat16)).model.dtype == torch.bfloat16
    assert infer.load(tiny_ckpt_factory("llama")).model.dtype == torch.float32
