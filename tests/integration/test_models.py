"""Full-model logits vs transformers on the same tiny checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # parity with transformers: `pytest tests/integration/ -m slow` runs it

SEQ = 40  # longer than the tiny Gemma 3 sliding window (8)


def _random_ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 260, (batch, seq), generator=gen)


@pytest.mark.parametrize("sharded", [False, True])
def test_logits_match_transformers_fp32(
    arch: str,
    sharded: bool,
    tiny_ckpt_factory: Callable[..., Path],
    hf_model_factory: Callable[..., object],
    our_model_factory: Callable[..., torch.nn.Module],
) -> None:
    path = tiny_ckpt_factory(arch, sharded=sharded)
    hf = hf_model_factory(path, dtype=torch.float32)
    ours = our_model_factory(path, dtype=torch.float32)
    ids = _random_ids(2, SEQ, seed=1)
    with torch.no_grad():
        ref = hf(ids).logits  # type: ignore[operator]
        got = ours(ids)
    err = (got - ref).abs().max().item()
    print(f"\n{arch} sharded={sharded} fp32 full-model max abs logit error {err:.3e}")
    assert got.shape == (2, SEQ, ref.shape[-1])
    assert got.dtype == torch.float32
    assert err <= 1e-4


def test_logits_match_transformers_bf16(
    arch: str, tiny_ckpt_factory: Callable[..., Path], our_model_factory: Callable[..., torch.nn.Module]
) -> None:
    """bf16, measured against the float32 model: as close as transformers' own bf16 (SDPA) path.

    Our attention reduces in float32 chunks, not with bf16 SDPA kernels, so the two bf16
    paths round differently and flip different near-tied positions of these tiny random
    models. What must hold: an error like transformers' bf16, and top-1 flips only where
    the float32 top-2 margin is within the bf16 error.
    """
    from transformers import AutoModelForCausalLM

    path = tiny_ckpt_factory(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()  # type: ignore[no-untyped-call]
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    ours = our_model_factory(path, dtype=torch.bfloat16)
    ids = _random_ids(4, SEQ, seed=2)
    with torch.no_grad():
        exact = hf32(ids).logits
        ref = hf(ids).logits.float()
        got = ours(ids).float()

    def agree(x: torch.Tensor) -> float:
        return float((x.argmax(-1) == exact.argmax(-1)).float().mean().item())

    err, ref_err = (got - exact).abs().max().item(), (ref - exact).abs().max().item()
    top2 = exact.topk(2, dim=-1).values
    flipped = got.argmax(-1) != exact.argmax(-1)
    margins = (top2[..., 0] - top2[..., 1])[flipped]
    print(
        f"\n{arch} bf16 vs float32 over {ids.numel()} positions: ours max error {err:.3e}, top-1 "
        f"{agree(got):.2%} (flipped margins {[round(m, 3) for m in margins.tolist()]}); "
        f"transformers bf16 {ref_err:.3e}, {agree(ref):.2%}"
    )
    assert err <= 1.5 * ref_err
    assert (margins <= 2 * err).all()


def test_left_padded_batch_matches_unpadded(
    arch: str, tiny_ckpt_factory: Callable[..., Path], our_model_factory: Callable[..., torch.nn.Module]
) -> None:
    """A left-padded row gives the same logits as the same tokens alone (attention_mask path)."""
    ours = our_model_factory(tiny_ckpt_factory(arch))
    ids = _random_ids(1, 20, seed=3)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 20, dtype=torch.long)], dim=1)
    with torch.no_grad():
        alone = ours(ids)
        batched = ours(padded, attention_mask=mask)[:, 5:]
    err = (alone - batched).abs().max().item()
    print(f"\n{arch} left padding vs alone: max abs error {err:.3e}")
    assert err <= 1e-4


def test_tied_head_reuses_embedding(
    tiny_ckpt_factory: Callable[..., Path], our_model_factory: Callable[..., torch.nn.Module]
) -> None:
    tied = our_model_factory(tiny_ckpt_factory("qwen3"))
    untied = our_model_factory(tiny_ckpt_factory("llama"))
    assert tied.lm_head.weight is tied.embed_tokens.weight  # type: ignore[union-attr]
    assert untied.lm_head.weight is not untied.embed_tokens.weight  # type: ignore[union-attr]
    assert not torch.equal(untied.lm_head.weight, untied.embed_tokens.weight)  # type: ignore[union-attr, arg-type]
