"""``compile=True`` on prompts of every length a model accepts: chunks through both product routes.

A prompt longer than the packed kernel's rows (`infer.quant.linear.KERNEL_MAX_ROWS`) multiplies
dequantized tiles, whose dtype depends on the CPU (`native_bf16_gemm`); a compiled block must not
ask the CPU (dynamo refuses torch's CPU queries inside a nested compile region): the answer is read
once, at import. Prompts of 8, 200 and 2,000 tokens take the kernel (8 rows), the tiles (a chunk past
the bound), and several chunks with a long KV; then decode steps, and verify passes (``lookup``, run
eagerly beside the compiled steps). In float32 the compiled tokens equal the eager ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import infer
from infer.gguf.writer import write_gguf
from infer.realmodels import smollm2_path
from infer.testing import build_tokenizer, tiny_hf_model

pytestmark = pytest.mark.slow

LENGTHS = (8, 200, 2000)
NEW_TOKENS = 6


def prompt(length: int, vocab: int) -> list[int]:
    """``length`` token ids in [3, vocab), every id of that range once a period (lookup finds
    the model's last token in it)."""
    return [3 + (i * 7919) % (vocab - 3) for i in range(length)]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama as a Q4_0 GGUF (int4 kernel), with room for the longest prompt."""
    tmp = tmp_path_factory.mktemp("compiled-prompts")
    hf: Any = tiny_hf_model("llama", max_position_embeddings=4096)
    return write_gguf(tmp / "llama-q4_0.gguf", hf, build_tokenizer(tmp / "tok"), qtype="Q4_0")


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["default", "bfloat16"])
def test_compiled_gguf_generates_every_prompt_length(tiny_gguf: Path, dtype: torch.dtype | None) -> None:
    """bfloat16 products (the default for GGUF): the tiles' dtype is chosen by the CPU's arithmetic."""
    llm = infer.load(tiny_gguf, dtype=dtype, compile=True)
    assert llm.compiled
    vocab = llm.config.vocab_size
    for n in LENGTHS:
        got = llm.generate(prompt(n, vocab), max_new_tokens=NEW_TOKENS)
        print(f"{n} tokens: {got.token_ids}")
        assert 0 < len(got.token_ids) <= NEW_TOKENS


def test_compiled_gguf_float32_gives_eager_tokens(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32: compiled steps (and eager verify passes beside them, each proposing all it can)
    give the eager greedy tokens."""
    from infer.speculative import Speculator

    def every_proposal(self: Any, rows: Any, proposals: Any, drafting: Any, *_: Any) -> int:
        return 1 + max((len(p.tokens) for p in proposals.values()), default=0)

    monkeypatch.setattr(Speculator, "plan", every_proposal)
    eager = infer.load(tiny_gguf, dtype=torch.float32, compile=False)
    compiled = infer.load(tiny_gguf, dtype=torch.float32, compile=True)
    looked_up = infer.load(tiny_gguf, dtype=torch.float32, compile=True, lookup=3)
    vocab = eager.config.vocab_size
    for n in LENGTHS:
        ids = prompt(n, vocab)
        want = eager.generate(ids, max_new_tokens=NEW_TOKENS).token_ids
        got = compiled.generate(ids, max_new_tokens=NEW_TOKENS).token_ids
        spec = looked_up.generate(ids, max_new_tokens=NEW_TOKENS).token_ids
        print(f"{n} tokens: eager {want}, compiled {got}, compiled + lookup {spec}")
        assert got == want, n
        assert spec == want, n
    passes = looked_up.engine.stats()["spec_passes"]
    print(f"lookup: {passes} verify passes")
    assert passes > 0


@pytest.mark.realmodel
def test_compiled_smollm2_generates_every_prompt_length() -> None:
    """The shipped SmolLM2 (Q4_1 GGUF), default mode: ``compile=True`` generates from each prompt."""
    llm = infer.load(smollm2_path(), compile=True)
    vocab = llm.config.vocab_size
    for n in LENGTHS:
        got = llm.generate(prompt(n, vocab), max_new_tokens=NEW_TOKENS)
        print(f"{n} tokens: {got.text!r}")
        assert 0 < len(got.token_ids) <= NEW_TOKENS
