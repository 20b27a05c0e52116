"""Generation: greedy parity with transformers, KV-cache correctness, batching, sampling, streaming."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import infer
from infer.engine import SamplingParams
from infer.models.base import DecoderLM
from infer.testing.trace import trace


@pytest.fixture(scope="module")
def llm_factory(tiny_ckpt_factory: Callable[..., Path]) -> Callable[[str], infer.LLM]:
    cache: dict[str, infer.LLM] = {}

    def make(arch: str) -> infer.LLM:
        if arch not in cache:
            cache[arch] = infer.load(tiny_ckpt_factory(arch), dtype=torch.float32)
        return cache[arch]

    return make


def _greedy(llm: infer.LLM, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of ``ids`` through the engine, past any EOS id."""
    return trace(llm, [ids], SamplingParams(max_tokens=n, ignore_eos=True))[0].tokens


@pytest.mark.slow
def test_greedy_matches_transformers_generate(
    arch: str,
    llm_factory: Callable[[str], infer.LLM],
    hf_model_factory: Callable[..., object],
    tiny_ckpt_factory: Callable[..., Path],
) -> None:
    llm = llm_factory(arch)
    hf = hf_model_factory(tiny_ckpt_factory(arch), dtype=torch.float32)
    for prompt in ("Hello there", "A much longer prompt that runs past the sliding window of eight tokens"):
        ids = llm.tokenizer.encode(prompt)
        ours = _greedy(llm, ids, 40)
        out = hf.generate(  # type: ignore[attr-defined]
            torch.tensor([ids]),
            do_sample=False,
            max_new_tokens=40,
            min_new_tokens=40,
            eos_token_id=None,
            pad_token_id=0,
        )
        ref = out[0, len(ids) :].tolist()
        first_diff = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), None)
        print(f"\n{arch} greedy {len(ours)} tokens vs transformers: first difference at {first_diff}")
        assert ours == ref


@pytest.mark.parametrize("batch", [1, 2])
def test_cached_decode_equals_full_forward(
    arch: str, batch: int, tiny_ckpt_factory: Callable[..., Path], our_model_factory: Callable[..., DecoderLM]
) -> None:
    """Prefill + one-token steps give the no-cache logits at every position (ring buffers wrap)."""
    model = our_model_factory(tiny_ckpt_factory(arch))
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 260, (batch, 30), generator=gen)
    prompt = 5
    with torch.no_grad():
        full = model(ids)
        cache = model.make_cache(batch, ids.shape[1])
        steps = [model(ids[:, :prompt], cache)]
        for t in range(prompt, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], cache))
    cached = torch.cat(steps, dim=1)
    err = (cached - full).abs().max().item()
    print(f"\n{arch} batch={batch} cached decode vs full forward: max abs error {err:.3e} over 25 steps")
    assert err <= 1e-4


def test_chunked_prefill_equals_full_forward(
    arch: str, tiny_ckpt_factory: Callable[..., Path], our_model_factory: Callable[..., DecoderLM]
) -> None:
    """Multi-token steps on a warm cache (ring wraps inside a chunk) match the full forward."""
    model = our_model_factory(tiny_ckpt_factory(arch))
    ids = torch.randint(0, 260, (1, 33), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids)
        cache = model.make_cache(1, 33)
        parts = [model(ids[:, a:b], cache) for a, b in ((0, 3), (3, 14), (14, 15), (15, 33))]
    err = (torch.cat(parts, dim=1) - full).abs().max().item()
    print(f"\n{arch} chunked prefill vs full forward: max abs error {err:.3e}")
    assert err <= 1e-4


def test_batched_generation_equals_single(arch: str, tiny_ckpt_factory: Callable[..., Path]) -> None:
    """In the deterministic mode a batched prompt's tokens are the prompt's alone (docs/numerics.md)."""
    llm = infer.load(tiny_ckpt_factory(arch), dtype=torch.float32, deterministic=True)
    prompts = ["Hi", "The quick brown fox jumps over", "Sixteen chars..!"]
    batched = llm.generate(prompts, max_new_tokens=24)
    for p, b in zip(prompts, batched, strict=True):
        single = llm.generate(p, max_new_tokens=24)
        assert b.token_ids == single.token_ids, p
        assert b.text == single.text
        assert b.prompt_tokens == len(llm.tokenizer.encode(p))


def test_sampling_is_reproducible_with_seed(llm_factory: Callable[[str], infer.LLM]) -> None:
    llm = llm_factory("llama")
    a = llm.generate("Hello", max_new_tokens=20, temperature=1.0, seed=123)
    b = llm.generate("Hello", max_new_tokens=20, temperature=1.0, seed=123)
    c = llm.generate("Hello", max_new_tokens=20, temperature=1.0, seed=7)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_sample_filters() -> None:
    from infer.sampling import gumbel_noise, sample, sampling_inputs

    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)

    def draw(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
        mode, values = sampling_inputs([params] * logits.shape[0], logits.device)
        noise = None if gen is None else gumbel_noise(logits.shape[0], logits.shape[1], gen, logits.device)
        return sample(logits, mode, values, noise)

    top1 = draw(logits, SamplingParams(temperature=1.0, top_k=1), gen)
    assert set(top1.tolist()) == {3}
    top2 = draw(logits, SamplingParams(temperature=1.0, top_k=2), gen)
    assert set(top2.tolist()) == {2, 3}
    # softmax([0,1,2,3]) = [.032, .087, .237, .644]: top_p=0.7 keeps {3, 2}; top_p=0.5 keeps {3}
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.7), gen).tolist()) == {2, 3}
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.5), gen).tolist()) == {3}
    full = draw(logits, SamplingParams(temperature=1.0), gen)
    assert set(full.tolist()) == {0, 1, 2, 3}
    assert draw(logits[:1], SamplingParams(), None).tolist() == [3]
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_stops_on_any_eos_id(llm_factory: Callable[[str], infer.LLM]) -> None:
    llm = llm_factory("qwen3")
    ids = llm.tokenizer.encode("Hello")
    free = _greedy(llm, ids, 12)
    assert not set(free[:4]) & set(llm.eos_ids)
    # Declare the 4th generated token an EOS id (the last of a list): generation must stop there.
    config = dataclasses.replace(llm.config, eos_token_id=[999_999, free[3]])
    other = infer.LLM(config, llm.tokenizer, llm.model, llm.source, llm.execution)
    assert other.eos_ids == [257, 258, 999_999, free[3]]
    got = other.generate(ids, max_new_tokens=12)
    assert got.token_ids == free[: free.index(free[3]) + 1]
    assert got.finish_reason == "eos"
    assert llm.tokenizer.eos_token_ids == [257, 258]  # both from generation_config.json


def test_stop_strings(llm_factory: Callable[[str], infer.LLM]) -> None:
    llm = llm_factory("llama")
    free = llm.generate("Hello", max_new_tokens=20)
    assert len(free.text) > 4
    stop = free.text[2:4]
    cut = llm.generate("Hello", max_new_tokens=20, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    streamed = "".join(llm.stream("Hello", max_new_tokens=20, stop=stop))
    assert streamed == cut.text


def test_stream_concatenates_to_generate(arch: str, llm_factory: Callable[[str], infer.LLM]) -> None:
    llm = llm_factory(arch)
    pieces = list(llm.stream("Once upon", max_new_tokens=30))
    assert "".join(pieces) == llm.generate("Once upon", max_new_tokens=30).text
    assert (
        all("\ufffd" not in p for p in pieces)
        or "\ufffd" in llm.generate("Once upon", max_new_tokens=30).text
    )


def test_stream_never_splits_utf8(llm_factory: Callable[[str], infer.LLM]) -> None:
    """Multi-byte characters span several byte tokens: pieces must hold whole characters only."""
    from infer.text.stream import TextStream

    llm = llm_factory("llama")
    text = "naïve café — 日本語 🙂!"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # byte-level: some characters take several tokens
    out = TextStream(llm.tokenizer)
    pieces = [out.push(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_chat_applies_template(llm_factory: Callable[[str], infer.LLM]) -> None:
    llm = llm_factory("gemma3")
    messages = [{"role": "user", "content": "Hi"}]
    ids = llm.chat_prompt(messages)
    assert llm.tokenizer.decode(ids, skip_special_tokens=False) == "<|begin|><|user|>Hi<|eot|><|assistant|>"
    assert llm.tokenizer.bos_token_id is not None
    assert ids.count(llm.tokenizer.bos_token_id) == 1
    reply = llm.chat(messages, max_new_tokens=8)
    assert reply.token_ids == llm.generate(ids, max_new_tokens=8).token_ids


def test_generate_accepts_token_ids_and_lists(llm_factory: Callable[[str], infer.LLM]) -> None:
    llm = llm_factory("llama")
    ids = llm.tokenizer.encode("Hello")
    by_text = llm.generate("Hello", max_new_tokens=8)
    by_ids = llm.generate(ids, max_new_tokens=8)
    assert by_text.token_ids == by_ids.token_ids
    assert [r.token_ids for r in llm.generate([ids, ids], max_new_tokens=8)] == [by_ids.token_ids] * 2
    assert len(by_text.token_ids) <= 8
    assert llm.model(torch.tensor([ids])).shape == (1, len(ids), llm.config.vocab_size)
