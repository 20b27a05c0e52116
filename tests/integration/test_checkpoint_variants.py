"""Checkpoint layouts seen in the wild load to the same model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import infer


def variant(
    src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict[str, object] | None = None
) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with ``tensors`` stored instead (and ``config``, if given)."""
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if not (dst / f.name).exists():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_multimodal_gemma3_checkpoint_loads_its_language_model(
    prefix: str, tiny_ckpt_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Gemma 3 4B+ layout: config under text_config, text weights nested, a vision tower beside them."""
    src = tiny_ckpt_factory("gemma3")
    text_config = json.loads((src / "config.json").read_text())
    config = {"model_type": "gemma3", "text_config": text_config, "vision_config": {"hidden_size": 8}}
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        tensors[prefix + name.removeprefix("model.") if name.startswith("model.") else name] = t
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(8, 3, 2, 2)
    tensors["multi_modal_projector.mm_input_projection_weight"] = torch.zeros(8, 64)
    dst = variant(src, tmp_path / "mm", tensors, config)
    ids = torch.randint(0, 260, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = infer.load(src).model(ids)
        got = infer.load(dst).model(ids)
    assert torch.equal(got, expected)


def test_nested_names_without_multimodal_layout_are_rejected(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path
) -> None:
    src = tiny_ckpt_factory("llama")
    tensors = load_file(src / "model.safetensors")
    tensors["vision_tower.patch.weight"] = torch.zeros(2)
    dst = variant(src, tmp_path / "extra", tensors)
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) for model_type 'llama': \['vision_tower"):
        infer.load(dst)


def test_stored_buffers_are_ignored(tiny_ckpt_factory: Callable[..., Path], tmp_path: Path) -> None:
    """Older Llama checkpoints saved RoPE inv_freq buffers: recomputed, not loaded, not an error."""
    src = tiny_ckpt_factory("llama")
    tensors = load_file(src / "model.safetensors")
    for i in range(3):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    dst = variant(src, tmp_path / "buffers", tensors)
    ids = torch.randint(0, 260, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(infer.load(dst).model(ids), infer.load(src).model(ids))


def test_gpt2_mask_buffers_are_ignored(tmp_path: Path) -> None:
    """Old GPT-2 checkpoints stored the causal-mask buffers ``h.N.attn.bias`` / ``attn.masked_bias``."""
    from transformers import GPT2LMHeadModel

    from infer.testing import tiny_hf_config

    hf = GPT2LMHeadModel(tiny_hf_config("gpt2")).eval()  # type: ignore[no-untyped-call]
    hf.save_pretrained(str(tmp_path / "plain"))
    tensors = load_file(tmp_path / "plain" / "model.safetensors")
    for i in range(hf.config.n_layer):
        tensors[f"transformer.h.{i}.attn.bias"] = torch.ones(1, 1, 4, 4)
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, tmp_path / "plain" / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 260, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            infer.load(tmp_path / "plain").model(ids), hf(ids).logits, rtol=0, atol=1e-5
        )
    tensors["transformer.h.0.attn.extra"] = torch.ones(2)
    save_file(tensors, tmp_path / "plain" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\).*h.0.attn.extra"):
        infer.load(tmp_path / "plain")
