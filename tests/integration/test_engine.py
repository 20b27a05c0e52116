"""The generation engine (`infer.engine`): continuous batching that gives each request what it gets alone.

Bitwise claims use the deterministic mode (`infer.load(..., deterministic=True)`, docs/numerics.md),
where a row's arithmetic does not depend on the other rows of a step or on how its prompt was
chunked; the default mode is compared by greedy tokens only. Every wait is bounded (`drain`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import infer
from infer.engine import IDLE_EXIT_S, Delta, Engine, EngineFull, RequestHandle, Runner, SamplingParams
from infer.kv import KVSlots
from infer.sampling import Sampling, sampling_inputs

TIMEOUT = 120.0  # seconds any one request may take on a loaded 2-core machine
PROMPT = [5, 9, 200, 31, 7, 44, 3]


def drain(handle: RequestHandle, timeout: float = TIMEOUT) -> list[Delta]:
    """Every event of ``handle``, failing (not hanging) when it does not end within ``timeout``."""
    events: list[Delta] = []
    thread = threading.Thread(target=lambda: events.extend(handle), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"request {handle.id} did not finish within {timeout} s"
    return events


def tokens_of(events: list[Delta]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of different lengths (3 .. 3 + 4n tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (3 + 4 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def det(tiny_ckpt_factory: Callable[..., Path]) -> Iterator[infer.LLM]:
    """Tiny Gemma 3 (sliding window, soft-capping) in the deterministic mode."""
    llm = infer.load(tiny_ckpt_factory("gemma3"), deterministic=True)
    yield llm
    llm.engine.close(drain=False)


@pytest.fixture(scope="module")
def llama(tiny_ckpt_factory: Callable[..., Path]) -> Iterator[infer.LLM]:
    llm = infer.load(tiny_ckpt_factory("llama"))
    yield llm
    llm.engine.close(drain=False)


def alone(llm: infer.LLM, prompt: list[int], params: SamplingParams) -> list[Delta]:
    """The request on an engine of its own (nothing else ever ran there)."""
    engine = Engine(llm)
    try:
        return drain(engine.submit(prompt, params))
    finally:
        engine.close(drain=False)


def test_deterministic_alone_equals_among_15_others_and_generate(det: infer.LLM) -> None:
    """A greedy request's tokens and logprobs are bitwise the same alone, among 15 concurrent
    requests of other lengths and settings, and through `llm.generate`."""
    params = SamplingParams(max_tokens=12, logprobs=3, ignore_eos=True)
    solo = alone(det, PROMPT, params)
    others = [
        SamplingParams(
            max_tokens=5 + i, temperature=0.7 * (i % 3), top_k=i % 4, seed=i, logprobs=i % 2 or None
        )
        for i in range(15)
    ]
    engine = Engine(det, max_batch=16)
    try:
        handles = engine.submit_many(
            [*prompts(8), PROMPT, *prompts(7, 1)], [*others[:8], params, *others[8:]], text=True, wait=True
        )
        crowd = [drain(h) for h in handles][8]
    finally:
        engine.close(drain=False)
    assert tokens_of(crowd) == tokens_of(solo) and len(tokens_of(solo)) == 12
    lp_solo = [(lp.token_id, lp.logprob, lp.top) for e in solo for lp in e.logprobs or []]
    lp_crowd = [(lp.token_id, lp.logprob, lp.top) for e in crowd for lp in e.logprobs or []]
    assert lp_crowd == lp_solo, "logprobs differ bitwise"
    assert len(lp_solo) == 12 and all(len(top) == 3 for _, _, top in lp_solo)
    generated = det.generate(PROMPT, max_new_tokens=12).token_ids  # stops at an EOS id: a prefix
    assert generated == tokens_of(solo)[: len(generated)]
    print(f"\n12 greedy tokens + logprobs bitwise equal alone / among 15 others: {tokens_of(solo)}")


def test_a_rows_tokens_do_not_depend_on_its_neighbours_settings(det: infer.LLM) -> None:
    mine = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    results = []
    for neighbours in (
        [SamplingParams(max_tokens=10), SamplingParams(max_tokens=3)],
        [SamplingParams(max_tokens=10, temperature=2.0, top_k=3, seed=1), SamplingParams(temperature=0.1)],
        [SamplingParams(max_tokens=7, temperature=1.0, top_p=0.3), SamplingParams(logprobs=5)],
    ):
        engine = Engine(det)
        try:
            handles = engine.submit_many([prompts(1, 3)[0], PROMPT, prompts(2, 4)[1]], [neighbours[0], mine,
                                     neighbours[1]], text=False, wait=True)  # fmt: skip
            events = [drain(h) for h in handles]
            results.append(tokens_of(events[1]))
        finally:
            engine.close(drain=False)
    print(f"\nsampled row with three different neighbour settings: {results}")
    assert results[0] == results[1] == results[2]
    assert results[0] == tokens_of(alone(det, PROMPT, mine))


def test_requests_join_and_leave_mid_run_and_rows_are_reused(det: infer.LLM) -> None:
    """B joins while A decodes, leaves before A ends; C then takes B's free row (reset to nothing in
    common with B's prompt); each equals what it gets alone."""
    pa, pb, pc = prompts(3, 7)
    pa_params = SamplingParams(max_tokens=30, ignore_eos=True)
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = Engine(det, max_batch=2)
    try:
        a = engine.submit(pa, pa_params)
        it = iter(a)
        first = [next(it), next(it)]
        b = engine.submit(pb, short)
        got_b = drain(b)
        c = engine.submit(pc, short)
        got_c = drain(c)
        rest = list(it)
        assert engine.stats()["running"] == 0 and engine.stats()["kv_rows"] <= 2
    finally:
        engine.close(drain=False)
    assert tokens_of(first + rest) == tokens_of(alone(det, pa, pa_params))
    assert tokens_of(got_b) == tokens_of(alone(det, pb, short))
    assert tokens_of(got_c) == tokens_of(alone(det, pc, short))
    assert c.cached == 0 and c.prefilled == len(pc)


def test_long_prefill_is_chunked_and_interleaved_with_decodes(det: infer.LLM) -> None:
    """With 8-token chunks a 60-token prompt takes 8 iterations; the running stream keeps getting
    a token every iteration meanwhile, and the long request equals one prefill alone."""
    engine = Engine(det, prefill_chunk=8)
    long_prompt = prompts(16, 9)[15]
    assert len(long_prompt) == 63
    log: list[str] = []
    try:
        a = engine.submit(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
        it = iter(a)
        next(it)
        b = engine.submit(long_prompt, SamplingParams(max_tokens=5, ignore_eos=True))

        def read_b() -> None:
            for d in b:
                if d.token_ids:
                    log.append("b")

        tb = threading.Thread(target=read_b)
        tb.start()
        for d in it:
            if d.token_ids:
                log.append("a")
        tb.join(TIMEOUT)
        assert not tb.is_alive()
    finally:
        engine.close(drain=False)
    before_b = log.index("b")
    print(f"\nstream A got {before_b} tokens while B's 63-token prompt was prefilled in 8-token chunks")
    assert before_b >= 63 // 8 - 1
    assert b.prefilled == 63
    assert b.token_ids == tokens_of(alone(det, long_prompt, SamplingParams(max_tokens=5, ignore_eos=True)))


def test_sliding_window_layers_read_only_their_window(
    tiny_ckpt_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt read in chunks: a sliding-window layer attends over the keys its window can see
    (`KVCache.first`), not every slot before, and the tokens are the cache-free forward's."""
    import torch.nn.functional as F

    from infer.testing import SLIDING_WINDOW

    llm = infer.load(tiny_ckpt_factory("gemma3"))  # the default mode: windows 8, soft-capping
    keys: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def recording(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        keys.append(k.shape[2])
        out: torch.Tensor = sdpa(q, k, *args, **kwargs)
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    chunk = 6
    engine = Engine(llm, prefill_chunk=chunk, idle_prefill_chunk=chunk)
    prompt = prompts(12, 3)[11]  # 47 tokens: 8 chunks
    try:
        got = drain(engine.submit(prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
    finally:
        engine.close(drain=False)
    last_chunk = keys[-4 * 4 - 4 :][:4]  # the last prefill chunk's 4 layers (then 3 decode steps)
    print(f"\nkeys read per layer in the last chunk: {last_chunk} (window {SLIDING_WINDOW}, chunk {chunk})")
    assert min(last_chunk) <= SLIDING_WINDOW + chunk - 1 < max(last_chunk)  # sliding layers: the window
    # The engine's tokens are a full forward's without a cache (greedy; the default mode is within
    # float32 rounding of it, so the tokens may part only where the top two logits nearly tie).
    ids = list(prompt)
    for token in tokens_of(got):
        with torch.inference_mode():
            logits = llm.model(torch.tensor([ids]))[0, -1]
        top2 = logits.topk(2).values
        if token != int(logits.argmax()):
            assert float(top2[0] - top2[1]) < 1e-4 * float(logits.abs().max()), (token, int(logits.argmax()))
            break
        ids.append(token)


def test_prefix_cache_reuses_a_finished_requests_kv(det: infer.LLM) -> None:
    """A prompt that extends an earlier request's prompt and reply prefills only the new tokens,
    and generates what a fresh engine does."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = Engine(det, max_batch=4)
    try:
        first = engine.submit(PROMPT, params)
        drain(first)
        follow = PROMPT + first.token_ids + [17, 18, 19]
        second = engine.submit(follow, params)
        got = drain(second)
        unrelated = engine.submit([100, 101, 102], params)
        drain(unrelated)
    finally:
        engine.close(drain=False)
    print(f"\nsecond prompt {len(follow)} tokens: {second.cached} reused, {second.prefilled} prefilled")
    assert second.cached == len(PROMPT) + len(first.token_ids) - 1  # the last reply token was never fed
    assert second.prefilled == len(follow) - second.cached
    assert unrelated.cached == 0
    assert tokens_of(got) == tokens_of(alone(det, follow, params))


def test_chat_second_turn_prefills_only_the_new_tokens(tiny_ckpt_factory: Callable[..., Path]) -> None:
    llm = infer.load(tiny_ckpt_factory("gemma3"), deterministic=True)
    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    reply = llm.chat(messages, max_new_tokens=6)
    before = llm.engine.stats()["prefill_tokens"]
    turn2 = [*messages, {"role": "assistant", "content": reply.text}, {"role": "user", "content": "And?"}]
    second = llm.chat(turn2, max_new_tokens=6)
    prefilled = llm.engine.stats()["prefill_tokens"] - before
    first_ids, ids = llm.chat_prompt(messages), llm.chat_prompt(turn2)
    kept = first_ids + reply.token_ids[:-1]  # the row's KV: the last reply token was never fed
    common = next((i for i, (a, b) in enumerate(zip(kept, ids, strict=False)) if a != b), len(kept))
    print(
        f"\nsecond turn: {len(ids)} prompt tokens, {common} in common with the first turn's row "
        f"({len(first_ids)} prompt + reply), {prefilled} prefilled"
    )
    assert common >= len(first_ids)  # at least the whole first prompt is reused
    assert prefilled == len(ids) - common
    fresh = infer.load(tiny_ckpt_factory("gemma3"), deterministic=True)
    assert second.token_ids == fresh.chat(turn2, max_new_tokens=6).token_ids
    llm.engine.close(drain=False)
    fresh.engine.close(drain=False)


def test_verify_then_rollback_equals_never_proposing(det: infer.LLM) -> None:
    """Feed 4 proposed tokens in one step, keep 1, roll back: the next steps' logits are bitwise those
    of plain one-token decoding, and each verified logit row equals the decode step's."""
    model = det.model
    mode, values = sampling_inputs([SamplingParams()], model.device, exact_head=True)

    def decode(slots: Runner, token: int) -> torch.Tensor:
        return slots.step(0, 1, {0: [token]}, mode, values, None).logits[0]

    with torch.inference_mode():
        plain = Runner(KVSlots(model, 1, 256))
        logits = [plain.step(0, 1, {0: list(PROMPT)}, mode, values, None).logits[0]]
        toks = []
        for _ in range(5):
            toks.append(int(logits[-1].argmax()))
            logits.append(decode(plain, toks[-1]))
        spec = Runner(KVSlots(model, 1, 256))
        first = spec.step(0, 1, {0: list(PROMPT)}, mode, values, None).logits[0]
        proposed = [toks[0], (toks[1] + 1) % 200, 3, 4]  # the second is wrong
        every = Sampling(greedy=True, exact_head=True, every_token=True)
        verified = spec.step(0, 1, {0: proposed}, every, None, None).logits  # [4, V]: after each
        assert torch.equal(first, logits[0]) and torch.equal(verified[0], logits[1])
        spec.slots.rollback(0, len(PROMPT) + 1)  # keep the accepted toks[0]
        again = [decode(spec, t) for t in toks[1:5]]
    assert all(torch.equal(a, b) for a, b in zip(again, logits[2:], strict=True))
    with pytest.raises(ValueError, match="rollback: length must be in"):
        spec.slots.rollback(0, 10_000)


def test_threads_and_interleaved_streams_get_what_they_get_alone(llama: infer.LLM) -> None:
    """Several threads calling generate/stream at once, and two stream() generators advanced in turn."""
    texts = ["Hello", "Once upon a time", "The tiny model", "A"]
    expected = {t: llama.generate(t, max_new_tokens=12).text for t in texts}
    got: dict[str, str] = {}
    errors: list[BaseException] = []

    def work(t: str, use_stream: bool) -> None:
        try:
            got[t] = (
                "".join(llama.stream(t, max_new_tokens=12))
                if use_stream
                else llama.generate(t, max_new_tokens=12).text
            )
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t, i % 2 == 0)) for i, t in enumerate(texts)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT)
    assert not errors and not any(th.is_alive() for th in threads)
    assert got == expected
    one, two = llama.stream(texts[0], max_new_tokens=12), llama.stream(texts[1], max_new_tokens=12)
    a, b = [], []
    for _ in range(40):
        a += [next(one, "")]
        b += [next(two, "")]
    assert "".join(a) == expected[texts[0]] and "".join(b) == expected[texts[1]]


def test_non_finite_logits_end_only_that_request(llama: infer.LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(llama)
    head = llama.model.head
    calls = []

    def spoiled(h: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        logits = head(h, greedy=greedy)
        calls.append(1)
        if len(calls) == 3 and logits.shape[0] == 2:  # decode step 2 of the two rows
            logits = logits.clone()
            logits[1, ..., 7] = math.nan
        return logits

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = tokens_of(alone(llama, PROMPT, params))
    monkeypatch.setattr(llama.model, "head", spoiled)
    try:
        # Queued together before any loop runs (this thread drives): both join the first step.
        good, bad = engine.submit_many(
            [PROMPT, [8, 9, 10]], [params, params], text=True, wait=True, drive=True
        )
        got_bad, got_good = drain(bad), drain(good)
    finally:
        engine.close(drain=False)
    assert got_bad[-1].finish_reason == "error" and "non-finite logits" in (got_bad[-1].error or "")
    assert "decode step 2" in (got_bad[-1].error or "")
    assert got_good[-1].finish_reason == "length" and tokens_of(got_good) == want


def test_cancel_frees_the_row_within_a_step(llama: infer.LLM) -> None:
    engine = Engine(llama, max_batch=1)
    try:
        h = engine.submit(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
        it = iter(h)
        next(it)
        # The loop thread runs on while this one is descheduled (the tokens it queued meanwhile are
        # still delivered): count the tokens made after the cancel, not the deltas that follow.
        made = engine.stats()["generated_tokens"]
        h.cancel()
        rest = list(it)
        after = engine.stats()["generated_tokens"] - made
        print(f"tokens made after the cancel: {after}; deltas delivered after the first: {len(rest)}")
        # the step in flight, and one begun between the count and the cancel
        assert after <= 2 and rest[-1].finish_reason == "cancelled"
        assert engine.stats()["running"] == 0
        again = drain(engine.submit(PROMPT, SamplingParams(max_tokens=3)))  # the row is free again
        assert again[-1].finish_reason in ("length", "stop")
    finally:
        engine.close(drain=False)


def test_full_queue_raises_engine_full(llama: infer.LLM) -> None:
    engine = Engine(llama, max_batch=1, max_waiting=1)
    try:
        running = engine.submit(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
        it = iter(running)
        next(it)  # admitted: the waiting queue is empty again
        waiting = engine.submit(PROMPT, SamplingParams(max_tokens=2))
        with pytest.raises(EngineFull, match="max_waiting=1"):
            engine.submit(PROMPT, SamplingParams(max_tokens=2))
        running.cancel()
        assert drain(waiting)[-1].finish_reason in ("length", "stop")
        assert engine.stats()["waiting"] == 0
    finally:
        engine.close(drain=False)


def test_submit_many_queues_a_group_whole_or_not_at_all(llama: infer.LLM) -> None:
    """One call's requests (a server response's choices) are one group: admitted together while the
    queue has room, past the bound if they are many; refused together when it is full."""
    engine = Engine(llama, max_batch=1, max_waiting=1)
    try:
        running = engine.submit(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
        next(iter(running))  # admitted: the waiting queue is empty again
        group = engine.submit_many([PROMPT] * 4, [SamplingParams(max_tokens=2)] * 4)
        assert engine.stats()["waiting"] == 4  # more than max_waiting, as one group
        with pytest.raises(EngineFull, match="max_waiting=1"):
            engine.submit_many([PROMPT] * 2, [SamplingParams(max_tokens=2)] * 2)
        assert engine.stats()["waiting"] == 4  # nothing of the refused group was queued
        running.cancel()
        assert [drain(h)[-1].finish_reason in ("length", "stop") for h in group] == [True] * 4
        assert engine.stats()["waiting"] == 0
    finally:
        engine.close(drain=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens must be an int >= 1"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"logprobs": 21}, r"logprobs must be an int in \[0, 20\]"),
        ({"stop": ("",)}, "stop must be"),
    ],
)
def test_bad_params_name_the_field(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_too_long_prompt_is_refused(llama: infer.LLM) -> None:
    engine = Engine(llama, context=16)
    with pytest.raises(ValueError, match="prompt has 20 tokens; the model's context is 16 tokens"):
        engine.submit(list(range(3, 23)))
    engine.close()


def test_streamed_model_from_two_threads(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """Layer streaming swaps weights between steps: two threads share it through the one engine
    loop, get what each gets alone, and leave the model intact."""
    streaming = infer.StreamingConfig(layer_group_size=2, memory_budget="64MB", max_resident_layers=0)
    llm = infer.load(tiny_ckpt_factory("llama"), streaming=streaming)
    texts = ["Hello", "The quick brown fox jumps over"]
    expected = [llm.generate(t, max_new_tokens=10).token_ids for t in texts]
    got: dict[int, list[int]] = {}

    def work(i: int) -> None:
        got[i] = llm.generate(texts[i], max_new_tokens=10).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT)
    assert not any(th.is_alive() for th in threads)
    assert [got[0], got[1]] == expected
    assert llm.generate(texts[0], max_new_tokens=10).token_ids == expected[0]  # intact afterwards
    llm.engine.close(drain=False)


def test_async_iteration(llama: infer.LLM) -> None:
    """`RequestHandle.aiter` gives the same events to asyncio code (S's server reads it so)."""
    import asyncio

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = tokens_of(alone(llama, PROMPT, params))

    async def main() -> list[Delta]:
        h = llama.engine.submit(PROMPT, params)
        return [d async for d in h.aiter()]

    got = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert tokens_of(got) == want and got[-1].finish_reason == "length"


def test_close_drains_or_cancels(llama: infer.LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from infer.engine import EngineClosed

    params = SamplingParams(max_tokens=5, ignore_eos=True)
    engine = Engine(llama, max_batch=1)
    handles = [engine.submit(PROMPT, params), engine.submit([8, 9, 10], params)]
    engine.close(drain=True, timeout=TIMEOUT)
    assert [drain(h)[-1].finish_reason for h in handles] == ["length", "length"]
    with pytest.raises(EngineClosed):
        engine.submit(PROMPT, params)
    head = llama.model.head

    def slow(h: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        time.sleep(0.02)  # 200 tokens take 4 s: the close comes first
        return head(h, greedy=greedy)

    monkeypatch.setattr(llama.model, "head", slow)
    engine = Engine(llama, max_batch=1)
    handles = [engine.submit(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True)) for _ in range(2)]
    engine.close(drain=False, timeout=TIMEOUT)
    assert [drain(h)[-1].finish_reason for h in handles] == ["cancelled", "cancelled"]
    assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0


def test_a_failing_step_ends_its_requests_and_the_engine_goes_on(
    llama: infer.LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception in the head (after the cache advanced) ends that step's request with "error";
    the rows stay consistent, so the next request gets what it gets alone."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = tokens_of(alone(llama, PROMPT, params))
    head = llama.model.head
    calls = []

    def failing(h: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return head(h, greedy=greedy)

    monkeypatch.setattr(llama.model, "head", failing)
    engine = Engine(llama)
    try:
        failed = drain(engine.submit(PROMPT, params))
        assert failed[-1].finish_reason == "error" and failed[-1].error == "boom"
        assert tokens_of(drain(engine.submit(PROMPT, params))) == want  # the prefix cache reused the row
    finally:
        engine.close(drain=False)


def test_generate_runs_the_model_on_the_callers_thread(
    llama: infer.LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LLM.generate` drives the engine's loop itself (no background thread): torch's OpenMP
    regions issued from another thread cost ~2x per small op (docs/performance.md)."""
    head = llama.model.head
    threads: set[str] = set()

    def recording(h: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        threads.add(threading.current_thread().name)
        return head(h, greedy=greedy)

    # A loop thread an earlier test of this module started (to end its cancelled requests) lives
    # on for IDLE_EXIT_S; while it does it may run a step. Wait it out (bounded) first.
    deadline = time.monotonic() + IDLE_EXIT_S + 10
    while any(t.name == "infer-engine" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    monkeypatch.setattr(llama.model, "head", recording)
    llama.generate([PROMPT, PROMPT[:3]], max_new_tokens=4)
    list(llama.stream(PROMPT, max_new_tokens=3))
    assert threads == {threading.current_thread().name}


def test_an_interrupt_in_a_driven_step_reaches_the_caller_and_the_engine_goes_on(
    det: infer.LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while `generate` runs the step on the caller's thread: KeyboardInterrupt reaches the
    caller, the interrupted request ends, and the next request gets what it gets alone
    (deterministic mode: equal by construction however the prefix cache splits its prompt)."""
    want = det.generate(PROMPT, max_new_tokens=6).token_ids
    head = det.model.head
    calls = []

    def interrupted(h: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return head(h, greedy=greedy)

    monkeypatch.setattr(det.model, "head", interrupted)
    with pytest.raises(KeyboardInterrupt):
        det.generate(PROMPT, max_new_tokens=6)
    stats = det.engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert det.generate(PROMPT, max_new_tokens=6).token_ids == want


def test_a_caller_waiting_on_another_callers_step_takes_over(det: infer.LLM) -> None:
    """Two threads generate at once: one drives, the other gets its tokens from that thread's
    steps and drives itself once the first is done; both get what they get alone
    (deterministic mode: a row's tokens do not depend on the rows beside it)."""
    want = {n: det.generate(PROMPT, max_new_tokens=n).token_ids for n in (3, 24)}
    got: dict[int, list[int]] = {}

    def run(n: int) -> None:
        got[n] = det.generate(PROMPT, max_new_tokens=n).token_ids

    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in (3, 24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads)
    assert got == want


def test_growing_the_kv_slots_keeps_what_rows_hold_and_frees_the_old_buffers(det: infer.LLM) -> None:
    """`KVSlots.reserve` past the rows or slots held: every held K/V value is kept bitwise, each
    old layer's buffers are released once copied (the peak is the new cache plus one old layer),
    and decoding goes on exactly as in slots that never grew; `shrink` likewise."""
    model = det.model
    mode, values = sampling_inputs([SamplingParams()], model.device, exact_head=True)
    with torch.inference_mode():
        grown, big = Runner(KVSlots(model, 4, 512)), Runner(KVSlots(model, 4, 512))
        big.slots.reserve(4, 400)
        for slots in (grown, big):
            slots.step(0, 1, {0: list(PROMPT)}, mode, values, None)
        old = grown.slots.cache
        assert old is not None
        before = [[t.clone() for t in layer.tensors()] for layer in old.layers]
        grown.slots.reserve(3, 300)  # more rows and more slots
        new = grown.slots.cache
        assert new is not None and new.batch_size >= 3 and new.max_len >= 300
        for was, layer in zip(before, new.layers, strict=True):
            for src, dst in zip(was, layer.tensors(), strict=True):
                assert torch.equal(dst[: src.shape[0], :, : src.shape[2]], src)
        print(f"grew {old.batch_size}x{old.capacity} -> {new.batch_size}x{new.capacity}")
        assert all(layer.capacity == 0 and layer.k.numel() == 0 for layer in old.layers)
        token = 7
        for _ in range(3):
            a = grown.step(0, 1, {0: [token]}, mode, values, None).logits[0]
            b = big.step(0, 1, {0: [token]}, mode, values, None).logits[0]
            assert torch.equal(a, b)
            token = int(a.argmax())
        grown.slots.shrink()  # rows hold ~20 tokens of 300+ slots: halved
        assert grown.slots.cache is not None and grown.slots.cache.capacity < new.capacity
        a = grown.step(0, 1, {0: [token]}, mode, values, None).logits[0]
        b = big.step(0, 1, {0: [token]}, mode, values, None).logits[0]
        assert torch.equal(a, b)


def test_kv_capacity_stops_at_what_a_running_request_may_hold(llama: infer.LLM, tmp_path: Path) -> None:
    """A row's capacity grows a quarter past what it needs, but not past its request's prompt +
    max_tokens (+ a speculative draft): the engine sets each row's bound at admission and clears
    it when the request ends; slots stepped without an engine keep the quarter."""
    from infer.kv.slots import BOUND_MARGIN
    from infer.speculative import MAX_TOKENS

    assert BOUND_MARGIN == MAX_TOKENS
    for bound, want in ((0, 1152), (1000, 1088), (2000, 1152)):
        slots = KVSlots(llama.model, 4, 4096)
        slots.reserve(1, 1)
        slots.bounds[0] = bound
        slots.reserve(1, 900)  # 900 x 1.25 -> 1152; a bound of 1000 (+ 32) -> 1088
        print(f"bound {bound}: capacity {slots.capacity}")
        assert slots.capacity == want
    from infer.testing import build_checkpoint

    long = infer.load(build_checkpoint(tmp_path / "llama", "llama", max_position_embeddings=2048))
    engine = Engine(long, max_batch=2)
    try:
        prompt = [5 + i % 50 for i in range(600)]
        handle = engine.submit(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(tokens_of(drain(handle))) == 3
        # 600 x 1.25 -> 768 slots without the bound; 600 + 3 + 32 -> 640
        print(f"engine: a {len(prompt)}-token prompt, 3 new tokens: capacity {engine.slots.capacity}")
        assert engine.slots.capacity == 640 and not any(engine.slots.bounds)  # cleared at the end
    finally:
        engine.close(drain=False)


def _anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def test_a_regrowth_hands_the_old_layers_pages_back(llama: infer.LLM) -> None:
    """After `KVSlots.reserve` grows the cache, the old layers' memory leaves the process (glibc
    keeps freed heap blocks resident; `infer.host.pages.release_freed_memory` trims them): resident
    anonymous memory grows by the new cache less the old one, not by the whole new cache."""
    from infer.host.pages import _malloc_trim

    if _malloc_trim() is None:
        pytest.skip("not glibc: no malloc_trim, and no heap that keeps freed blocks this way")
    # A freed 30 MiB block raises glibc's mmap threshold to 30 MiB (it follows freed blocks up to
    # 32 MiB), so the layers below (24 MiB at 8 rows) come from the heap, as a running server's do.
    raise_threshold = torch.ones(30 << 18)
    del raise_threshold
    slots = KVSlots(llama.model, 16, 16384)
    with torch.inference_mode():
        slots.reserve(8, 16384)
        assert slots.cache is not None
        for layer in slots.cache.layers:
            for t in layer.tensors():
                t.fill_(1.0)  # resident
        old_mib = slots.nbytes / 2**20
        before = _anon_mib()
        slots.reserve(16, 16384)
        for layer in slots.cache.layers:
            for t in layer.tensors():
                t.fill_(1.0)
        new_mib = slots.nbytes / 2**20
        grew = _anon_mib() - before
    print(f"KV {old_mib:.0f} -> {new_mib:.0f} MiB: resident anonymous memory grew {grew:.0f} MiB")
    assert new_mib >= 2 * old_mib > 0
    assert grew < new_mib - old_mib / 2  # the old cache kept resident would add ~old_mib more
