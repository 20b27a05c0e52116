"""Speculative decoding (`infer.speculative`): n-gram lookup and a draft model verified by the engine.

Greedy tokens equal plain decoding's: bitwise (tokens and logprobs) in the deterministic mode,
and in the default mode apart from near-ties. Sampling: lookup keeps the very tokens of plain
sampling (the same noise per token); a draft model's rejection sampling keeps the target's
distribution (chi-square against the exact distribution of the tiny model).

Passes are forced to propose all they can (`propose_all`): on the tiny models the measured costs
would often say a pass does not pay, and these tests are about what passes give, not when.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import infer
from infer.cli import main
from infer.engine import Engine, SamplingParams
from infer.sampling import probabilities
from infer.serve.metrics import Metrics
from infer.speculative import (
    NgramIndex,
    PassCost,
    Speculative,
    Speculator,
    rejection_sample,
)
from infer.speculative.settings import PROBE_EVERY
from infer.speculative.speculator import Proposal

TIMEOUT = 120.0
# Repetitive prompts: lookup finds matches in them, and the tiny models' greedy text repeats too.
PROMPTS = [
    [5, 9, 200, 31, 7, 44, 3] * 3,
    [70, 71, 72, 73, 70, 71, 72, 73, 70, 71],
    [12, 150, 12, 151, 12, 150, 12],
    [100, 101, 102, 103, 104, 105, 106, 107, 108, 100, 101, 102],
]


@pytest.fixture
def propose_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pass proposes as many tokens as its rows can take."""

    def plan(
        self: Speculator, rows: int, proposals: dict[int, Any], drafting: dict[int, Any], *_: int
    ) -> int:
        sizes = [len(p.tokens) for p in proposals.values()] + [room for room, _ in drafting.values()]
        return 1 + max(sizes, default=0)

    monkeypatch.setattr(Speculator, "plan", plan)


@pytest.fixture(scope="module")
def gemma_path(tiny_ckpt_factory: Callable[..., Path]) -> Path:
    return tiny_ckpt_factory("gemma3")


@pytest.fixture(scope="module")
def det(gemma_path: Path) -> Iterator[infer.LLM]:
    llm = infer.load(gemma_path, deterministic=True)
    yield llm
    llm.engine.close(drain=False)


def with_spec(llm: infer.LLM, **settings: Any) -> infer.LLM:
    """``llm`` with speculative settings (the same model and execution)."""
    return infer.LLM(llm.config, llm.tokenizer, llm.model, llm.source, llm.execution, Speculative(**settings))


def collect(
    llm: infer.LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[list[Any], dict[str, Any]]:
    """``(per request: (tokens, logprobs, finish, text)), stats)`` of ``prompts`` run together."""
    engine = Engine(llm)
    out: list[Any] = []
    try:
        handles = engine.submit_many(prompts, params, text=True, wait=True)
        events: list[list[Any]] = [[] for _ in handles]

        def read() -> None:
            for i, h in enumerate(handles):
                events[i] = list(h)

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(TIMEOUT)
        assert not t.is_alive(), "requests did not finish"
        stats = engine.stats()
    finally:
        engine.close(drain=False)
    for h, evs in zip(handles, events, strict=True):
        lps = [(lp.token_id, lp.logprob, lp.top) for e in evs for lp in e.logprobs or []]
        out.append((list(h.token_ids), lps, h.finish_detail, "".join(e.text for e in evs)))
    return out, stats


def test_lookup_and_draft_greedy_are_bitwise_plain_decoding(
    det: infer.LLM, gemma_path: Path, propose_all: None
) -> None:
    """Deterministic mode: greedy tokens and logprobs with n-gram lookup, with a draft model (the
    target's weights in Q4_0) and with both, are bitwise plain decoding's — four requests sharing
    every step, one of them not speculating (``speculative=0``)."""
    params = [SamplingParams(max_tokens=32, logprobs=2, ignore_eos=True) for _ in PROMPTS]
    params[2] = SamplingParams(max_tokens=32, logprobs=2, ignore_eos=True, speculative=0)
    plain, _ = collect(det, PROMPTS, params)
    q4 = infer.load(gemma_path, quantize="q4_0", deterministic=True)
    for settings in ({"lookup": 3}, {"draft": q4}, {"lookup": 2, "draft": q4, "max_tokens": 5}):
        got, stats = collect(with_spec(det, **settings), PROMPTS, params)
        name = "+".join(settings)
        assert [g[0] for g in got] == [p[0] for p in plain], f"{name}: tokens differ"
        assert [g[1] for g in got] == [p[1] for p in plain], f"{name}: logprobs differ bitwise"
        print(
            f"\n{name}: 4 x 32 tokens bitwise equal; {stats['spec_passes']:.0f} passes, "
            f"{stats['spec_proposed']:.0f} proposed, {stats['spec_accepted']:.0f} kept, "
            f"{stats['spec_tokens_per_pass']:.2f} tokens per pass, {stats['steps']} steps"
        )
        assert 0 < stats["spec_accepted"] < stats["spec_proposed"]  # both kept and rejected runs
    q4.engine.close(drain=False)


def test_default_mode_tokens_part_only_at_near_ties(gemma_path: Path, propose_all: None) -> None:
    """Default mode: a verify pass computes 1 + k tokens per row where a decode step computes 1, so
    logits differ within float32 rounding and greedy tokens may part where the top two logits are
    that close. Where lookup's or a self-draft's tokens part from plain decoding's, plain's top two
    logits there must be within 1e-4 of max |logit| (measured and printed)."""
    llm = infer.load(gemma_path)
    draft = infer.load(gemma_path, quantize="int8")
    params = [SamplingParams(max_tokens=48, ignore_eos=True) for _ in PROMPTS]
    plain, _ = collect(llm, PROMPTS, params)
    for settings in ({"lookup": 3}, {"draft": draft}):
        got, stats = collect(with_spec(llm, **settings), PROMPTS, params)
        assert stats["spec_accepted"] > 0
        for prompt, g, p in zip(PROMPTS, got, plain, strict=True):
            if g[0] == p[0]:
                continue
            i = next(i for i, (a, b) in enumerate(zip(g[0], p[0], strict=True)) if a != b)
            with torch.inference_mode():
                logits = llm.model(torch.tensor([prompt + p[0][:i]]))[0, -1]
            top2 = logits.topk(2).values
            gap = float(top2[0] - top2[1]) / float(logits.abs().max())
            print(f"\n{settings}: tokens part at token {i}; plain's top two {gap:.2e} of max |logit|")
            assert gap < 1e-4, f"tokens part at token {i} where plain's top two logits are {gap:.2e} apart"
        same = sum(g[0] == p[0] for g, p in zip(got, plain, strict=True))
        print(f"\n{list(settings)}: {same}/4 requests' tokens identical")
    draft.engine.close(drain=False)
    llm.engine.close(drain=False)


def test_seeded_sampling_with_lookup_is_plain_samplings(det: infer.LLM, propose_all: None) -> None:
    """Lookup verifies a sampled row with the noise plain sampling draws for each token, so a seeded
    request's tokens (temperature, top-k, top-p) are bitwise those without speculation."""
    params = [
        SamplingParams(max_tokens=40, temperature=0.7, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=1.1, top_k=5, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.9, top_p=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=40, ignore_eos=True),
    ]
    plain, _ = collect(det, PROMPTS, params)
    got, stats = collect(with_spec(det, lookup=3), PROMPTS, params)
    assert [g[0] for g in got] == [p[0] for p in plain]
    assert stats["spec_accepted"] > 0 and stats["spec_accepted"] < stats["spec_proposed"]
    kept = f"{stats['spec_accepted']:.0f}/{stats['spec_proposed']:.0f}"
    print(f"\nsampled with lookup = plain sampling; {kept} proposals kept")


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's statistic, degrees of freedom and p-value; bins expecting < 5 are pooled."""
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = int(keep.sum()) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    return stat, df, p


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 6, 1.0), (1.3, 0, 0.9)],
    ids=["t1", "topk", "topp"],
)
def test_rejection_sampling_keeps_the_targets_distribution(
    temperature: float, top_k: int, top_p: float
) -> None:
    """`rejection_sample` with a draft distribution far from the target's (both after temperature,
    top-k and top-p): the first token's histogram over 20,000 draws fits the target's distribution
    (chi-square), and the draft's own distribution is refuted (so the test can fail)."""
    g = torch.Generator().manual_seed(0)
    V = 40
    p = probabilities(torch.randn(2, V, generator=g) * 2.5, temperature, top_k, top_p)
    q = probabilities(torch.randn(1, V, generator=g) * 2.5, temperature, top_k, top_p)
    counts = torch.zeros(V)
    n = 20_000
    for _ in range(n):
        draft = int(torch.multinomial(q[0], 1, generator=g))
        counts[rejection_sample(p, q, [draft], g)[0]] += 1
    stat, df, pv = chi_square(counts, p[0] * n)
    _, _, pq = chi_square(counts, q[0] * n)
    print(f"\nchi-square vs target: {stat:.1f} on {df} df, p = {pv:.3f}; vs draft p = {pq:.1e}")
    assert pv > 1e-3 and pq < 1e-6


def exact_second_token(llm: infer.LLM, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """The distribution of the second generated token: sum over t1 of p(t1) p(t2 | t1)."""
    t, k, tp = params.temperature, params.top_k, params.top_p
    with torch.inference_mode():
        p1 = probabilities(llm.model(torch.tensor([prompt]))[0, -1:], t, k, tp)[0]
        firsts = p1.nonzero()[:, 0]
        ids = torch.tensor([[*prompt, int(f)] for f in firsts])
        p2 = probabilities(llm.model(ids)[:, -1], t, k, tp)  # [F, V]
    return (p1[firsts, None] * p2).sum(0)


def test_speculative_sampling_chi_square_against_the_model(
    gemma_path: Path, tiny_ckpt_factory: Callable[..., Path], propose_all: None
) -> None:
    """Through the engine, with a draft model of other weights (the tiny Llama: its proposals are
    mostly rejected, so the residual draws are exercised too): the second token of 1,000 seeded
    requests (with three tokens to go, the second always comes out of a verify pass) fits the tiny
    model's exact distribution of that token for temperature, top-k and top-p (chi-square, p > 1e-3).
    Lookup needs no such test: its sampled tokens are plain sampling's, bitwise (above)."""
    prompt = [7, 80, 81, 7, 80, 81, 7, 80, 81, 7]
    target = infer.load(gemma_path)
    draft = infer.load(tiny_ckpt_factory("llama"))
    spec = with_spec(target, draft=draft)
    n = 1000
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.8, 8, 1.0), (1.2, 0, 0.9)]:
        params = [SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p, seed=s,
                                 ignore_eos=True) for s in range(n)]  # fmt: skip
        engine = Engine(spec, max_batch=64)
        try:
            handles = engine.submit_many([prompt] * n, params, text=False, wait=True)
            seconds: list[int] = []
            for h in handles:
                list(h)
                seconds.append(h.token_ids[1])
            stats = engine.stats()
        finally:
            engine.close(drain=False)
        assert stats["spec_passes"] >= n  # every second token came out of a verify pass
        counts = torch.bincount(torch.tensor(seconds), minlength=target.model.vocab_size).float()
        expected = exact_second_token(target, prompt, params[0]) * n
        stat, df, pv = chi_square(counts, expected)
        kept = f"{stats['spec_accepted']:.0f}/{stats['spec_proposed']:.0f}"
        print(f"\nT={temperature} top_k={top_k} top_p={top_p}: chi-square {stat:.1f} on {df} df, "
              f"p = {pv:.3f}; {kept} proposals kept")  # fmt: skip
        assert pv > 1e-3
    draft.engine.close(drain=False)


def test_stops_inside_an_accepted_run(det: infer.LLM, gemma_path: Path, propose_all: None) -> None:
    """A draft equal to the target keeps every proposal (8 per pass), so stops land inside accepted
    runs: a stop string, a stop token and max_tokens end where plain decoding ends, and no token
    past them is emitted."""
    twin = infer.load(gemma_path, deterministic=True)
    spec = with_spec(det, draft=twin)
    prompt = PROMPTS[0]
    text = det.tokenizer.decode(det.generate(prompt, max_new_tokens=40).token_ids)
    stop = text[13:16]
    token_ids = det.generate(prompt, max_new_tokens=40).token_ids
    cases = [
        SamplingParams(max_tokens=40, stop=(stop,)),
        SamplingParams(max_tokens=40, stop_token_ids=(token_ids[11],)),
        SamplingParams(max_tokens=13),
    ]
    plain, _ = collect(det, [prompt] * 3, cases)
    got, stats = collect(spec, [prompt] * 3, cases)
    assert got == plain
    assert stats["spec_tokens_per_pass"] > 4
    assert (
        plain[0][2] == "stop" and stop not in plain[0][3] and plain[1][2] == "stop" and len(plain[2][0]) == 13
    )
    print(f"\nstop string {stop!r}: {len(got[0][0])} tokens; stop token: {len(got[1][0])}; max_tokens 13: "
          f"{len(got[2][0])}; {stats['spec_tokens_per_pass']:.1f} tokens per pass")  # fmt: skip
    twin.engine.close(drain=False)


def test_a_draft_whose_tokenizer_differs_is_refused(gemma_path: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(gemma_path, other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = [t for t, i in vocab.items() if i in (65, 66)]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids
    (other / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"its tokenizer differs from the target's .* at token id 65"):
        infer.load(gemma_path, draft=other)
    with pytest.raises(ValueError, match="speculative_tokens must be an int in"):
        infer.load(gemma_path, lookup=2, speculative_tokens=0)
    with pytest.raises(ValueError, match="needs lookup >= 1 or a draft model"):
        infer.load(gemma_path, speculative_tokens=4)
    with pytest.raises(ValueError, match="speculative must be an int in"):
        SamplingParams(speculative=99)


def test_a_streamed_target_with_a_resident_draft(
    tiny_ckpt_factory: Callable[..., Path], propose_all: None
) -> None:
    """Each streamed pass of the layer groups verifies every proposal at once: greedy tokens bitwise
    the resident model's (deterministic mode), in fewer streamed passes than tokens."""
    path = tiny_ckpt_factory("llama")
    streaming = infer.StreamingConfig(layer_group_size=1, memory_budget="64MB", max_resident_layers=0)
    resident = infer.load(path, deterministic=True)
    draft = infer.load(path, quantize="int8", deterministic=True)
    streamed = infer.load(path, deterministic=True, streaming=streaming, draft=draft, lookup=2)
    params = [SamplingParams(max_tokens=30, ignore_eos=True) for _ in PROMPTS[:2]]
    plain, _ = collect(resident, PROMPTS[:2], params)
    before = streamed.streaming_stats.forwards
    got, stats = collect(streamed, PROMPTS[:2], params)
    forwards = streamed.streaming_stats.forwards - before
    assert [g[0] for g in got] == [p[0] for p in plain]
    print(f"\nstreamed target + int8 draft and lookup: {stats['spec_tokens_per_pass']:.2f} tokens per pass, "
          f"{forwards} streamed forwards for 2 x 30 tokens")  # fmt: skip
    assert forwards < 30
    for llm in (resident, draft, streamed):
        llm.engine.close(drain=False)


def test_ngram_index_proposes_what_followed_the_latest_match() -> None:
    index = NgramIndex(3)
    index.sync([1, 2, 3, 4, 9, 2, 3, 5, 6], [])
    index.extend([2, 3])
    assert index.propose(4) == ([5, 6, 2, 3], 2)  # "2 3" last seen before the end at 5..6
    index.extend([5])
    assert index.propose(2) == ([6, 2], 3)  # "2 3 5" matched whole
    index.extend([7])
    assert index.propose(2) == ([], 0)  # 7 never occurred before
    index.sync([1, 2, 3, 4, 9, 2, 3, 5, 6], [2, 3, 5, 7, 1])
    assert index.tokens[-1] == 1 and index.propose(3) == ([2, 3, 4], 1)


def planner(cost: PassCost) -> Speculator:
    return Speculator(Speculative(lookup=2), context=4096, per_forward=None, vocab=256, cost=cost)


def measured_costs() -> PassCost:
    """At one row a pass of 5 costs 1.2 decode steps; at 16 rows it costs its width in steps."""
    cost = PassCost()
    for _ in range(3):
        cost.observe(1, 1, 0.010)
        cost.observe(1, 5, 0.012)
        cost.observe(16, 1, 0.040)
        cost.observe(16, 5, 0.200)
    return cost


def proposal(alpha: float) -> Proposal:
    return Proposal([1, 2, 3, 4], 2, alpha)


def test_passes_back_off_where_they_cost_their_width() -> None:
    """The planner's choice from measured costs: at one row proposals kept at 0.8 pay; at 16 rows
    nothing pays."""
    spec = planner(measured_costs())
    assert spec.plan(1, {0: proposal(0.8)}, {}) == 5
    assert spec.plan(1, {0: proposal(0.02)}, {}) == 1
    assert spec.plan(16, {i: proposal(0.8) for i in range(16)}, {}) == 1


def test_passes_that_deliver_less_than_planned_stop_being_chosen() -> None:
    """Estimates say a pass of 5 pays (alpha 0.8: 3.4 tokens for 1.2 steps); passes that give one
    token each, or take four times their predicted seconds, scale every later plan down until plain
    steps win; one pass is still tried every `PROBE_EVERY` plain steps, and passes that deliver
    again bring the plan back."""
    for given, seconds in ((1, 0.012), (4, 0.048)):
        spec = planner(measured_costs())
        for _ in range(12):
            assert spec.plan(1, {0: proposal(0.8)}, {}) == 5
            spec.observe(1, 5, seconds, given)
            if spec.realized.factor * 3.36 / 0.012 < 1.05 / 0.010:  # below a plain step's rate + MARGIN
                break
        factor = spec.realized.factor
        print(f"given {given} in {seconds * 1e3:.0f} ms a pass: factor {factor:.2f} after {_ + 1} passes")
        assert factor * 3.36 / 0.012 < 1.05 / 0.010
        plans = [spec.plan(1, {0: proposal(0.8)}, {}) for _ in range(PROBE_EVERY)]
        assert plans[:-1] == [1] * (PROBE_EVERY - 1) and plans[-1] == 5  # the probe
        spec.observe(1, 5, seconds, given)
        chosen = []
        for _ in range(2 * PROBE_EVERY):  # probes deliver what was planned again
            chosen.append(spec.plan(1, {0: proposal(0.8)}, {}))
            spec.observe(1, chosen[-1], 0.012 if chosen[-1] > 1 else 0.010, 4 if chosen[-1] > 1 else 1)
        again = chosen.index(5) + 1
        print(f"then probes that deliver: passes after {again} steps, factor {spec.realized.factor:.2f}")
        assert chosen[-8:] == [5] * 8


def test_a_pass_settles_only_against_its_own_plan() -> None:
    """Plain steps, and passes the planner did not choose (a measuring pass), leave the factor alone."""
    spec = planner(measured_costs())
    spec.observe(1, 1, 0.5, 1)
    spec.observe(1, 5, 0.5, 1)
    assert spec.realized.factor == 1.0
    assert spec.plan(1, {0: proposal(0.8)}, {}) == 5
    spec.observe(1, 1, 0.010, 1)  # the planned pass did not run (no proposals came)
    spec.observe(1, 5, 0.5, 1)
    assert spec.realized.factor == 1.0


def test_a_plain_step_is_measured_before_any_pass() -> None:
    """Passes are weighed against a plain step's measured seconds: until one ran, the plan is a plain
    step (a measured verify pass alone says nothing of what a step costs)."""
    cost = PassCost()
    cost.observe(1, 5, 0.012)
    spec = planner(cost)
    assert spec.plan(1, {0: proposal(0.8)}, {}) == 1
    spec.observe(1, 1, 0.010, 1)
    assert spec.plan(1, {0: proposal(0.8)}, {}) == 5


def test_the_draft_reads_a_prompt_before_its_first_token(
    det: infer.LLM, gemma_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft model reads each prompt with the target's last prefill chunk (its time is the
    prompt's, not the first pass's): its first catch-up sees no generated token, and after it the
    draft's row holds the prompt but its last token."""
    from infer.speculative.draft import Drafter

    seen: list[tuple[list[int], list[int]]] = []
    catch_up = Drafter.catch_up

    def spy(self: Drafter, requests: Any) -> Any:
        feeds = catch_up(self, requests)
        seen.extend((list(r.generated), self.slots.tokens(r.row)) for r in requests)
        return feeds

    monkeypatch.setattr(Drafter, "catch_up", spy)
    q4 = infer.load(gemma_path, quantize="q4_0", deterministic=True)
    try:
        prompt = PROMPTS[0]
        collect(with_spec(det, draft=q4), [prompt], [SamplingParams(max_tokens=8, ignore_eos=True)])
    finally:
        q4.engine.close(drain=False)
    assert seen, "the draft never caught up"
    generated, held = seen[0]
    print(f"first catch-up: {len(generated)} tokens generated, the draft holds {len(held)} of {len(prompt)}")
    assert generated == [] and held == prompt[:-1]


def test_stats_and_metrics_count_proposals(det: infer.LLM, propose_all: None) -> None:
    spec = with_spec(det, lookup=3)
    engine = Engine(spec)
    try:
        list(engine.submit(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True)))
        stats = engine.stats()
        text = Metrics(engine.stats).render().decode()
    finally:
        engine.close(drain=False)
    assert stats["spec_proposed"] >= stats["spec_accepted"] > 0
    assert stats["spec_tokens"] == stats["spec_accepted"] + stats["spec_passes"]
    for key in ("spec_proposed", "spec_accepted", "spec_tokens_per_pass", "spec_acceptance"):
        assert f"infer_engine_{key} " in text


def test_cli_lookup_and_draft_give_plain_decodings_text(
    gemma_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`infer generate --lookup 3` and `--draft self` print plain decoding's greedy text; a draft of
    another tokenizer is one line naming the token."""
    argv = ["generate", str(gemma_path), "abcabcabcab", "--raw", "--max-new-tokens", "24", "--quiet"]
    assert main([*argv, "--deterministic"]) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--deterministic", "--lookup", "3", "--speculative-tokens", "4"]) == 0
    assert capsys.readouterr().out == plain
    assert main([*argv, "--deterministic", "--draft", "self"]) == 0
    assert capsys.readouterr().out == plain
    other = tmp_path / "other"
    shutil.copytree(gemma_path, other)
    data = json.loads((other / "tokenizer.json").read_text())
    data["added_tokens"][0]["content"] = "<|start|>"
    (other / "tokenizer.json").write_text(json.dumps(data))
    assert main([*argv, "--model-draft", str(other)]) == 1
    err = capsys.readouterr().err.strip()
    print(f"\n{err}")
    assert len(err.splitlines()) == 1 and "differs from the target's" in err and "'<|start|>'" in err


def test_speculation_up_to_the_end_of_the_context(
    det: infer.LLM, gemma_path: Path, propose_all: None
) -> None:
    """Proposals never pass the context (the target's or the draft's): requests that run into an
    engine's 40-token context end with "length" after the tokens plain decoding gives."""
    q4 = infer.load(gemma_path, quantize="q4_0", deterministic=True)
    spec = with_spec(det, draft=q4, lookup=3)
    prompts = [PROMPTS[0][:30], PROMPTS[1], PROMPTS[3][:12]]
    params = [SamplingParams(max_tokens=100, ignore_eos=True)] * 3
    out = []
    for llm in (det, spec):
        engine = Engine(llm, context=40)
        try:
            handles = engine.submit_many(prompts, params, text=False, wait=True)
            reasons = [[d.finish_reason for d in h][-1] for h in handles]
            out.append([(list(h.token_ids), reason) for h, reason in zip(handles, reasons, strict=True)])
            stats = engine.stats()
        finally:
            engine.close(drain=False)
    assert out[0] == out[1]
    assert [len(p) + len(t) for p, (t, _) in zip(prompts, out[1], strict=True)] == [40, 40, 40]
    assert all(reason == "length" for _, reason in out[1]) and stats["spec_accepted"] > 0
    q4.engine.close(drain=False)


def test_a_pass_never_cuts_a_row_still_reading_its_prompt(det: infer.LLM, propose_all: None) -> None:
    """Every row of a verify pass's span takes its width (padding included), so a row between the
    decoding ones that is still reading a prompt near the end of the context bounds the pass (it
    was cut back to make room, losing prompt tokens it had read): three requests in an 80-token
    context, the middle one reading a 78-token prompt while the others pass 17 tokens at a time (a
    draft equal to the target), give plain decoding's tokens and logprobs."""
    g = torch.Generator().manual_seed(1)
    prompts = [PROMPTS[1], torch.randint(3, 200, (78,), generator=g).tolist(), PROMPTS[2]]
    params = [SamplingParams(max_tokens=100, logprobs=0, ignore_eos=True)] * 3
    out = []
    for llm in (det, with_spec(det, draft=det)):
        engine = Engine(llm, context=80, prefill_chunk=48, idle_prefill_chunk=48)
        try:
            handles = engine.submit_many(prompts, params, text=False, wait=True)
            out.append([[(lp.token_id, lp.logprob) for d in h for lp in d.logprobs or []] for h in handles])
            stats = engine.stats()
        finally:
            engine.close(drain=False)
    assert out[1] == out[0] and stats["spec_accepted"] > 0


def _shared_prompts(n: int = 3) -> list[list[int]]:
    """``n`` prompts with a common 40-token prefix (shared by the engine: >= `MIN_SHARED`), repetitive
    enough for lookup to find matches."""
    prefix = (PROMPTS[0] * 2)[:40]
    return [prefix + p for p in PROMPTS[1 : 1 + n]]


def test_lookup_over_shared_prefixes_deterministic(det: infer.LLM, propose_all: None) -> None:
    """Requests that reuse another's prompt prefix (the deterministic mode copies it into the row)
    and speculate give bitwise plain decoding's tokens and logprobs."""
    prompts = _shared_prompts()
    params = [SamplingParams(max_tokens=32, logprobs=1, ignore_eos=True)] * len(prompts)
    plain, _ = collect(det, prompts, params)
    got, stats = collect(with_spec(det, lookup=3), prompts, params)
    assert [g[:2] for g in got] == [p[:2] for p in plain] and stats["spec_accepted"] > 0
    assert stats["cached_tokens"] == 2 * 40


def test_lookup_over_shared_prefixes_stays_in_each_rows_own_tokens(
    gemma_path: Path, propose_all: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Default mode: the prefix is stored once (a segment every row reads) and each row speculates
    on its own tokens after it. Every rollback of a verify pass stays within the row's own tokens
    (never into the segment: checked at each one), the segment still holds the whole prefix for
    every row at the end, and the tokens are plain decoding's with the same sharing, up to near-ties."""
    from infer.kv import KVSlots
    from infer.kv.cache import KVModel

    llm = infer.load(gemma_path)
    prompts = _shared_prompts()
    params = [SamplingParams(max_tokens=32, ignore_eos=True)] * len(prompts)
    plain, _ = collect(llm, prompts, params)
    rollback = KVSlots.rollback
    cuts: list[tuple[int, int]] = []

    def checked(self: KVSlots[KVModel], row: int, length: int) -> None:
        if self is engine.slots and self.prefix[row] is not None:
            cuts.append((length, self.offset(row)))
        rollback(self, row, length)

    monkeypatch.setattr(KVSlots, "rollback", checked)
    engine = Engine(with_spec(llm, lookup=3))
    try:
        handles = engine.submit_many(prompts, params, text=False, wait=True)
        got = [(list(h), list(h.token_ids))[1] for h in handles]
        stats = engine.stats()
        segments = [s.length for s in engine.slots.store.segments]
        offsets = [engine.slots.offset(h_row) for h_row in range(len(prompts))]
    finally:
        engine.close(drain=False)
    assert segments == [40] and offsets == [40, 40, 40] and stats["spec_accepted"] > 0
    assert cuts and all(length >= offset for length, offset in cuts), "a rollback cut a shared prefix"
    for prompt, g, p in zip(prompts, got, plain, strict=True):
        if g != p[0]:
            i = next(i for i, (a, b) in enumerate(zip(g, p[0], strict=True)) if a != b)
            with torch.inference_mode():
                logits = llm.model(torch.tensor([prompt + p[0][:i]]))[0, -1]
            top2 = logits.topk(2).values
            assert float(top2[0] - top2[1]) / float(logits.abs().max()) < 1e-4
    llm.engine.close(drain=False)


def test_processed_rows_do_not_speculate(det: infer.LLM, propose_all: None) -> None:
    """A request with a constraint, a logit bias or a penalty never speculates, and a step it takes
    part in is a plain decode step (the pass would have to verify against processed logits): each
    request gets the tokens it gets without speculation; the free request speculates once the
    processed ones have ended."""
    from infer.text.structured import Constraint

    params = [
        SamplingParams(max_tokens=12, constraint=Constraint.regex(r"[a-z]{4,10}")),
        SamplingParams(max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=12, logit_bias=((5, 5.0),), temperature=0.8, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=40, ignore_eos=True),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    plain, _ = collect(det, prompts, params)
    got, stats = collect(with_spec(det, lookup=3), prompts, params)
    assert [g[0] for g in got] == [p[0] for p in plain]
    assert stats["spec_passes"] > 0  # the free request, alone at the end
    alone, stats = collect(with_spec(det, lookup=3), prompts[:3], params[:3])
    assert [g[0] for g in alone] == [p[0] for p in plain[:3]] and stats["spec_steps"] == 0


def test_lookup_with_an_int8_kv_cache(gemma_path: Path, propose_all: None) -> None:
    """A KV dtype narrower than the activations (int8 with a scale per token and head): a verify pass
    writes and reads the cache as a prefill chunk does, and in the deterministic mode greedy tokens
    and logprobs are bitwise plain decoding's over the same int8 cache."""
    llm = infer.load(gemma_path, deterministic=True, kv_dtype="int8")
    assert llm.model.cache_dtype == torch.int8
    params = [SamplingParams(max_tokens=32, logprobs=1, ignore_eos=True)] * len(PROMPTS)
    plain, _ = collect(llm, PROMPTS, params)
    got, stats = collect(with_spec(llm, lookup=3), PROMPTS, params)
    assert [g[:2] for g in got] == [p[:2] for p in plain] and stats["spec_accepted"] > 0
    llm.engine.close(drain=False)
