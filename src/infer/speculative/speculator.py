"""`Speculator`: the engine's decode step when speculation is on: proposals (n-gram lookup, a draft
model), the pass width that pays, one verify pass, and the tokens it gives back (`Verified`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infer.runtime.step import (
    sample,
    sampling_inputs,
)
from infer.speculative.acceptance import (
    PassCost,
    expected_tokens,
    keep_matching,
    probabilities,
    rejection_sample,
)
from infer.speculative.draft import Drafter
from infer.speculative.settings import MARGIN, PROBE_EVERY, Speculative
from infer.speculative.state import DRAFTED, NgramIndex, SpecState

if TYPE_CHECKING:
    from infer.engine.request import Request
    from infer.engine.runner import Runner


@dataclass
class Verified:
    """What a verify pass gives one request: the tokens to take in order (the accepted proposals and
    the target's own next token), a non-finite flag per token and the logits they were drawn from
    (``[n, V]``: token ``i`` from row ``i``). The engine takes them until one ends the request, then
    hands back how many it took (`Speculator.settle`)."""

    request: Request
    tokens: list[int]
    nonfinite: list[bool]
    logits: torch.Tensor
    base: int  # the row's length before the pass
    proposal: Proposal | None
    leviathan: bool  # drawn by rejection sampling against a draft's distributions


@dataclass
class Proposal:
    tokens: list[int]
    kind: int  # the n-gram length that matched, or DRAFTED
    alpha: float
    q: torch.Tensor | None = None  # [k, V]: the draft's distributions (a sampled request's drafts)


class Speculator:
    """The engine's decode step when speculation is on (see the module's docstring).

    ``context``: the engine's bound on a row's tokens; ``per_forward``: tokens one forward may
    take (a streamed model's plan), None for any; ``draft_runner``: runs the draft model's steps on
    its own KV slots (made by the engine, as its own) when the settings name a draft model.
    """

    def __init__(
        self,
        config: Speculative,
        runner: Runner,
        context: int,
        per_forward: int | None,
        draft_runner: Runner | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.slots = runner.slots
        self.context = context
        self.per_forward = per_forward
        self.drafter = None
        if config.draft is not None and draft_runner is not None:
            self.drafter = Drafter(config.draft, draft_runner)
        self.vocab = runner.model.vocab_size
        self.cost = PassCost()  # the target's plain decode steps and verify passes
        self._skipped = 0  # passes skipped as too costly since the last one run
        self.counters: dict[str, float] = {
            "spec_passes": 0, "spec_proposed": 0, "spec_accepted": 0, "spec_tokens": 0, "spec_steps": 0,
        }  # fmt: skip

    # ---- per request ----------------------------------------------------------------------

    def row_state(self, r: Request) -> SpecState | None:
        """``r``'s state (made on first use), None when ``r`` does not speculate."""
        if r.spec is None:
            limit = self.config.max_tokens
            if r.params.speculative is not None:
                limit = min(limit, r.params.speculative)
            index = NgramIndex(self.config.lookup) if self.config.lookup else None
            r.spec = SpecState(limit, index)
        return r.spec if r.spec.limit > 0 and r.processor is None else None

    def _room(self, r: Request) -> int:
        """Proposals ``r`` can take this pass: its limit, its tokens left and the context."""
        state = r.spec
        assert state is not None
        left = r.max_new - len(r.generated) - 1  # the pass's last token needs no proposal
        room = min(state.limit, left, self.context - self.slots.length(r.row) - len(r.pending))
        if self.drafter is not None:
            room = min(room, self.drafter.room(r))
        return max(0, room)

    def _lookup(self, r: Request, room: int) -> Proposal | None:
        state = r.spec
        if state is None or state.index is None:
            return None
        state.index.sync(r.prompt, r.generated)
        tokens, n = state.index.propose(room)
        if not tokens:
            return None
        return Proposal(tokens, n, state.acceptance.alpha(n))

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
        if not proposals and not drafting:
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
        runner_up, runner_up_rate = 1, 0.0  # the best pass, paying or not
        for width in range(2, longest + 2):
            k = width - 1
            tokens = float(rows - len(proposals) - len(drafting))
            tokens += sum(expected_tokens(p.alpha, min(len(p.tokens), k)) for p in proposals.values())
            tokens += sum(expected_tokens(alpha, min(room, k)) for room, alpha in drafting.values())
            rate = tokens / (self.cost.cost(rows, width) + k * draft_step)
            if rate > best_rate:
                best, best_rate = width, rate
            if rate > runner_up_rate:
                runner_up, runner_up_rate = width, rate
        if best == 1 and longest >= 1:
            self._skipped += 1
            if self._skipped >= PROBE_EVERY:  # costs and rates change: measure the best pass now and then
                best = runner_up
        if best > 1:
            self._skipped = 0
        return best

    def decode(self, requests: list[Request], room: int) -> list[Verified] | None:
        """Run the decode step of ``requests`` (decoding rows, in row order) as a verify pass when
        one pays, and return each request's tokens (the caller takes them, then calls `settle`);
        None when a plain decode step should run instead (the caller times it with
        `observe_decode`). ``room``: the tokens a pass may feed each row of its span (every row of
        a pass takes its width, padding included, so the running row nearest the end of the
        context, decoding or still reading its prompt, bounds everyone's).

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
            room = min(self._room(r), most) if state is not None else 0
            if state is None or room <= 0:
                continue
            p = self._lookup(r, room)
            alpha = state.acceptance.alpha(DRAFTED)
            if self.drafter is not None and (p is None or p.alpha < alpha):
                drafting[r.row] = (room, alpha)
            elif p is not None:
                proposals[r.row] = p
        span = requests[-1].row - requests[0].row + 1
        width = self.plan(len(requests), proposals, drafting, span)
        if width == 1:
            return None
        for p in proposals.values():
            del p.tokens[width - 1 :]
        drafted_s = 0.0
        if drafting:
            assert self.drafter is not None
            t1 = time.perf_counter()
            chosen = [r for r in requests if r.row in drafting]
            limits = {row: min(width - 1, room) for row, (room, _) in drafting.items()}
            for row, (tokens, q) in self.drafter.draft(chosen, limits, self.vocab).items():
                room, alpha = drafting[row]
                if tokens[:room]:
                    proposals[row] = Proposal(tokens[:room], DRAFTED, alpha, None if q is None else q[:room])
            drafted_s = time.perf_counter() - t1
        verified = self._verify(requests, proposals)
        self.cost.observe(len(requests), width, time.perf_counter() - t0 - drafted_s)
        self.counters["spec_steps"] += 1
        return verified

    def observe_decode(self, rows: int, seconds: float) -> None:
        self.cost.observe(rows, 1, seconds)

    def _verify(self, requests: list[Request], proposals: dict[int, Proposal]) -> list[Verified]:
        slots = self.slots
        feeds = {r.row: r.pending + (proposals[r.row].tokens if r.row in proposals else []) for r in requests}
        lo, hi = requests[0].row, requests[-1].row + 1
        exact = any(r.params.logprobs is not None for r in requests)
        greedy_head = all(r.params.greedy for r in requests) and not exact
        base = {r.row: slots.length(r.row) for r in requests}  # never inside a shared prefix
        logits = self.runner.verify_rows(lo, hi, feeds, greedy=greedy_head)
        verified = []
        for r in requests:
            fed = feeds[r.row]
            rows = logits[r.row]  # [len(fed), V]
            proposal = proposals.get(r.row)
            drafts = fed[len(r.pending) :]
            leviathan = proposal is not None and proposal.q is not None
            if leviathan:
                assert proposal is not None and proposal.q is not None and r.noise is not None
                p = r.params
                target = probabilities(rows, p.temperature, p.top_k, p.top_p)
                out = rejection_sample(target, proposal.q, drafts, r.noise.generator)
            else:
                out = keep_matching(self._targets(r, rows), drafts)
            nonfinite: list[bool] = (~rows[: len(out)].amax(dim=-1).isfinite()).tolist()
            verified.append(Verified(r, out, nonfinite, rows, base[r.row], proposal, leviathan))
        return verified

    def settle(self, v: Verified, taken: int) -> None:
        """The engine took the first ``taken`` of ``v``'s tokens: roll the row back past the rest,
        give back the noise of the positions not taken and count the proposals' fate."""
        r = v.request
        if r.noise is not None and not v.leviathan:
            r.noise.drop(taken)
        self.slots.rollback(r.row, v.base + taken)
        proposal = v.proposal
        if proposal is not None:
            kept = len(v.tokens) - 1
            assert r.spec is not None
            r.spec.acceptance.update(proposal.kind, len(proposal.tokens), kept)
            c = self.counters
            c["spec_passes"] += 1
            c["spec_proposed"] += len(proposal.tokens)
            c["spec_accepted"] += kept
            c["spec_tokens"] += taken

    def _targets(self, r: Request, logits: torch.Tensor) -> list[int]:
        """The target's token at each fed position, drawn as the plain step draws it."""
        n = logits.shape[0]
        mode, values = sampling_inputs([r.params] * n, logits.device)
        noise = None if r.noise is None or mode.greedy else r.noise.peek(n)
        tokens: list[int] = sample(logits, mode, values, noise).tolist()
        return tokens

    def stats(self) -> dict[str, float]:
        c = self.counters
        out = {k: float(v) for k, v in c.items()}
        out["spec_acceptance"] = c["spec_accepted"] / c["spec_proposed"] if c["spec_proposed"] else 0.0
        out["spec_tokens_per_pass"] = c["spec_tokens"] / c["spec_passes"] if c["spec_passes"] else 0.0
        return out
