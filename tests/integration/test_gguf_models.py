"""Tiny models of every architecture written as GGUF (like llama.cpp's converter) and loaded back.

The reference is the transformers model itself, with every weight matrix replaced by
what the file holds: rounded to F16/BF16, or quantized and dequantized with
`gguf.quants` (independent of our code). At ``dtype=float32`` our logits must match it
to float32 rounding; that checks the config, the name maps, the undone Q/K permutation
and Gemma norm offset, and the packed modules. The default (bfloat16 packed products) is printed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from model_checks import assert_cache_and_padding_match

import infer
from infer.assembly.build import ModelBuilder
from infer.assembly.build import load_model as build_model
from infer.assembly.options import LoadOptions
from infer.gguf import GGUFFile, GGUFSource, config_from_gguf
from infer.gguf.writer import write_gguf
from infer.loading import GGUF_COMPUTE_DTYPE
from infer.models.base import DecoderLM
from infer.quant import QuantizedEmbedding, QuantizedLinear
from infer.testing import build_tokenizer, tiny_hf_model

pytestmark = pytest.mark.slow  # parity with transformers: `pytest tests/integration/ -m slow` runs it

# What GGUF can express of each tiny config (no Gemma soft-capping, Gemma's query scale fixed
# to head_dim, no sliding window for Mistral, which llama.cpp converts as llama). The tiny
# Llama keeps its llama3 RoPE scaling: the file carries it as rope_freqs (Llama 3.1+).
OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {},
    "gemma3": {"query_pre_attn_scalar": 32, "final_logit_softcapping": None},
    "qwen2": {},
    "mistral": {"sliding_window": None},
    "phi3": {},
}
QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"]


def stored_weights(model: Any, qtype: str) -> Any:
    """A copy of ``model`` whose weight matrices hold exactly what a ``qtype`` file stores."""
    ref = copy.deepcopy(model)
    qt = GGMLQuantizationType[qtype]
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() != 2 or qtype == "F32" or "wpe" in name:
                continue
            w = p.detach().float().numpy()
            if qtype == "F16":
                back = w.astype(np.float16).astype(np.float32)
            else:
                back = dequantize(quantize(w, qt), qt).reshape(w.shape)
            p.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    return ref


def load_model(path: Path, dtype: torch.dtype | None) -> DecoderLM:
    """As `infer.load` loads it (``None``: the default mix), without the tokenizer."""
    gguf = GGUFFile(path)
    config = config_from_gguf(gguf)
    compute = GGUF_COMPUTE_DTYPE if dtype is None else dtype
    options = LoadOptions(dtype=dtype or torch.float32, compute_dtype=compute)
    return build_model(ModelBuilder(GGUFSource(gguf), config, options))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_models() -> dict[str, Any]:
    return {arch: tiny_hf_model(arch, **kw) for arch, kw in OVERRIDES.items()}


IDS = torch.randint(0, 262, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", list(OVERRIDES))
def test_logits_match_transformers(
    arch: str, qtype: str, hf_models: dict[str, Any], tokenizer: Any, tmp_path: Path
) -> None:
    hf = hf_models[arch]
    path = write_gguf(tmp_path / f"{arch}-{qtype}.gguf", hf, tokenizer, qtype=qtype)
    ref = stored_weights(hf, qtype)
    ours = load_model(path, torch.float32)
    if qtype not in ("F32", "F16", "BF16"):
        linears = [m for m in ours.modules() if isinstance(m, QuantizedLinear)]
        hf_linears = [m for m in hf.modules() if isinstance(m, torch.nn.Linear)]
        assert len(linears) == len(hf_linears)  # every matrix and the head stay packed
        assert isinstance(ours.embed_tokens, QuantizedEmbedding)
    with torch.no_grad():
        expected = ref(IDS).logits
        got = ours(IDS)
        got_default = load_model(path, None)(IDS)
    err = (got - expected).abs().max().item()
    err_default = (got_default - expected).abs().max().item()
    agree_default = (got_default.argmax(-1) == expected.argmax(-1)).float().mean().item()
    scale = expected.abs().max().item()
    print(
        f"\n{arch} {qtype}: float32 max abs {err:.2e}; "
        f"default (bfloat16 products) max abs {err_default:.3f}, top-1 {agree_default:.3f}"
    )
    assert err <= 1e-4 * max(1.0, scale)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("arch", list(OVERRIDES))
def test_cache_and_padding_with_packed_weights(
    arch: str, hf_models: dict[str, Any], tokenizer: Any, tmp_path: Path
) -> None:
    """KV-cache decode and left padding give the full-sequence logits with packed (Q8_0) modules."""
    path = write_gguf(tmp_path / f"{arch}.gguf", hf_models[arch], tokenizer, qtype="Q8_0")
    model = load_model(path, torch.float32)
    assert_cache_and_padding_match(model, IDS, prefill=10, pad=3)


def test_infer_load_generates(
    hf_models: dict[str, Any], tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`infer.load` on a .gguf: tokenizer from the metadata, batched greedy generation (deterministic
    mode: batched tokens equal the prompts' alone by construction)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "qwen3.gguf", hf_models["qwen3"], tokenizer, qtype="Q4_0")
    llm = infer.load(path, dtype="float32", deterministic=True)
    assert llm.tokenizer.encode("hello") == tokenizer.encode("hello")
    assert llm.tokenizer.hf.chat_template == tokenizer.chat_template
    results = llm.generate(["hello", "a longer prompt here"], max_new_tokens=6)
    singles = [llm.generate(p, max_new_tokens=6) for p in ("hello", "a longer prompt here")]
    assert [r.token_ids for r in results] == [s.token_ids for s in singles]
    assert (tmp_path / "cache" / "infer" / "tokenizers").is_dir()


def test_default_dtypes(
    hf_models: dict[str, Any], tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Default: float32 activations, bfloat16 packed products; an explicit dtype applies to both."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "llama.gguf", hf_models["llama"], tokenizer, qtype="Q4_1")
    for dtype, activations, products in [
        (None, torch.float32, torch.bfloat16),
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ]:
        llm = infer.load(path, dtype=dtype)
        config, model = llm.config, llm.model
        head = model.lm_head
        assert model.dtype == activations and config.torch_dtype == str(activations).removeprefix("torch.")
        assert isinstance(head, QuantizedLinear) and head.compute_dtype == products
