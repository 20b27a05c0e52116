"""In the deterministic mode a prompt's outputs do not depend on what else is in its batch
or on how its prompt is chunked, on every load path.

Each prompt is generated through the engine alone and inside batches of different sizes and
orders (so with a different batch size, longest prompt, prefill forward and KV capacity), and
prefilled in chunks; the logits of every step (those the engine sampled from:
`infer.testing.trace`) must be *bitwise* equal, which the greedy tokens then are too. This
holds by construction (docs/numerics.md): a row's keys sit at its own slots from slot 0 in any
batch, and every product — weights and attention alike — is a tile of one fixed shape
(`infer.host.rows`, `infer.models.attend.attend_tiled`), whatever the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import infer
from infer.engine import SamplingParams
from infer.gguf.writer import write_gguf
from infer.models.base import DecoderLM
from infer.realmodels import smollm2_path
from infer.testing import build_tokenizer, tiny_hf_model
from infer.testing.trace import trace

LENGTHS = [5, 17, 1, 9, 40]  # one prompt longer than the tiny Gemma's window (8): its rings wrap
STEPS = 12


def prompts(vocab: int, lengths: list[int] = LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, min(vocab, 256), (n,), generator=gen).tolist() for n in lengths]


def step_logits(llm: infer.LLM, batch: list[list[int]]) -> torch.Tensor:
    """``[B, STEPS, V]``: the logits of every greedy step of ``batch`` submitted together to the engine."""
    traced = trace(llm, batch, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    assert all(t.tokens == t.logits.argmax(-1).tolist() for t in traced)  # each step's greedy token
    return torch.stack([t.logits for t in traced])


def assert_batch_invariant(llm: infer.LLM, label: str) -> None:
    model = llm.model
    ps = prompts(model.config.vocab_size)
    alone = [step_logits(llm, [p])[0] for p in ps]
    orders = {"all": list(range(len(ps))), "reversed": list(range(len(ps)))[::-1], "pair": [3, 1]}
    for name, order in orders.items():
        together = step_logits(llm, [ps[i] for i in order])
        for row, i in enumerate(order):
            diff = (together[row] - alone[i]).abs().max().item()
            assert torch.equal(together[row], alone[i]), (
                f"{label}: prompt {i} in batch {name!r} differs by {diff}"
            )
    for i, p in enumerate(ps):  # the same prompt prefilled in chunks: the logits of its next token
        whole = prefill_logits(model, p, len(p))
        for chunk in (1, 3, 16):
            part = prefill_logits(model, p, chunk)
            diff = (part - whole).abs().max().item()
            assert torch.equal(part, whole), f"{label}: prompt {i} in chunks of {chunk} differs by {diff}"
    tokens = [a.argmax(-1).tolist() for a in alone]
    print(
        f"{label}: {len(ps)} prompts x {STEPS} steps bitwise equal alone, in 3 batches and prefilled in "
        f"chunks of 1, 3, 16; tokens {tokens[0]}"
    )


@torch.inference_mode()
def prefill_logits(model: DecoderLM, prompt: list[int], chunk: int) -> torch.Tensor:
    """The logits after ``prompt``, fed to a fresh cache ``chunk`` tokens at a time: ``[V]``."""
    cache = model.make_cache(1, len(prompt) + 8)
    ids = torch.tensor([prompt])
    h = torch.empty(0)
    for start in range(0, len(prompt), chunk):
        h = model.forward_hidden(ids[:, start : start + chunk], cache)
    return model.head(h[:, -1:])[0, 0].float()


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [
        ("llama", torch.float32),
        ("qwen3", torch.float32),
        ("gemma3", torch.float32),
        ("gemma3", torch.bfloat16),
    ],
)
def test_safetensors_float(arch: str, dtype: torch.dtype, tiny_ckpt_factory: Callable[..., Path]) -> None:
    llm = infer.load(tiny_ckpt_factory(arch), dtype=dtype, deterministic=True)
    assert_batch_invariant(llm, f"{arch} {dtype}")


@pytest.mark.parametrize("quantize", ["q4_0", "int8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_quantize_at_load(arch: str, quantize: str, tiny_ckpt_factory: Callable[..., Path]) -> None:
    llm = infer.load(tiny_ckpt_factory(arch), quantize=quantize, deterministic=True)
    assert_batch_invariant(llm, f"{arch} quantize={quantize}")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q5_0"])
def test_gguf_packed(qtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Default GGUF dtype (bfloat16 packed products); Q8_0's tied head takes the greedy high-plane scan."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    hf = tiny_hf_model("gemma3", query_pre_attn_scalar=32, final_logit_softcapping=None)
    path = write_gguf(tmp_path / f"gemma3-{qtype}.gguf", hf, build_tokenizer(tmp_path / "tok"), qtype=qtype)
    llm = infer.load(path, deterministic=True)
    assert_batch_invariant(llm, f"gemma3 GGUF {qtype}")


@pytest.mark.slow
@pytest.mark.realmodel
def test_smollm2_real() -> None:
    """The real SmolLM2-135M Q4_1 at its default dtype (before: token 23 differed in a batch)."""
    llm = infer.load(smollm2_path(), deterministic=True)
    ps = [
        llm.tokenizer.encode(t) for t in ("The capital of France is", "Once upon a time, in a small village")
    ]
    ps.append(llm.chat_prompt([{"role": "user", "content": "Write a haiku about the sea."}]))
    alone = [llm.generate(p, max_new_tokens=40).token_ids for p in ps]
    together = llm.generate(ps, max_new_tokens=40)
    assert [r.token_ids for r in together] == alone
    reversed_ = llm.generate(ps[::-1], max_new_tokens=40)
    assert [r.token_ids for r in reversed_] == alone[::-1]
    assert_batch_invariant(llm, "SmolLM2 Q4_1")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_scores_in_a_batch_are_bitwise_the_text_alone(
    arch: str, tiny_ckpt_factory: Callable[..., Path]
) -> None:
    """`LLM.score` of a text beside longer ones (right-padded, one forward) is bitwise the text alone
    (left padding shifted its keys within the attention tiles: 1.9e-6 apart)."""
    llm = infer.load(tiny_ckpt_factory(arch), dtype=torch.float32, deterministic=True)
    short, long = prompts(llm.config.vocab_size, [9, 40])
    alone = llm.score(short)
    for batch, row in (([short, long], 0), ([long, short], 1)):
        together = llm.score(batch, batch_size=2)
        assert isinstance(together, list) and not isinstance(alone, list)
        diff = (together[row].logprobs - alone.logprobs).abs().max().item()
        print(f"{arch}: text of 9 tokens at row {row} beside 40: largest logprob difference {diff}")
        assert torch.equal(together[row].logprobs, alone.logprobs)
        assert torch.equal(together[row].top_logprobs, alone.top_logprobs)
