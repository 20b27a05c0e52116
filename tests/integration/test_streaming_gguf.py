"""Streaming GGUF files: packed layers stream as packed bytes, results identical to the resident GGUF model.

Tiny Llama / Qwen 3 / Gemma 3 models are written as GGUF with the project's writer
(llama.cpp's layout) and loaded twice with `infer.load`: resident, and streamed.
Logits of a prefill and of KV-cached greedy decode steps must be equal (`torch.equal`);
a Q4_0 file must move about a quarter of the bytes of a bfloat16 one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_gguf import write_gguf_files

import infer
from infer.models.base import DecoderLM
from infer.streaming import StreamingConfig

# What GGUF can express of each tiny config (no Gemma soft-capping).
OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {},
    "gemma3": {"query_pre_attn_scalar": 32, "final_logit_softcapping": None},
}
STEPS = 4


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    return write_gguf_files(tmp_path_factory.mktemp("gguf-stream"), OVERRIDES, ("Q4_0", "Q8_0", "BF16"))


def streamed(path: Path, dtype: torch.dtype | None = None, **kw: Any) -> DecoderLM:
    settings: dict[str, Any] = dict(memory_budget="64MB", max_resident_layers=0, max_context=64)
    settings.update(kw)
    return infer.load(path, dtype=dtype, streaming=StreamingConfig(**settings)).model


@torch.inference_mode()
def trace(model: DecoderLM) -> list[torch.Tensor]:
    ids = torch.randint(0, 262, (1, 16), generator=torch.Generator().manual_seed(0))
    cache = model.make_cache(1, 16 + STEPS)
    logits = [model(ids, cache)]
    for _ in range(STEPS):
        logits.append(model(logits[-1][:, -1:].argmax(-1), cache))
    return logits


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
@pytest.mark.parametrize("group_size", [1, 3])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_gguf_streamed_equals_resident(
    gguf_files: dict[tuple[str, str], Path], arch: str, qtype: str, group_size: int, prefetch: bool
) -> None:
    path = gguf_files[arch, qtype]
    resident = infer.load(path).model
    model = streamed(path, layer_group_size=group_size, prefetch=prefetch)
    want, got = trace(resident), trace(model)
    worst = max((w - g).abs().max().item() for w, g in zip(want, got, strict=True))
    print(f"{arch} {qtype} group={group_size} prefetch={prefetch}: max diff {worst:.3g}")
    assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
    assert model.executor.stats.bytes_loaded > 0


def test_q4_moves_a_quarter_of_bf16(gguf_files: dict[tuple[str, str], Path]) -> None:
    moved = {}
    for qtype in ("Q4_0", "BF16"):
        model = streamed(gguf_files["llama", qtype], torch.bfloat16, layer_group_size=3)
        trace(model)
        stats = model.executor.stats
        moved[qtype] = stats.bytes_loaded / stats.forwards
    ratio = moved["Q4_0"] / moved["BF16"]
    print(f"bytes per forward: Q4_0 {moved['Q4_0']:.0f}, BF16 {moved['BF16']:.0f} (ratio {ratio:.2f})")
    assert ratio < 0.35


def test_public_api_streams_gguf(gguf_files: dict[tuple[str, str], Path]) -> None:
    path = gguf_files["qwen3", "Q4_0"]
    config = StreamingConfig(layer_group_size=2, memory_budget="64MB", max_resident_layers=0)
    want = infer.load(path).generate(["hello there"], max_new_tokens=6)
    llm = infer.load(path, streaming=config)
    got = llm.generate(["hello there"], max_new_tokens=6)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert llm.streaming_stats.bytes_loaded > 0


def test_gguf_embedding_stays_resident(gguf_files: dict[tuple[str, str], Path]) -> None:
    with pytest.raises(ValueError, match="packed or quantized embedding and head stay resident"):
        streamed(gguf_files["llama", "Q4_0"], resident_embeddings=False)
