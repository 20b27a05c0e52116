"""Interventions and forward hooks are honoured by generation, never silently skipped.

Generation's decode steps run ahead-of-time compiled packages by default (`infer.aot`), which run
no Python hook. Here the execution is given stand-in packages that run the step on a copy of the
model without hooks — exactly what a real package does with a hook — so a step that wrongly takes a
package gives the unhooked tokens. Each test compares greedy generation with an eager loop (the
model called step by step with a KV cache, the hooks running) applying the same edit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import infer
from infer.execution import Execution, StepFeed, StepOutput, model_step
from infer.interventions import Intervention
from infer.kv.cache import KVCache
from infer.models.base import DecoderLM
from infer.models.projections import Fusable
from infer.sampling import Sampling

PROMPT = [5, 9, 200, 31, 7, 64, 12]
N = 20


class StandInPackages:
    """`infer.execution.Packages` whose steps run on an unhooked copy of the model (as a compiled package
    runs its traced code, not the modules' hooks); ``calls`` counts the steps it ran."""

    enabled = True

    def __init__(self, model: DecoderLM) -> None:
        self.copy = copy.deepcopy(model)
        self.calls = 0

    def get(
        self, cache: KVCache, batch: int, mode: Sampling, width: int = 1
    ) -> Callable[[KVCache, StepFeed], StepOutput]:
        def run(cache: KVCache, feed: StepFeed) -> StepOutput:
            self.calls += 1
            return StepOutput(*model_step(self.copy, cache, feed))

        return run


@pytest.fixture
def llm(tiny_ckpt_factory: Callable[..., Path]) -> Iterator[infer.LLM]:
    """The tiny Llama, float32, its decode steps from stand-in packages."""
    loaded = infer.load(tiny_ckpt_factory("llama"), dtype=torch.float32, compile=False)
    loaded.execution = Execution(loaded.model, compile="auto", packages=StandInPackages(loaded.model))
    yield loaded
    if loaded._engine is not None:
        loaded.engine.close()


def _packages(llm: infer.LLM) -> StandInPackages:
    packages = llm.execution.packages
    assert isinstance(packages, StandInPackages)
    return packages


@torch.inference_mode()
def eager_greedy(llm: infer.LLM, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from the model called step by step on a KV cache (hooks run), to EOS or ``n``."""
    model, eos = llm.model, set(llm.eos_ids)
    cache = model.make_cache(1, len(prompt) + n)
    logits = model(torch.tensor([prompt]), cache=cache)
    out: list[int] = []
    while len(out) < n:
        out.append(int(logits[0, -1].argmax()))
        if out[-1] in eos or len(out) == n:
            break
        logits = model(torch.tensor([[out[-1]]]), cache=cache)
    return out


def _steering(llm: infer.LLM) -> torch.Tensor:
    return 6.0 * torch.randn(llm.config.hidden_size, generator=torch.Generator().manual_seed(3))


def test_a_steering_vector_changes_generation_as_in_the_eager_loop(llm: infer.LLM) -> None:
    plain = llm.generate(PROMPT, N).token_ids
    assert _packages(llm).calls > 0  # unhooked decode steps take the (stand-in) packages
    assert plain == eager_greedy(llm, PROMPT, N)
    calls = _packages(llm).calls
    with llm.intervene(layer=1, add=_steering(llm)) as steering:
        want = eager_greedy(llm, PROMPT, N)
        got = llm.generate(PROMPT, N).token_ids  # the same prompt: its kept K/V must not be reused
        streamed = "".join(llm.stream(PROMPT, N))
    print(f"\nunsteered {plain}\nsteered   {got}\neager     {want}")
    assert want != plain  # the vector matters
    assert got == want
    assert streamed == llm.tokenizer.decode(want)
    assert _packages(llm).calls == calls  # no package ran while the hook was on
    assert not steering.active and not llm.model.hooks.active()
    assert llm.generate(PROMPT, N).token_ids == plain  # the steered K/V are not reused either
    assert _packages(llm).calls > calls


def test_a_users_own_hook_runs_in_generation(llm: infer.LLM) -> None:
    vector = _steering(llm)
    seen: list[tuple[int, ...]] = []

    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(out.shape))
        return out + vector

    handle = llm.model.layers[2].register_forward_hook(hook)
    try:
        want = eager_greedy(llm, PROMPT, N)
        seen.clear()
        got = llm.generate(PROMPT, N).token_ids
    finally:
        handle.remove()
    assert got == want
    assert len(seen) == len(got)  # the prefill and every decode step ran it
    assert _packages(llm).calls == 0


def test_a_hook_on_a_fused_projection_runs(llm: infer.LLM) -> None:
    """q/k/v run as one fused product: a hook on ``q_proj`` unfuses its block (it runs, the block's
    values stay within rounding of the fused product's)."""
    attn = llm.model.layers[0].self_attn
    assert isinstance(attn, Fusable) and attn.fused
    calls = []

    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return out * 1.5

    handle = getattr(attn, "q_proj").register_forward_hook(hook)  # noqa: B009
    try:
        want = eager_greedy(llm, PROMPT, N)
        got = llm.generate(PROMPT, N).token_ids
    finally:
        handle.remove()
    assert not attn.fused
    assert got == want and len(calls) == 2 * len(got)  # eager loop + generation: one call a step each


def test_a_hook_on_the_model_itself_is_refused_by_generation(llm: infer.LLM) -> None:
    handle = llm.model.register_forward_hook(lambda m, a, out: out)
    try:
        with pytest.raises(
            RuntimeError, match=r"hook is registered on the model itself \(LlamaForCausalLM\)"
        ):
            llm.generate(PROMPT, 4)
    finally:
        handle.remove()
    assert llm.generate(PROMPT, 4).token_ids == eager_greedy(llm, PROMPT, 4)


def test_zeroing_a_head_matches_transformers(
    llm: infer.LLM, tiny_ckpt_factory: Callable[..., Path], hf_model_factory: Callable[..., Any]
) -> None:
    """A head's output is its slice of the attention output before ``o_proj``: zeroing head 2 of
    block 1 gives transformers' logits with that slice zeroed."""
    hf = hf_model_factory(tiny_ckpt_factory("llama"))
    hd = llm.config.computed_head_dim
    ids = torch.tensor([PROMPT * 3])

    def zero(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0].clone()
        x[..., 2 * hd : 3 * hd] = 0
        return (x,)

    handle = hf.model.layers[1].self_attn.o_proj.register_forward_pre_hook(zero)
    try:
        with torch.no_grad():
            want = hf(ids).logits
    finally:
        handle.remove()
    with torch.no_grad(), llm.intervene(layer=1, head=2, zero=True):
        got = llm.model(ids)
        plain_hf = hf(ids).logits
    err = float((got - want).abs().max())
    print(f"\nhead 2 of block 1 zeroed: max abs logit error vs transformers {err:.2e}")
    assert err <= 1e-4 and float((want - plain_hf).abs().max()) > 1e-2


def test_patching_a_cached_run(llm: infer.LLM) -> None:
    """Block 1's output replaced by another prompt's (all positions): every later logit is that
    prompt's, bitwise; at one position only: the positions before it keep their own logits."""
    a, b = torch.tensor([PROMPT]), torch.tensor([[60, 61, 62, 63, 64, 65, 66]])
    with torch.no_grad():
        src = llm.model(a, output_hidden_states=True)
        with llm.intervene(layer=1, replace=src.hidden_states[2]):
            patched = llm.model(b)
        with llm.intervene(Intervention(1, replace=src.hidden_states[2][0, 4], positions=4)):
            one = llm.model(b)
        own = llm.model(b)
    assert torch.equal(patched, src.logits)
    assert torch.equal(one[:, :4], own[:, :4]) and not torch.allclose(one[:, 4:], own[:, 4:])
    with (
        llm.intervene(layer=1, add=_steering(llm), positions=[0]),
        pytest.raises(ValueError, match="positions="),
    ):
        llm.generate(PROMPT, 2)


def test_bad_interventions_are_refused_naming_what(llm: infer.LLM) -> None:
    D = llm.config.hidden_size
    with pytest.raises(ValueError, match=r"layer must be in \[-3, 3\)"):
        llm.intervene(layer=3, zero=True)
    with pytest.raises(ValueError, match="exactly one of add=, replace=, zero=True"):
        llm.intervene(layer=0, add=torch.zeros(D), zero=True)
    with pytest.raises(ValueError, match=rf"last dimension must be {D} \(hidden_size\)"):
        llm.intervene(layer=0, add=torch.zeros(D + 1))
    with pytest.raises(ValueError, match=r"head must be in \[0, 4\)"):
        llm.intervene(layer=0, head=4, zero=True)
    with (
        pytest.raises(ValueError, match=r"does not fit the edited activations"),
        llm.intervene(layer=0, replace=torch.zeros(3, D)),
    ):
        llm.model(torch.tensor([PROMPT]))
    assert not llm.model.hooks.active()  # the failed ones left nothing behind


@pytest.mark.realmodel
def test_a_hook_on_a_packed_head_runs_in_greedy_generation() -> None:
    """SmolLM2's Q8_0 head: a greedy step scans its packed rows directly (`QuantizedLinear.greedy`),
    bypassing the module; a hooked head is called as a module instead, so its hook decides."""
    from infer.quant.linear import QuantizedLinear
    from infer.realmodels import smollm2_path

    llm = infer.load(smollm2_path(), compile=False)
    assert isinstance(llm.model.lm_head, QuantizedLinear)

    def boost(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[..., 42] += 1e4
        return out

    handle = llm.model.lm_head.register_forward_hook(boost)
    try:
        assert llm.generate("Hello", 4).token_ids == [42] * 4
    finally:
        handle.remove()
    assert llm.generate("Hello", 4).token_ids != [42] * 4


BAD_POSITIONS = [
    (1.5, TypeError, r"positions: expected an int, a slice or a non-empty list of ints \(or None\), "
                     r"got 1.5 \(float\)"),
    ("1", TypeError, r"got '1' \(str\)"),
    (True, TypeError, r"got True \(bool\)"),
    ([0, 1.0], TypeError, r"got \[0, 1.0\] \(holding 1.0, a float\)"),
    ([0, None], TypeError, r"holding None, a NoneType"),
    ({1, 2}, TypeError, r"got \{1, 2\} \(set\)"),
    ([], ValueError, r"got an empty list"),
    (slice(0, 2.5), TypeError, r"positions: expected a slice of ints, got slice\(0, 2.5, None\)"),
    (slice(None, None, 0), ValueError, r"a slice's step cannot be zero"),
    (torch.tensor([0.5]), TypeError, r"got a tensor of shape \(1,\), torch.float32"),
    (torch.zeros(2, 2, dtype=torch.long), TypeError, r"got a tensor of shape \(2, 2\)"),
]  # fmt: skip


@pytest.mark.parametrize(("positions", "error", "message"), BAD_POSITIONS, ids=lambda v: repr(v)[:24])
def test_bad_positions_are_refused_when_made(
    llm: infer.LLM, positions: Any, error: type[Exception], message: str
) -> None:
    """``positions=1.5`` used to fail inside the forward ('float' object is not iterable), and '1' to
    index the token axis as a list of characters."""
    with pytest.raises(error, match=message):
        llm.intervene(layer=0, zero=True, positions=positions)
    with pytest.raises(error, match=message):
        Intervention(0, zero=True, positions=positions)
    assert not llm.model.hooks.active()


@pytest.mark.parametrize(
    ("positions", "message"),
    [
        (10, r"positions 10 is past the input's 3 tokens \(positions must be in \[-3, 3\)\)"),
        (-4, r"positions -4 is past the input's 3 tokens"),
        ([0, 2, 3], r"positions 3 is past the input's 3 tokens"),
        (slice(5, None), r"positions slice\(5, None, None\) selects none of the input's 3 tokens"),
    ],
    ids=["10", "-4", "[0, 2, 3]", "5:"],
)
def test_a_position_past_the_input_is_named(llm: infer.LLM, positions: Any, message: str) -> None:
    """Checked when the forward runs (the input's length is known only then): it used to be an
    IndexError from inside the hook."""
    with (
        llm.intervene(layer=0, zero=True, positions=positions),
        pytest.raises(ValueError, match=message) as info,
    ):
        llm.model(torch.tensor([[5, 6, 7]]))
    assert "intervention (zero at layer 0, positions" in str(info.value)


def test_good_positions_edit_those_tokens(llm: infer.LLM) -> None:
    """Ints (numpy's too), negatives from the end, lists, tuples, ranges, integer tensors and slices
    edit the same tokens as the list of the positions they name."""
    import numpy as np

    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = {}
        for p in ([3], [1, 2]):
            with llm.intervene(layer=0, zero=True, positions=p):
                want[tuple(p)] = llm.model(ids)
        same: list[tuple[Any, tuple[int, ...]]] = [
            (3, (3,)), (-1, (3,)), (np.int64(3), (3,)), (torch.tensor(3), (3,)), ([-3, 2], (1, 2)),
            ((1, 2), (1, 2)), (range(1, 3), (1, 2)), (torch.tensor([1, 2]), (1, 2)), (slice(1, 3), (1, 2)),
            (slice(-1, None), (3,)),
        ]  # fmt: skip
        for p, key in same:
            with llm.intervene(layer=0, zero=True, positions=p):
                assert torch.equal(llm.model(ids), want[key]), p
