"""Prefixes stored once (`infer.kv.prefix`, `infer.kv.KVSlots.share_prefix`).

Requests that run at the same time and begin with the same tokens share one copy of those
tokens' K/V: a second request with the same system prompt prefills only its own part (while
the first is still reading the prompt, it waits for it instead of computing it too), the
prefix is held once, and each row reads only its own segment and its own slots. A segment's
memory is free once its last user lets go. The default mode merges the shared and the private
part of attention by their log-sum-exps: within float32 rounding of one pass over the keys
(errors printed); the deterministic mode copies the prefix into the row instead (bitwise).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import infer
from infer.engine import SamplingParams
from infer.engine.scheduler import MIN_SHARED

PREFIX = 150


def _prompts(vocab: int, n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, vocab, (PREFIX,), generator=g).tolist()
    return [system + torch.randint(3, vocab, (5 + 4 * i,), generator=g).tolist() for i in range(n)]


def _run(
    llm: infer.LLM, prompts: list[list[int]], max_tokens: int = 10
) -> list[tuple[list[int], list[float], int]]:
    """Submit every prompt at once; (tokens, logprobs, cached prompt tokens) per request."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    handles = [llm.engine.submit(p, params) for p in prompts]
    out = []
    for h in handles:
        tokens: list[int] = []
        logprobs: list[float] = []
        for d in h:
            tokens += d.token_ids
            logprobs += [lp.logprob for lp in d.logprobs or []]
        out.append((tokens, logprobs, h.cached))
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_concurrent_requests_store_a_common_prefix_once(
    tiny_ckpt_factory: Callable[..., Path], arch: str
) -> None:
    """Four requests with a 150-token common prefix, submitted together: the first computes it,
    the other three share it (cached, not prefilled), one segment holds it, and each request's
    greedy tokens equal its tokens alone (logprobs within float32 rounding; Gemma 3's
    sliding-window layers included)."""
    path = tiny_ckpt_factory(arch)
    llm = infer.load(path, dtype=torch.float32)
    prompts = _prompts(llm.config.vocab_size)
    together = _run(llm, prompts)
    store = llm.engine.slots.store
    assert [s.length for s in store.segments] == [PREFIX]
    assert [cached for *_, cached in together] == [0, PREFIX, PREFIX, PREFIX]
    stats = llm.engine.stats()
    assert stats["prefill_tokens"] == sum(len(p) for p in prompts) - 3 * PREFIX
    alone = infer.load(path, dtype=torch.float32)
    worst = 0.0
    for p, (tokens, logprobs, _) in zip(prompts, together, strict=True):
        want, want_lp, _ = _run(alone, [p])[0]
        assert tokens == want
        worst = max(worst, max(abs(a - b) for a, b in zip(logprobs, want_lp, strict=True)))
    print(f"\n{arch}: shared prefix of {PREFIX} tokens, logprobs within {worst:.2e} of each request alone")
    assert worst < 1e-4


def test_a_segment_is_freed_with_its_last_user(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """The segment lives while a row uses it (running, or kept for the prefix cache); once every
    such row is reused for unrelated prompts, its slots are free and the store gives its memory
    back."""
    llm = infer.load(tiny_ckpt_factory("llama"), dtype=torch.float32)
    _run(llm, _prompts(llm.config.vocab_size))
    slots = llm.engine.slots
    segment = slots.store.segments[0]
    assert segment.users == 4 and slots.store.nbytes > 0
    g = torch.Generator().manual_seed(1)
    unrelated = [torch.randint(3, llm.config.vocab_size, (20,), generator=g).tolist() for _ in range(4)]
    _run(llm, unrelated, max_tokens=2)  # four at once: every row is taken again
    print(f"\nsegment users after the rows were reused: {segment.users}; store {slots.store.nbytes} bytes")
    assert segment.users == 0 and not slots.store.segments
    assert slots.store.nbytes == 0


def test_each_row_reads_only_its_own_prefix_and_slots(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """Two groups with different prefixes in one engine: in a step over all rows, a row's shared
    mask covers exactly its own segment's slots (no other segment's, no gap), and its own
    slots are its row of the buffers (a batch index: no row reads another's)."""
    llm = infer.load(tiny_ckpt_factory("llama"), dtype=torch.float32)
    V = llm.config.vocab_size
    a = _prompts(V, 2)
    g = torch.Generator().manual_seed(5)
    other = torch.randint(3, V, (90,), generator=g).tolist()
    b = [[*other, 7, 8, 9], [*other, 10, 11]]
    _run(llm, a + b, max_tokens=3)
    slots = llm.engine.slots
    assert sorted(s.length for s in slots.store.segments) == [90, PREFIX]
    rows = slots.rows
    view = slots.bind(0, rows)
    assert view.shared is not None
    from infer.kv.cache import StepPlan

    plan = view.make_plan(1)
    mask = view.shared_mask("full_attention", plan)  # [B, 1, 1, R]
    lo = min(s.start for s in slots.store.segments)
    view.shared = None
    for r in range(rows):
        prefix = slots.prefix[r]
        seen = mask[r, 0, 0].nonzero().flatten().tolist()
        if prefix is None:
            assert seen == []
            continue
        segment, n = prefix
        assert seen == list(range(segment.start - lo, segment.start - lo + n)), (r, seen[:3], seen[-3:])
    assert isinstance(plan, StepPlan)


def test_a_waiting_request_computes_the_prefix_itself_when_its_leader_goes(
    tiny_ckpt_factory: Callable[..., Path],
) -> None:
    """A request waiting for a prefix another one is computing does it itself if that request is
    cancelled first: it still gets its tokens alone."""
    path = tiny_ckpt_factory("llama")
    llm = infer.load(path, dtype=torch.float32)
    llm.engine.idle_prefill_chunk = llm.engine.prefill_chunk = 16  # the leader reads its prompt slowly
    prompts = _prompts(llm.config.vocab_size, 2)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    leader = llm.engine.submit(prompts[0], params)
    follower = llm.engine.submit(prompts[1], params)
    leader.cancel()
    got = [t for d in follower for t in d.token_ids]
    alone = infer.load(path, dtype=torch.float32).engine.submit(prompts[1], params)
    want = [t for d in alone for t in d.token_ids]
    print(f"\nfollower cached {follower.cached} of {len(prompts[1])} prompt tokens; its leader was cancelled")
    assert got == want


def test_the_deterministic_mode_copies_the_prefix_bitwise(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """Deterministic mode: the prefix is copied into each row (attention over one contiguous
    buffer), so a request that reuses another's prefix gets bitwise its tokens and logprobs alone."""
    path = tiny_ckpt_factory("gemma3")
    llm = infer.load(path, dtype=torch.float32, deterministic=True)
    assert not llm.engine.slots.share
    prompts = _prompts(llm.config.vocab_size, 3)
    together = _run(llm, prompts)
    assert [c for *_, c in together][1:] == [PREFIX, PREFIX]
    assert not llm.engine.slots.store.segments
    alone = infer.load(path, dtype=torch.float32, deterministic=True)
    for p, (tokens, logprobs, _) in zip(prompts, together, strict=True):
        want, want_lp, _ = _run(alone, [p])[0]
        assert tokens == want and logprobs == want_lp


def test_short_common_prefixes_are_not_shared(tiny_ckpt_factory: Callable[..., Path]) -> None:
    llm = infer.load(tiny_ckpt_factory("llama"), dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    head = torch.randint(3, llm.config.vocab_size, (MIN_SHARED - 1,), generator=g).tolist()
    out = _run(llm, [[*head, 5, 6, 7], [*head, 8, 9]], max_tokens=2)
    assert [c for *_, c in out] == [0, 0] and not llm.engine.slots.store.segments


def test_a_fragmented_store_never_places_a_segment_over_a_live_one(
    tiny_ckpt_factory: Callable[..., Path],
) -> None:
    """Segments freed in the middle leave gaps: a new segment exactly a gap's size takes that gap,
    one slot more goes elsewhere; then a random churn of allocations and releases. Every segment's
    slots stay disjoint from every other live one's, and its K/V (a marker per segment) intact."""
    import itertools
    import random

    from infer.kv.prefix import PrefixStore, Segment

    llm = infer.load(tiny_ckpt_factory("llama"), dtype=torch.float32)
    store = PrefixStore(llm.model)

    def new(n: int) -> Segment:
        s = store.allocate(tuple(range(n)))
        store.acquire(s)
        assert store.cache is not None
        for layer in store.cache.layers:
            layer.k[0, :, s.start : s.end] = float(s.id)  # a marker: moved by a rebuild, never overwritten
        return s

    def check() -> None:
        live = sorted(store.segments, key=lambda s: s.start)
        for a, b in itertools.pairwise(live):
            assert a.end <= b.start, f"segment {b.id} at {b.start} overlaps {a.id} ending at {a.end}"
        assert store.cache is not None and (not live or live[-1].end <= store.capacity)
        for s in live:
            for layer in store.cache.layers:
                assert bool((layer.k[0, :, s.start : s.end] == float(s.id)).all()), (
                    f"segment {s.id} overwritten"
                )

    segs = [new(n) for n in (40, 24, 40, 24, 40)]
    cap = store.capacity
    for s in (segs[1], segs[3]):  # two gaps of 24 slots in the middle
        store.release(s)
    assert store.capacity == cap, "the store was packed: no gaps left to test"
    check()
    exact = new(24)
    assert exact.start == segs[1].start, "a segment of a gap's size belongs in the first gap"
    check()
    one_more = new(25)
    assert one_more.start not in (segs[1].start, segs[3].start)
    check()
    rng = random.Random(0)
    live = [s for s in store.segments]
    for _ in range(200):
        if live and rng.random() < 0.45:
            store.release(live.pop(rng.randrange(len(live))))
        else:
            live.append(new(rng.randint(1, 48)))
        if store.cache is not None:
            check()
    print(f"capacity {store.capacity}, {len(live)} live segments, {store.tokens_held} tokens held")
