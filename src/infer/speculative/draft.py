"""Proposals of a draft model (`Drafter`): its own KV slots, caught up with each row's text, then
one-token steps for every drafting row together."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import torch

from infer.execution import StepOutput
from infer.kv.prefix import common_prefix
from infer.sampling import Sampling, SamplingValues, gumbel_noise, probabilities, step_sampling
from infer.speculative.acceptance import PassCost
from infer.speculative.state import Speculating


class DraftSlots(Protocol):
    """What the drafter uses of its KV slots (`infer.kv.KVSlots`)."""

    @property
    def context(self) -> int: ...
    @property
    def rows(self) -> int: ...
    def reserve(self, rows: int, capacity: int) -> None: ...
    def rollback(self, row: int, length: int) -> None: ...
    def tokens(self, row: int) -> list[int]: ...


# One step of the draft's rows [lo, hi): (lo, hi, feeds, mode, values, noise) -> its output.
DraftStep = Callable[[int, int, dict[int, list[int]], Sampling, SamplingValues | None, torch.Tensor | None],
                     StepOutput]  # fmt: skip


class DraftRunner(Protocol):
    """What runs the draft model's steps on its own slots (`infer.engine.Runner`, made by the engine)."""

    @property
    def slots(self) -> DraftSlots: ...
    @property
    def step(self) -> DraftStep: ...


class Drafter:
    """A draft model's side of the engine: its own KV slots (row ``i`` drafts for the engine's row
    ``i``), fed the text each row holds, then ``k`` one-token steps for all drafting rows together.

    A row's draft KV is kept between passes and cut back to what it shares with the row's text
    (`KVSlots.rollback`), so a pass feeds the draft only the tokens it has not seen: the target's
    token of the last pass (and the last proposal, when every one was kept).
    """

    CATCH_UP = 512  # tokens per row per forward when the draft reads a prompt

    def __init__(self, llm: Any, runner: DraftRunner) -> None:
        self.llm = llm
        self.runner = runner
        self.slots = runner.slots
        self.cost = PassCost()  # its one-token steps
        # Seconds the last `catch_up` spent reading text it had not seen (a prompt, plain steps' tokens).
        self.reading = 0.0
        self.drafting = 0.0  # seconds the last `draft` took, less its `reading`: a pass's own cost

    def room(self, r: Speculating) -> int:
        """Tokens the draft's context leaves for ``r``'s proposals."""
        return self.slots.context - (len(r.prompt) + len(r.generated)) - 1

    def catch_up(self, requests: Sequence[Speculating]) -> dict[int, list[int]]:
        """Feed the draft each request's text it has not seen but the last token (a new prompt, the
        tokens of plain steps between passes, the last pass's); what is left to feed each row (the
        last token: the first step's). Sets `reading`."""
        slots = self.slots
        if requests[-1].row + 1 > slots.rows:
            slots.reserve(requests[-1].row + 1, 1)
        feeds: dict[int, list[int]] = {}
        for r in requests:
            text = [*r.prompt, *r.generated]
            n = min(common_prefix(slots.tokens(r.row), text), len(text) - 1)
            slots.rollback(r.row, n)
            feeds[r.row] = text[n:]
        t0 = time.perf_counter()
        reading = any(len(f) > 2 for f in feeds.values())
        while any(len(f) > 1 for f in feeds.values()):  # all but the last token, CATCH_UP at a time
            chunk = {i: f[: min(len(f) - 1, self.CATCH_UP)] for i, f in feeds.items() if len(f) > 1}
            ahead = sorted(chunk)
            self.runner.step(ahead[0], ahead[-1] + 1, chunk, Sampling(), None, None)
            for i, c in chunk.items():
                del feeds[i][: len(c)]
        # Feeding two tokens (the last pass kept every proposal: its last one and the target's token)
        # is every pass's cost; more is text read once (a prompt, the tokens of plain steps between).
        self.reading = time.perf_counter() - t0 if reading else 0.0
        return feeds

    def draft(
        self, requests: Sequence[Speculating], limits: dict[int, int], vocab: int
    ) -> dict[int, tuple[list[int], torch.Tensor | None]]:
        """``limits[r.row]`` tokens per request (one-token steps of every request with tokens to go),
        drawn as each request samples (greedy: the draft's argmax), and for a sampled request the
        distributions they were drawn from ``[k, vocab]``. Sets `drafting`."""
        t_start = time.perf_counter()
        rows = [r.row for r in requests]
        feeds = self.catch_up(requests)
        tokens: dict[int, list[int]] = {i: [] for i in rows}
        dists: dict[int, list[torch.Tensor]] = {r.row: [] for r in requests if not r.params.greedy}
        V = self.llm.model.vocab_size
        device = self.llm.model.device
        for i in range(max(limits.values())):
            t0 = time.perf_counter()
            active = [r for r in requests if limits[r.row] > i]  # (a row near the end of its context stops)
            # One step over rows [lo, hi); rows between the drafting ones take part fed nothing, greedy.
            lo, hi = active[0].row, active[-1].row + 1
            by_row = {r.row: r for r in active}
            span = [by_row.get(row) for row in range(lo, hi)]
            params = [None if r is None else r.params for r in span]
            noise = partial(_draft_noise, span, V, device)
            mode, values, drawn_noise = step_sampling(params, noise, V, device)
            out = self.runner.step(lo, hi, {r.row: feeds[r.row] for r in active}, mode, values, drawn_noise)
            drawn: list[int] = out.tokens.tolist()
            for r in active:
                b = r.row - lo
                t = drawn[b]
                tokens[r.row].append(t)
                feeds[r.row] = [t]
                if r.row in dists:
                    p = r.params
                    q = probabilities(out.logits[b : b + 1], p.temperature, p.top_k, p.top_p)[0]
                    dists[r.row].append(_fit_vocab(q, vocab))
            self.cost.observe(len(active), 1, time.perf_counter() - t0)
        out_rows: dict[int, tuple[list[int], torch.Tensor | None]] = {}
        for r in requests:
            toks = tokens[r.row]
            cut = next((i for i, t in enumerate(toks) if t >= vocab), len(toks))  # past the target's ids
            drawn_from = torch.stack(dists[r.row][:cut]) if r.row in dists and cut else None
            out_rows[r.row] = (toks[:cut], drawn_from)
        self.drafting = time.perf_counter() - t_start - self.reading
        return out_rows


def _draft_noise(
    span: list[Speculating | None], vocab: int, device: torch.device, b: int
) -> torch.Tensor | None:
    """Row ``b``'s noise ``[1, vocab]`` in a draft step, from its request's generator (None: none)."""
    r = span[b]
    return None if r is None or r.noise is None else gumbel_noise(1, vocab, r.noise.generator, device)


def _fit_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft distribution over the target's ``vocab`` ids (the draft's logits may be wider or narrower)."""
    if q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        return q[..., :vocab]
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
