"""The sampling stage: what each forward of a plan samples with (`Sampler.draws`) and what its
rows get from its output (`Sampler.sample`): the step's tokens, a processed row drawn again on
the host (`resample_processed`), a verify pass's kept proposals (`infer.speculative.verified_tokens`).
How a row is sampled is `infer.sampling`'s."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from infer.engine.plan import Draw, Forward, Plan, Ran, Row, Sampled
from infer.engine.request import Request
from infer.execution import StepOutput
from infer.sampling import Sampling, gumbel_noise, sample_row, step_sampling
from infer.speculative import verified_tokens

RESCORED = 64  # a greedy processed row's best allowed tokens re-scored exactly (`resample_processed`)
# Greedy processed rows up to which a step keeps its greedy head; with more, the exact head (its cost
# grows less with the rows than the greedy scan's). Each re-scores its candidates with either head.
RESCORED_ROWS = 2

ExactLogits = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def exact_head(requests: Sequence[Request], exact_allowed: bool, verify: bool = False) -> bool:
    """Whether a forward of ``requests`` needs every logit exact, not only each row's argmax (which
    a packed head computes scanning less): logprobs, sampled processed rows, more than `RESCORED_ROWS`
    greedy processed rows (any when ``exact_allowed`` is false: a parallel run does not re-score,
    its head is whole anyway); a verify pass of any sampled row (its tokens are drawn
    from every position's logits on the host)."""
    if verify:
        return any(r.params.logprobs is not None or not r.params.greedy for r in requests)
    greedy_processed = sum(1 for r in requests if r.processor is not None and r.params.greedy)
    limit = RESCORED_ROWS if exact_allowed else 0
    return greedy_processed > limit or any(
        r.params.logprobs is not None or (r.processor is not None and not r.params.greedy) for r in requests
    )


class Sampler:
    """The sampling stage of one engine over ``model`` (its vocabulary and device); ``exact_logits``:
    a few vocabulary rows of the head, exactly (`Runner.exact_logits`), for greedy processed rows
    (None where the runner cannot: a parallel run's head is whole instead)."""

    def __init__(self, vocab: int, device: torch.device, exact_logits: ExactLogits | None) -> None:
        self.vocab = vocab
        self.device = device
        self.exact_logits = exact_logits

    def draws(self, plan: Plan) -> list[Draw]:
        """Each forward's sampling inputs, in order: its mode, values and noise (a verify pass samples
        on the host afterwards: greedy in the step)."""
        return [self._draw(f) for f in plan.forwards]

    def _draw(self, forward: Forward) -> Draw:
        if forward.kind == "verify":
            return Draw(Sampling(greedy=True, exact_head=forward.exact_head, every_token=True))
        requests = [forward.requests.get(row) for row in range(forward.lo, forward.hi)]

        def noise(i: int) -> torch.Tensor | None:
            r = requests[i]
            if r is None or r.generator is None:
                return None
            if r.noise is not None and forward.kind == "decode":
                return r.noise.peek(1)  # the next token's; the output stage drops what it took
            if r.noise is not None:
                return r.noise.take()
            return gumbel_noise(1, self.vocab, r.generator, self.device)

        params = [None if r is None else r.params for r in requests]
        return Draw(*step_sampling(params, noise, self.vocab, self.device, forward.exact_head))

    def sample(self, plan: Plan, ran: list[Ran]) -> list[Sampled]:
        """What each forward gives the rows that take tokens: a decode step's rows and the prompts a
        prefill chunk finishes one token each, a verify pass's rows their kept proposals and the
        target's own token. A forward that failed, or whose rows fail here, gives its exception."""
        out: list[Sampled] = []
        for forward, result in zip(plan.forwards, ran, strict=True):
            if result.error is not None or result.out is None:
                out.append(Sampled(error=result.error, seconds=result.seconds))
                continue
            try:
                if forward.kind == "verify":
                    rows = self._verified(forward, result.out)
                else:
                    rows = self._stepped(forward, result.out, result.draw)
            except Exception as e:
                out.append(Sampled(error=e, seconds=result.seconds))
                continue
            out.append(Sampled(rows, None, result.seconds))
        return out

    def _stepped(self, forward: Forward, out: StepOutput, draw: Draw) -> dict[int, Row]:
        tokens: list[int] = out.tokens.tolist()  # the step's host read
        bad: list[bool] = out.nonfinite.tolist()
        requests = [forward.requests.get(row) for row in range(forward.lo, forward.hi)]
        resample_processed(self.exact_logits, out, forward.lo, forward.feeds, requests, draw.noise, tokens)
        rows: dict[int, Row] = {}
        for row, r in forward.requests.items():
            j = row - forward.lo
            if len(forward.feeds[row]) == len(r.pending):  # its last fed token picks its next token
                rows[row] = Row([tokens[j]], [bad[j]], out.logits, [j])
        return rows

    def _verified(self, forward: Forward, out: StepOutput) -> dict[int, Row]:
        rows: dict[int, Row] = {}
        start = 0
        for row in range(forward.lo, forward.hi):
            fed = forward.feeds.get(row)
            if not fed:
                continue
            logits = out.logits[start : start + len(fed)]  # [len(fed), V]: after each fed token
            start += len(fed)
            r = forward.requests[row]
            proposal = forward.proposals.get(row)
            q = None if proposal is None else proposal.q
            tokens, leviathan = verified_tokens(r, logits, fed[len(r.pending) :], q)
            nonfinite: list[bool] = (~logits[: len(tokens)].amax(dim=-1).isfinite()).tolist()
            rows[row] = Row(tokens, nonfinite, logits, list(range(len(tokens))), leviathan)
        return rows


def resample_processed(
    exact_logits: ExactLogits | None,
    out: StepOutput,
    lo: int,
    feeds: dict[int, list[int]],
    requests: list[Request | None],
    noise: torch.Tensor | None,
    tokens: list[int],
) -> None:
    """Resample in ``tokens`` the rows that take a token this step and have a `RowProcessor`: their
    logits processed (penalties, bias) and drawn among the tokens the constraint allows, with the
    row's own values and the noise the step drew for it (`infer.sampling.sample_row`). A greedy row
    with ``exact_logits`` (`Runner.exact_logits`) re-scores its `RESCORED` best allowed tokens
    exactly and takes the best, the lowest id among equals; without it (a parallel run) the step's
    head is exact (`exact_head`). docs/structured.md, *The seam in the engine*, says why."""
    picked = [
        (j, r, r.processor) for j, r in enumerate(requests)
        if r is not None and r.processor is not None and len(feeds.get(lo + j, ())) == len(r.pending)
    ]  # fmt: skip
    if not picked:
        return
    index = torch.tensor([j for j, _, _ in picked], dtype=torch.long, device=out.logits.device)
    logits = out.logits.index_select(0, index)  # [k, V], a copy: logprobs read the raw logits
    for k, (j, r, processor) in enumerate(picked):
        allowed = processor.apply(logits[k])
        if processor.error is not None:
            continue  # the output stage ends the request
        if r.params.greedy and exact_logits is not None and out.hidden is not None:
            pool = logits[k] if allowed is None else logits[k, allowed]
            best = pool.topk(min(RESCORED, pool.shape[0])).indices
            ids = (best if allowed is None else allowed[best]).sort().values  # [K] candidates, ascending
            scores = processor.adjust(ids, exact_logits(out.hidden[j], ids))
            tokens[j] = int(ids[int(scores.argmax())])  # the first best: the lowest id, as in the vocabulary
            continue
        row = logits[k] if allowed is None else logits[k, allowed]  # [n]: the tokens it may pick
        drawn = None
        if not r.params.greedy and noise is not None:
            drawn = noise[j] if allowed is None else noise[j, allowed]
        pick = sample_row(row, r.params, drawn)
        tokens[j] = pick if allowed is None else int(allowed[pick])


__all__ = ["RESCORED", "RESCORED_ROWS", "Sampler", "exact_head", "resample_processed"]
