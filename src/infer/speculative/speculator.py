"""`Speculator`: when the scheduler plans a decode step, the verify pass that pays: its width, the
n-gram lookup's proposals and the rows a draft model drafts for; the measured cost of passes
(`observe`). It plans and runs nothing (`infer.speculative` says who does)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from infer.speculative.acceptance import PassCost, Realized, expected_tokens
from infer.speculative.draft import Drafter
from infer.speculative.settings import MARGIN, PROBE_EVERY, Speculative
from infer.speculative.state import DRAFTED, NgramIndex, SpecState, Speculating

S = TypeVar("S", bound=Speculating)


@dataclass
class Proposal:
    """A row's proposed tokens for one verify pass."""

    tokens: list[int]
    kind: int  # the n-gram length that matched, or DRAFTED
    alpha: float
    q: torch.Tensor | None = None  # [k, V]: the draft's distributions (a sampled request's drafts)


@dataclass
class Proposed:
    """A verify pass the speculator plans: the lookup's ``proposals``, and ``drafting``: the rows the
    draft model drafts for, with the tokens each may take and their acceptance estimate."""

    proposals: dict[int, Proposal]
    drafting: dict[int, tuple[int, float]]


@dataclass(eq=False)
class Speculator:
    """Proposals and pass widths for the scheduler (see the module's docstring).

    ``context``: the engine's bound on a row's tokens; ``per_forward``: tokens one forward may
    take (a streamed model's plan), None for any; ``vocab``: the target's vocabulary;
    ``drafter``: the draft model's side (`Drafter`: its own KV slots, made by the engine) when the
    settings name a draft model.
    """

    config: Speculative
    context: int
    per_forward: int | None
    vocab: int
    drafter: Drafter | None = None
    cost: PassCost = field(default_factory=PassCost)  # the target's plain decode steps and verify passes
    realized: Realized = field(default_factory=Realized)  # how passes delivered against their plan
    _skipped: int = 0  # passes skipped as too costly since the last one run
    _planned: tuple[float, float] | None = None  # the pass planned: its tokens and seconds expected
    _proposing: float = 0.0  # seconds the planned pass's lookup proposals took
    _drafted: bool = False  # the planned pass has rows the draft drafts (its seconds: `Drafter.drafting`)
    _drafting_pays: bool = True  # the last plan with drafting rows chose a pass (probes aside)

    # ---- per request ----------------------------------------------------------------------

    def row_state(self, r: Speculating) -> SpecState | None:
        """``r``'s state (made on first use), None when ``r`` does not speculate."""
        if r.spec is None:
            limit = self.config.max_tokens
            if r.params.speculative is not None:
                limit = min(limit, r.params.speculative)
            index = NgramIndex(self.config.lookup) if self.config.lookup else None
            r.spec = SpecState(limit, index)
        return r.spec if r.spec.limit > 0 and r.processor is None else None

    def _room(self, r: Speculating, length: int) -> int:
        """Proposals ``r`` (its row holding ``length`` tokens) can take this pass: its limit, its
        tokens left and the context."""
        state = r.spec
        assert state is not None
        left = r.max_new - len(r.generated) - 1  # the pass's last token needs no proposal
        room = min(state.limit, left, self.context - length - len(r.pending))
        if self.drafter is not None:
            room = min(room, self.drafter.room(r))
        return max(0, room)

    def _lookup(self, r: Speculating, room: int) -> Proposal | None:
        state = r.spec
        if state is None or state.index is None:
            return None
        state.index.sync(r.prompt, r.generated)
        tokens, n = state.index.propose(room)
        if not tokens:
            return None
        return Proposal(tokens, n, state.acceptance.alpha(n))

    def draft_reads(self, requests: Sequence[S]) -> list[S]:
        """Which of ``requests`` (in row order), whose last prompt chunk the target reads in this
        plan, the draft reads now: with the target's prefill, before their first token, rather than
        on the first pass's clock. None while drafted passes do not pay (the last plan with drafting
        rows chose a plain step): the draft then reads a prompt when a pass is tried."""
        d = self.drafter
        if d is None or not self._drafting_pays:
            return []
        return [r for r in requests if self.row_state(r) is not None and d.room(r) > 0]

    # ---- the pass -------------------------------------------------------------------------

    def plan(
        self,
        rows: int,
        proposals: dict[int, Proposal],
        drafting: dict[int, tuple[int, float]],
        span: int | None = None,
    ) -> int:
        """Tokens per row for this pass (1: a plain decode step), the most tokens per second.

        ``proposals``: the rows' n-gram proposals; ``drafting``: the rows the draft model would
        propose for, with the tokens they can take and their acceptance estimate; ``span``: the
        rows the forward covers (idle ones between included; default ``rows``)."""
        self._planned = None
        if not proposals and not drafting:
            return 1
        if not self.cost.decoded:  # a plain step first: what every pass is weighed against, in seconds
            return 1
        longest = max([len(p.tokens) for p in proposals.values()] + [room for room, _ in drafting.values()])
        if self.per_forward is not None:
            longest = min(longest, self.per_forward // (span or rows) - 1)
        # A pass must promise `MARGIN` more tokens per second than a decode step: estimates are
        # noisy, and a pass that only breaks even costs the rows' latency for nothing.
        best, best_rate = 1, rows / self.cost.cost(rows, 1) * (1.0 + MARGIN)
        draft_step = 0.0
        if self.drafter is not None and drafting:
            d, n = self.drafter, len(drafting)
            if d.cost.empty:  # nothing says what its steps cost here (weight bytes do not: a packed
                # draft of a float32 target holds the same bytes): measure a pass of 4 at once
                return min(longest + 1, 5)
            draft_step = d.cost.cost(n, 1)
        # Scaled by how passes delivered against their plan so far (`Realized`): a pass must pay
        # in what passes give here, not in what their parts promise.
        factor = self.realized.factor
        planned: dict[int, tuple[float, float]] = {}
        runner_up, runner_up_rate = 1, 0.0  # the best pass, paying or not
        for width in range(2, longest + 2):
            k = width - 1
            tokens = float(rows - len(proposals) - len(drafting))
            tokens += sum(expected_tokens(p.alpha, min(len(p.tokens), k)) for p in proposals.values())
            tokens += sum(expected_tokens(alpha, min(room, k)) for room, alpha in drafting.values())
            seconds = self.cost.cost(rows, width) + k * draft_step
            planned[width] = (tokens, seconds)
            rate = tokens / seconds * factor
            if rate > best_rate:
                best, best_rate = width, rate
            if rate > runner_up_rate:
                runner_up, runner_up_rate = width, rate
        if drafting:
            self._drafting_pays = best > 1
        if best == 1 and longest >= 1:
            self._skipped += 1
            if self._skipped >= PROBE_EVERY:  # costs and rates change: measure the best pass now and then
                best = runner_up
        if best > 1:
            self._skipped = 0
            self._planned = planned[best]
        return best

    def propose(
        self, requests: Sequence[Speculating], lengths: Mapping[int, int], room: int
    ) -> Proposed | None:
        """The verify pass of ``requests`` (decoding rows, in row order; ``lengths``: the tokens each
        row holds) when one pays, None when a plain decode step should run. ``room``: the tokens a
        pass may feed each row of its span (every row of a pass takes its width, padding included,
        so the running row nearest the end of the context, decoding or still reading its prompt,
        bounds everyone's). The draft model's rows are named, not drafted: the runner drafts them.

        A step with a row whose logits are processed (a constraint, a logit bias, a penalty:
        `infer.text.structured.RowProcessor`) is a plain decode step: the pass would have to verify
        proposals against processed logits, position by position."""
        if any(r.processor is not None for r in requests):
            return None
        t0 = time.perf_counter()
        proposals: dict[int, Proposal] = {}
        drafting: dict[int, tuple[int, float]] = {}
        most = room - 1
        for r in requests:
            state = self.row_state(r)
            take = min(self._room(r, lengths[r.row]), most) if state is not None else 0
            if state is None or take <= 0:
                continue
            p = self._lookup(r, take)
            alpha = state.acceptance.alpha(DRAFTED)
            if self.drafter is not None and (p is None or p.alpha < alpha):
                drafting[r.row] = (take, alpha)
            elif p is not None:
                proposals[r.row] = p
        span = requests[-1].row - requests[0].row + 1
        width = self.plan(len(requests), proposals, drafting, span)
        self._drafted = False
        if width == 1:
            return None
        for p in proposals.values():
            del p.tokens[width - 1 :]
        limits = {row: (min(width - 1, take), alpha) for row, (take, alpha) in drafting.items()}
        self._drafted = bool(limits)
        self._proposing = time.perf_counter() - t0  # (with the draft's seconds: `observe`)
        return Proposed(proposals, limits)

    def observe(self, rows: int, width: int, seconds: float, given: int | None = None) -> None:
        """A decode step (``width`` 1) or a verify pass of ``rows`` decoding rows took ``seconds``
        and gave ``given`` tokens (all its rows together)."""
        self.cost.observe(rows, width, seconds)
        if width > 1 and self._planned is not None and given is not None:
            tokens, predicted = self._planned
            proposing = self._proposing
            if self._drafted and self.drafter is not None:  # text the draft read once is not a pass's cost
                proposing += self.drafter.drafting
            self.realized.settle(given, tokens, seconds + proposing, predicted)
        self._planned = None
        self._drafted = False


__all__ = ["Proposal", "Proposed", "Speculator"]
