"""Config fields read as transformers reads them, per architecture, measured against transformers.

Each architecture reads only the fields its transformers config reads (`Architecture.reads`):
Gemma's soft-capping, query scale and layer types change a Llama in neither library. Qwen's
``use_sliding_window`` / ``max_window_layers`` make the late layers sliding, in both. What
infer cannot run as transformers does is refused at load, naming the file and the key or
tensor: a bidirectional Gemma 3, a tied checkpoint whose stored head is not the embedding.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import infer
import infer.models  # registers the architectures with the config reader
from infer.loader.config import SLIDING_ATTENTION, config_from_dict, load_config
from infer.testing import build_checkpoint

SEQ = 40  # longer than every window below
TOL = 1e-4  # fp32 full-model logits, as tests/integration/test_models.py bounds them


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 260, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return model.eval()  # type: ignore[no-untyped-call]


def _max_abs_error(path: Path) -> float:
    """Max abs difference of infer's and transformers' fp32 logits on ``path``."""
    ids = _ids()
    with torch.no_grad():
        ref = _hf(path)(ids).logits
        got = infer.load(path, dtype=torch.float32).model(ids)
    assert got.shape == ref.shape
    return float((got - ref).abs().max())


def _edit_config(path: Path, **changes: Any) -> dict[str, Any]:
    """Rewrite ``path``'s config.json with ``changes`` (a None value removes the key)."""
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    return config


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_qwen_max_window_layers_match_transformers(arch: str, tmp_path: Path) -> None:
    """``use_sliding_window`` with no ``layer_types``: layers >= ``max_window_layers`` slide (one rule)."""
    path = build_checkpoint(
        tmp_path / arch, arch, use_sliding_window=True, sliding_window=4, max_window_layers=1
    )
    _edit_config(path, layer_types=None)
    config = load_config(path)
    hf = _hf(path)
    print(f"\n{arch} layer_types: infer {config.layer_types}, transformers {hf.config.layer_types}")
    assert config.layer_types == list(hf.config.layer_types)
    assert config.layer_types == ["full_attention", SLIDING_ATTENTION, SLIDING_ATTENTION]
    assert config.sliding_window == 4
    err = _max_abs_error(path)
    print(f"{arch} use_sliding_window max_window_layers=1 fp32 max abs logit error {err:.3e}")
    assert err <= TOL


def test_qwen_window_off_drops_sliding_window() -> None:
    """Without ``use_sliding_window`` transformers has no window: neither does infer."""
    from infer.testing import tiny_hf_config

    for arch in ("qwen2", "qwen3"):
        data = tiny_hf_config(arch, use_sliding_window=False, sliding_window=4, max_window_layers=1).to_dict()
        config = config_from_dict(data)
        assert config.sliding_window is None
        assert SLIDING_ATTENTION not in (config.layer_types or [])


# Fields of other architectures' transformers configs, which these ignore (and so must infer).
FOREIGN = dict(
    final_logit_softcapping=3.0,
    attn_logit_softcapping=2.0,
    query_pre_attn_scalar=7,
    rope_local_base_freq=100.0,
    sliding_window_pattern=2,
)


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("llama", dict(sliding_window=4, layer_types=[SLIDING_ATTENTION] * 3)),
        ("qwen2", {}),
        # AutoConfig reads a mistral config with layer_types as Ministral's, which honours them.
        ("mistral", dict(layer_types=["full_attention"] * 3)),
        ("phi3", dict(layer_types=["full_attention"] * 3)),  # Phi3Config ignores layer_types
        ("gpt2", dict(sliding_window=4, layer_types=[SLIDING_ATTENTION] * 3)),
    ],
)
def test_foreign_fields_ignored_like_transformers(
    arch: str, extra: dict[str, Any], tiny_ckpt_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Gemma-only fields (and, where the config ignores them, layer types) change nothing."""
    path = shutil.copytree(tiny_ckpt_factory(arch), tmp_path / arch)
    _edit_config(path, **FOREIGN, **extra)
    config = load_config(path)
    assert config.final_logit_softcapping is None and config.attn_logit_softcapping is None
    assert config.query_pre_attn_scalar is None and config.rope_local_base_freq is None
    err = _max_abs_error(path)
    print(f"\n{arch} with {sorted({**FOREIGN, **extra})}: fp32 max abs logit error {err:.3e}")
    assert err <= TOL


def test_gemma3_still_reads_its_fields(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """The filter keeps what Gemma3TextConfig reads (the tiny Gemma 3 sets each of them)."""
    config = load_config(tiny_ckpt_factory("gemma3"))
    assert config.final_logit_softcapping == 30.0
    assert config.query_pre_attn_scalar == 24.0
    assert config.sliding_window == 8 and SLIDING_ATTENTION in (config.layer_types or [])


@pytest.mark.parametrize("nested", [False, True])
def test_gemma3_bidirectional_attention_rejected(
    nested: bool, tiny_ckpt_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """EmbeddingGemma-style ``use_bidirectional_attention: true`` is refused, not run causally."""
    path = shutil.copytree(tiny_ckpt_factory("gemma3"), tmp_path / "gemma3")
    config = _edit_config(path, use_bidirectional_attention=True)
    if nested:
        wrapper = {"model_type": "gemma3", "text_config": config}
        (path / "config.json").write_text(json.dumps(wrapper))
    with pytest.raises(ValueError, match="'use_bidirectional_attention' = True, expected false") as info:
        infer.load(path)
    print(f"\n{info.value}")
    assert str(path / "config.json") in str(info.value)
    if not nested:
        _edit_config(path, use_bidirectional_attention=False)  # the default: loads
        assert load_config(path).model_type == "gemma3_text"


def _with_head(src: Path, dst: Path, head: Callable[[torch.Tensor], torch.Tensor]) -> Path:
    """A copy of tied checkpoint ``src`` that also stores ``lm_head.weight = head(embedding)``."""
    path = shutil.copytree(src, dst)
    tensors = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = head(tensors["model.embed_tokens.weight"]).contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_tied_checkpoint_with_a_different_stored_head_rejected(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """transformers keeps a stored head that differs from the embedding (untied); infer takes
    the tie from config.json in every mode, so it refuses the checkpoint, naming the tensor."""
    src = tiny_ckpt_factory("qwen3")  # tie_word_embeddings: true
    gen = torch.Generator().manual_seed(3)
    path = _with_head(src, tmp_path / "head", lambda e: torch.randn(e.shape, generator=gen))
    ids = _ids()
    with torch.no_grad():
        stored_head = _hf(path)(ids).logits
        tied = _hf(src)(ids).logits
    moved = float((stored_head - tied).abs().max())
    print(f"\ntransformers: stored head vs tied logits max abs difference {moved:.3e}")
    assert moved > 1.0  # transformers does use the stored head
    with pytest.raises(ValueError, match=r"tensor 'lm_head.weight' \(the output head\) differs") as info:
        infer.load(path)
    print(info.value)
    assert "tie_word_embeddings" in str(info.value) and str(path) in str(info.value)


def test_tied_checkpoint_with_a_redundant_head_loads(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """A stored head equal to the embedding (as many tied checkpoints have) loads tied."""
    path = _with_head(tiny_ckpt_factory("qwen3"), tmp_path / "same", lambda e: e.clone())
    model = infer.load(path, dtype=torch.float32).model
    assert model.lm_head.weight is model.embed_tokens.weight
    err = _max_abs_error(path)
    print(f"\nqwen3 tied with a redundant stored head: fp32 max abs logit error {err:.3e}")
    assert err <= TOL
