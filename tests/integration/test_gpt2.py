"""GPT-2 from a safetensors directory and from GGUF files (F32, F16, Q8_0), against transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from model_checks import assert_cache_and_padding_match
from safetensors.torch import load_file, save_file

import infer
from infer.assembly.build import ModelBuilder, load_model
from infer.assembly.options import LoadOptions
from infer.gguf import GGUFFile, GGUFSource, config_from_gguf
from infer.gguf.writer import write_gguf
from infer.loader.config import load_config
from infer.loader.weights import SafetensorsSource
from infer.models.base import DecoderLM
from infer.quant import QuantizedLinear
from infer.testing import VOCAB_SIZE, build_tokenizer, perturb_

pytestmark = pytest.mark.slow  # parity with transformers: `pytest tests/integration/ -m slow` runs it

IDS = torch.randint(0, 262, (2, 20), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def hf_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB_SIZE, n_embd=64, n_layer=3, n_head=4, bos_token_id=256, eos_token_id=257
    )  # n_positions: the default 1024, which transformers' GGUF loader assumes (it ignores context_length)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()  # type: ignore[no-untyped-call]
    perturb_(model)
    return model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def checkpoint(hf_gpt2: Any, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpt2")
    hf_gpt2.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def _safetensors_model(path: Path) -> DecoderLM:
    return load_model(
        ModelBuilder(SafetensorsSource(path), load_config(path), LoadOptions(dtype=torch.float32))
    )


def test_safetensors_matches_transformers(checkpoint: Path, hf_gpt2: Any) -> None:
    model = _safetensors_model(checkpoint)
    with torch.no_grad():
        expected = hf_gpt2(IDS).logits
        got = model(IDS)
    err = (got - expected).abs().max().item()
    print(f"\nGPT-2 safetensors float32: max abs {err:.2e}")
    assert err <= 1e-4
    assert model.lm_head.weight is model.embed_tokens.weight  # tied


def test_checkpoint_without_transformer_prefix(checkpoint: Path, hf_gpt2: Any, tmp_path: Path) -> None:
    """Old checkpoints (saved from GPT2Model) have ``h.0.*``, ``wte.weight``, no prefix."""
    tensors = load_file(str(checkpoint / "model.safetensors"))
    save_file(
        {k.removeprefix("transformer."): v for k, v in tensors.items()}, str(tmp_path / "model.safetensors")
    )
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    model = _safetensors_model(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), hf_gpt2(IDS).logits, atol=1e-4, rtol=1e-4)


def test_cached_decode_and_padding(checkpoint: Path) -> None:
    """Absolute positions come from the cache (decode) and from the left padding (batch)."""
    model = _safetensors_model(checkpoint)
    assert_cache_and_padding_match(model, IDS, prefill=12, pad=4)
    with pytest.raises(ValueError, match="more than the model's 1024 positions"):
        model(torch.zeros(1, 1025, dtype=torch.long))
    cache = model.make_cache(1, 1100)
    model(torch.zeros(1, 1000, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="past the model's 1024 positions"):  # checked on the host
        model(torch.zeros(1, 30, dtype=torch.long), cache=cache)


def test_infer_load_generates(checkpoint: Path) -> None:
    llm = infer.load(checkpoint)
    result = llm.generate("hello", max_new_tokens=5)
    assert len(result.token_ids) == 5


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
def test_gguf_matches_transformers(qtype: str, hf_gpt2: Any, tokenizer: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = write_gguf(tmp_path / f"gpt2-{qtype}.gguf", hf_gpt2, tokenizer, qtype=qtype)
    gguf = GGUFFile(path)
    config = config_from_gguf(gguf)
    model = load_model(ModelBuilder(GGUFSource(gguf), config, LoadOptions(dtype=torch.float32)))
    if qtype == "Q8_0":
        assert isinstance(model.get_submodule("layers.0.attn.c_attn"), QuantizedLinear)
        assert isinstance(model.lm_head, QuantizedLinear)
    # transformers' own GGUF loader reads the file the same way (checks the writer's conventions).
    theirs = AutoModelForCausalLM.from_pretrained(  # type: ignore[no-untyped-call]
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        original = hf_gpt2(IDS).logits
        from_file = theirs(IDS).logits
        got = model(IDS)
    err_file = (got - from_file).abs().max().item()
    err = (got - original).abs().max().item()
    agree = (got.argmax(-1) == original.argmax(-1)).float().mean().item()
    print(
        f"\nGPT-2 GGUF {qtype}: vs transformers on the same file max abs {err_file:.2e}; "
        f"vs the float32 original max abs {err:.2e}, top-1 agreement {agree:.3f}"
    )
    assert err_file <= 1e-4
    if qtype == "F32":
        assert err <= 1e-4
    assert agree >= 0.9


def test_gguf_tokenizer_and_generation(
    hf_gpt2: Any, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "gpt2.gguf", hf_gpt2, tokenizer, qtype="Q8_0")
    llm = infer.load(path)
    for text in ("hello world", "  spaces\tand\nlines", "ünïcode ✓"):
        assert llm.tokenizer.encode(text) == tokenizer.encode(text)
    assert llm.config.model_type == "gpt2" and not llm.config.tie_word_embeddings  # output.weight is written
    result = llm.generate("hello", max_new_tokens=5)
    assert len(result.token_ids) == 5
    meta = json.loads(json.dumps({k: str(v)[:40] for k, v in GGUFFile(path).metadata.items()}))
    assert meta["tokenizer.ggml.model"] == "gpt2"


def test_unsupported_attention_scaling(checkpoint: Path, tmp_path: Path) -> None:
    data = json.loads((checkpoint / "config.json").read_text())
    data["scale_attn_by_inverse_layer_idx"] = True
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unsupported GPT-2 attention scaling"):
        load_config(tmp_path)
