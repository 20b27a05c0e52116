"""The generation API over a streamed model: same tokens as resident, long prompts chunked, batches."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import infer


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_streamed_generate_equals_resident(arch: str, tiny_ckpt_factory: Callable[..., Path]) -> None:
    path = tiny_ckpt_factory(arch)
    resident = infer.load(path)
    streaming = infer.StreamingConfig(
        layer_group_size=2,
        memory_budget="64MB",
        max_resident_layers=0,
        max_context=96,
        max_batch_size=3,
        max_prefill_tokens=8,  # a 30-token prompt goes in as chunks of at most 8 x 3 / batch tokens
    )
    streamed = infer.load(path, streaming=streaming)
    prompt = "A prompt of thirty tokens or so, longer than a chunk"
    assert len(resident.tokenizer.encode(prompt)) > 24
    a = resident.generate(prompt, max_new_tokens=20)
    b = streamed.generate(prompt, max_new_tokens=20)
    assert a.token_ids == b.token_ids
    prompts = ["Hi", "The quick brown fox jumps over", "Sixteen chars..!"]
    assert [r.token_ids for r in streamed.generate(prompts, max_new_tokens=12)] == [
        r.token_ids for r in resident.generate(prompts, max_new_tokens=12)
    ]
    stats = streamed.streaming_stats
    assert stats is not None
    assert stats.bytes_loaded > 0


def test_streamed_context_is_capped_by_the_plan(tiny_ckpt_factory: Callable[..., Path]) -> None:
    streaming = infer.StreamingConfig(layer_group_size=1, memory_budget="64MB", max_context=32)
    llm = infer.load(tiny_ckpt_factory("qwen3"), streaming=streaming)
    with pytest.raises(ValueError, match="prompt has 40 tokens; the model's context is 32 tokens"):
        llm.generate([5] * 40)
    g = llm.generate([5] * 20, max_new_tokens=50)
    assert len(g.token_ids) <= 12
    assert torch.is_tensor(llm.model(torch.tensor([[1, 2, 3]])))


@pytest.mark.parametrize("scheme", ["q4_0", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_streamed_quantized_equals_resident_quantized(
    arch: str, scheme: str, tiny_ckpt_factory: Callable[..., Path]
) -> None:
    """quantize= with streaming: packed layers stream, and the results are the resident quantized model's."""
    path = tiny_ckpt_factory(arch)
    resident = infer.load(path, quantize=scheme)
    streaming = infer.StreamingConfig(layer_group_size=2, memory_budget="64MB", max_resident_layers=0)
    streamed = infer.load(path, quantize=scheme, streaming=streaming)
    ids = torch.randint(0, 260, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(streamed.model(ids), resident.model(ids))
    assert (
        streamed.generate("Hello", max_new_tokens=12).token_ids
        == resident.generate("Hello", max_new_tokens=12).token_ids
    )
    floating = infer.load(path, streaming=streaming)  # float32 weights

    def moved(llm: infer.LLM) -> int:
        before = llm.streaming_stats.bytes_loaded
        llm.generate([5, 6, 7], max_new_tokens=4)
        return int(llm.streaming_stats.bytes_loaded - before)

    packed, full = moved(streamed), moved(floating)
    print(
        f"\n{arch} {scheme}: {packed} bytes streamed for 4 tokens, {full} for float32 ({packed / full:.2f}x)"
    )
    assert packed < 0.4 * full
