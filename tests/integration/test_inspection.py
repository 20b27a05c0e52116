"""Inspection against transformers on the same tiny checkpoints, float32, every architecture.

``llm.model(ids, output_hidden_states=True, output_attentions=True)`` against transformers'
``output_hidden_states`` / ``output_attentions`` (eager attention); `LLM.score` against
transformers' log-softmax; `LLM.logit_lens` against transformers' final norm and head applied to
its hidden states. Errors are printed; the bound is the parity suite's float32 one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import infer
from infer.models.record import CausalLMOutput
from infer.testing import ARCHITECTURES

pytestmark = pytest.mark.slow  # parity with transformers, as tests/integration/test_models.py

TOL = 1e-4  # test_models.py's float32 logit bound; hidden states and probabilities are smaller
IDS = torch.randint(0, 260, (2, 40), generator=torch.Generator().manual_seed(1))  # past Gemma's window of 8


@pytest.fixture
def pair(
    tiny_ckpt_factory: Callable[..., Path], hf_model_factory: Callable[..., Any], arch: str
) -> tuple[infer.LLM, Any]:
    path = tiny_ckpt_factory(arch)
    return infer.load(path, dtype=torch.float32), hf_model_factory(path)


def _max_err(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...]) -> float:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape, (a.shape, b.shape)
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hidden_states_attentions_and_logits_match_transformers(
    pair: tuple[infer.LLM, Any], arch: str
) -> None:
    llm, hf = pair
    with torch.no_grad():
        want = hf(IDS, output_hidden_states=True, output_attentions=True)
        got = llm.model(IDS, output_hidden_states=True, output_attentions=True)
    assert isinstance(got, CausalLMOutput) and got.hidden_states is not None and got.attentions is not None
    L, H = llm.config.num_hidden_layers, llm.config.num_attention_heads
    assert len(got.hidden_states) == L + 1 and len(got.attentions) == L
    assert got.attentions[0].shape == (2, H, 40, 40)
    hs = _max_err(got.hidden_states, want.hidden_states)
    att = _max_err(got.attentions, want.attentions)
    logits = float((got.logits - want.logits).abs().max())
    print(
        f"\n{arch}: max abs error vs transformers: hidden states {hs:.2e}, "
        f"attentions {att:.2e}, logits {logits:.2e}"
    )
    assert hs <= TOL and att <= TOL and logits <= TOL
    assert got["logits"] is got.logits and got[0] is got.logits and len(got.to_tuple()) == 3


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_only_what_is_asked_is_recorded(pair: tuple[infer.LLM, Any], arch: str) -> None:
    """Hidden states alone run the default attention (the plain forward's logits, bitwise) and keep
    no probabilities; the plain call still returns the logits tensor; a cache is refused."""
    llm, _ = pair
    with torch.no_grad():
        plain = llm.model(IDS)
        states = llm.model(IDS, output_hidden_states=True)
        probs = llm.model(IDS, output_attentions=True)
    assert isinstance(plain, torch.Tensor)
    assert states.attentions is None and probs.hidden_states is None
    assert torch.equal(states.logits, plain)
    err = float((probs.logits - plain).abs().max())
    print(f"\n{arch}: logits with the eager attention path vs the default {err:.2e}")
    assert err <= TOL
    with pytest.raises(ValueError, match="pass no cache"):
        llm.model(IDS, llm.model.make_cache(2, 64), output_hidden_states=True)


def _hf_head(hf: Any, arch: str, h: torch.Tensor, normed: bool) -> torch.Tensor:
    """transformers' final norm (unless ``normed``), head and soft-capping on hidden states ``h``."""
    stack = hf.transformer if arch == "gpt2" else hf.model
    x = h if normed else (stack.ln_f if arch == "gpt2" else stack.norm)(h)
    logits: torch.Tensor = hf.lm_head(x)
    cap = getattr(hf.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_scores_and_logit_lens_match_transformers(pair: tuple[infer.LLM, Any], arch: str) -> None:
    llm, hf = pair
    texts = [IDS[0, :40].tolist(), IDS[1, :23].tolist(), IDS[1, 5:9].tolist()]  # one batch, padded
    got = llm.score(texts, top_k=4)
    assert isinstance(got, list) and len(got) == 3
    err_lp = err_top = 0.0
    with torch.no_grad():
        for ids, s in zip(texts, got, strict=True):
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)  # [n - 1, V]
            want = lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            top = lp.topk(4, dim=-1)
            err_lp = max(err_lp, float((s.logprobs - want).abs().max()))
            err_top = max(err_top, float((s.top_logprobs - top.values).abs().max()))
            assert s.token_ids == ids and s.logprobs.shape == (len(ids) - 1,)
            # the top ids agree wherever transformers' own top-4 is not tied within the error
            gaps = (top.values[:, :-1] - top.values[:, 1:]).abs().min(dim=-1).values
            assert torch.equal(s.top_ids[gaps > 1e-4], top.indices[gaps > 1e-4])
        lens = llm.logit_lens(texts[1], positions=[0, 7, -1])
        states = hf(torch.tensor([texts[1]]), output_hidden_states=True).hidden_states
        L = len(states) - 1
        want_lens = torch.stack(
            [_hf_head(hf, arch, states[i][0, [0, 7, 22]], normed=i == L) for i in range(L + 1)]
        )
    err_lens = float((lens.logits - want_lens).abs().max())
    print(
        f"\n{arch}: scores vs transformers: logprobs {err_lp:.2e}, top-4 {err_top:.2e}; "
        f"logit lens {err_lens:.2e}"
    )
    assert lens.positions == [0, 7, 22] and lens.logits.shape == (L + 1, 3, llm.model.vocab_size)
    assert err_lp <= TOL and err_top <= TOL and err_lens <= TOL
    single = llm.score(texts[1], top_k=4)
    assert not isinstance(single, list)
    assert torch.allclose(single.logprobs, got[1].logprobs, atol=TOL)  # alone = in a padded batch


@pytest.mark.parametrize("arch", ["llama"])
def test_left_padding_is_inspected_as_the_rows_alone(pair: tuple[infer.LLM, Any], arch: str) -> None:
    """A left-padded row's attentions and hidden states are its own (unpadded) ones, shifted; a pad
    position's query sees no real token (the model's mask lets it see itself only)."""
    llm, _ = pair
    pad = 5
    ids = torch.cat([torch.zeros(1, pad, dtype=torch.long), IDS[:1]], dim=1)
    mask = torch.cat([torch.zeros(1, pad), torch.ones(1, IDS.shape[1])], dim=1)
    with torch.no_grad():
        alone = llm.model(IDS[:1], output_hidden_states=True, output_attentions=True)
        padded = llm.model(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    att = max(
        float((p[..., pad:, pad:] - a).abs().max())
        for p, a in zip(padded.attentions, alone.attentions, strict=True)
    )
    hs = max(
        float((p[:, pad:] - a).abs().max())
        for p, a in zip(padded.hidden_states, alone.hidden_states, strict=True)
    )
    print(f"\nleft padding {pad}: attentions {att:.2e}, hidden states {hs:.2e} from the row alone")
    assert att <= TOL and hs <= TOL
    assert all(
        torch.equal(p[..., :pad, pad:], torch.zeros_like(p[..., :pad, pad:])) for p in padded.attentions
    )
    assert all(bool(p.isfinite().all()) for p in padded.attentions)
