"""The resident models on CUDA: parity with transformers on the GPU, cached decode, greedy generation.

Marked ``gpu``; they skip on machines without CUDA (CI has none). Run them on a GPU
machine with ``PYTHONPATH=src python3 -m pytest -m gpu tests/gpu -q -s``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import infer
from infer.engine import SamplingParams
from infer.testing.trace import trace

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def test_cuda_logits_match_transformers(arch: str, tiny_ckpt_factory: Callable[..., Path]) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_ckpt_factory(arch)
    ids = torch.randint(0, 260, (2, 40), generator=torch.Generator().manual_seed(1)).cuda()
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, None)):
        llm = infer.load(path, device="cuda", dtype=dtype)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").cuda().eval()  # type: ignore[call-arg]
        with torch.no_grad():
            ref = hf(ids).logits.float()
            got = llm.model(ids).float()
        err = (got - ref).abs().max().item()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"\n{arch} cuda {dtype}: max abs logit error {err:.3e}, top-1 agreement {agree:.2%}")
        if tol is not None:
            assert err <= tol
        assert agree >= 0.99


def test_cuda_cached_decode_and_greedy(arch: str, tiny_ckpt_factory: Callable[..., Path]) -> None:
    path = tiny_ckpt_factory(arch)
    llm = infer.load(path, device="cuda", dtype=torch.float32)
    cpu = infer.load(path, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, 260, (2, 30), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        full = llm.model(ids)
        cache = llm.model.make_cache(2, 30)
        steps = [llm.model(ids[:, :4], cache)] + [llm.model(ids[:, t : t + 1], cache) for t in range(4, 30)]
    err = (torch.cat(steps, 1) - full).abs().max().item()
    print(f"\n{arch} cuda cached decode vs full forward: {err:.3e}")
    assert err <= 1e-4
    prompt = llm.tokenizer.encode("Hello there, general")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    on_gpu = trace(llm, [prompt], params)[0].tokens  # through the engine, past any EOS id
    on_cpu = trace(cpu, [prompt], params)[0].tokens
    assert len(on_gpu) == 32 and on_gpu == on_cpu
    batch = llm.generate(["Hi", "A longer prompt here"], max_new_tokens=16)
    assert [b.token_ids for b in batch] == [
        llm.generate(p, max_new_tokens=16).token_ids for p in ["Hi", "A longer prompt here"]
    ]


def test_cuda_engine_compiled_and_deterministic(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """The engine on CUDA: the compiled step gives the eager step's greedy tokens, and the
    deterministic mode keeps a row's logits bitwise whatever else is in its batch."""
    path = tiny_ckpt_factory("llama")
    prompts = ["Hi", "A longer prompt here", "x y z w v"]
    eager = infer.load(path, device="cuda", dtype=torch.float32)
    ref = [eager.generate(p, max_new_tokens=16).token_ids for p in prompts]
    compiled = infer.load(path, device="cuda", dtype=torch.float32, compile=True)
    got = [r.token_ids for r in compiled.generate(prompts, max_new_tokens=16)]
    same = sum(a == b for a, b in zip(got, ref, strict=True))
    print(f"\ncompiled vs eager greedy tokens on cuda: {same}/{len(ref)} prompts equal")
    assert got == ref

    det = infer.load(path, device="cuda", dtype=torch.float32, deterministic=True)
    ids = torch.randint(0, 260, (5, 24), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        together = det.model(ids)
        alone = torch.cat([det.model(ids[i : i + 1]) for i in range(5)])
    diff = (together - alone).abs().max().item()
    print(f"deterministic on cuda: batch of 5 vs rows alone, max abs logit difference {diff:.3e}")
    assert torch.equal(together, alone)
    batch = [r.token_ids for r in det.generate(prompts, max_new_tokens=16)]
    assert batch == [det.generate(p, max_new_tokens=16).token_ids for p in prompts]


def test_cuda_default_and_auto_run_eagerly(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """Ahead-of-time packages are CPU-only (`infer.aot`): on CUDA the default and ``"auto"``
    step eagerly (no package cache) and give the eager tokens."""
    path = tiny_ckpt_factory("llama")
    eager = infer.load(path, device="cuda", dtype=torch.float32, compile=False)
    want = eager.generate("Hi", max_new_tokens=24).token_ids
    for llm in (infer.load(path, device="cuda", dtype=torch.float32),
                infer.load(path, device="cuda", dtype=torch.float32, compile="auto")):  # fmt: skip
        assert llm.execution.packages is None
        assert llm.generate("Hi", max_new_tokens=24).token_ids == want
