"""The output stage: what a plan's sampled tokens do to their requests.

`Outputs.take(plan, sampled)` checks each token a row gives (non-finite logits, a constraint's
verdict), computes its logprobs and hands it to the request's handle until one ends the request
(an EOS id, a completed constraint, its length); a row whose request took fewer tokens than it
was fed is rolled back to what it took (``Update.keep``). It writes the requests' own state only;
the scheduler applies the rest of the `Update`.
"""

from __future__ import annotations

import time

import torch

from infer.engine.plan import Ended, Forward, Pass, Plan, Row, Sampled, Update
from infer.engine.request import Request, TokenLogprob
from infer.params import NonFiniteLogitsError


class Outputs:
    """The output stage of one engine (see the module's docstring)."""

    def take(self, plan: Plan, sampled: list[Sampled]) -> Update:
        """Take what each of ``plan``'s forwards gave its requests (``sampled``, one per forward)."""
        update = Update()
        for forward, result in zip(plan.forwards, sampled, strict=True):
            if result.error is not None:  # the forward failed: its rows were left as they were
                update.ended += [Ended(r, "error", result.error) for r in forward.requests.values()]
                continue
            update.steps += 1
            if forward.kind == "prefill":
                self._prefill(forward, result, update)
            else:
                self._decode(forward, result, update)
        return update

    def _prefill(self, forward: Forward, result: Sampled, update: Update) -> None:
        for row, r in forward.requests.items():
            fed = len(forward.feeds[row])
            r.prefilled += fed
            update.prefilled += fed
            del r.pending[:fed]
            if not r.pending:  # the prompt is read: this step's logits pick the first token
                self._tokens(r, result.rows[row], update)

    def _decode(self, forward: Forward, result: Sampled, update: Update) -> None:
        if forward.hooks is None:  # (a hooked request's own step is no batch's cost)
            update.batch = len(forward.requests)
            update.verified = forward.kind == "verify"
        width = max(len(f) for f in forward.feeds.values())
        given = 0
        for row, r in forward.requests.items():
            got = result.rows[row]
            taken = self._tokens(r, got, update)
            given += taken
            if r.noise is not None and not got.leviathan:
                r.noise.drop(taken)  # the noise of positions not taken stays for the tokens that take them
            kept = forward.base[row] + taken
            if kept < forward.base[row] + len(forward.feeds[row]):
                update.keep[row] = kept
            proposal = forward.proposals.get(row)
            if proposal is not None:
                accepted = len(got.tokens) - 1
                assert r.spec is not None
                r.spec.acceptance.update(proposal.kind, len(proposal.tokens), accepted)
                update.passes.append(Pass(proposal.kind, len(proposal.tokens), accepted, taken))
        if forward.hooks is None:
            cost = (len(forward.requests), width if update.verified else 1, result.seconds, given)
            update.costs.append(cost)

    def _tokens(self, r: Request, got: Row, update: Update) -> int:
        """Take ``got``'s tokens for ``r`` in order until one ends it; how many it took."""
        taken, before = 0, len(r.generated)
        for i, token in enumerate(got.tokens):
            taken += 1
            ended = self._token(r, token, got.nonfinite[i], got.logits[got.index[i]])
            if ended is not None:
                update.ended.append(ended)
                break
        update.generated += len(r.generated) - before
        return taken

    def _token(self, r: Request, token: int, nonfinite: bool, logits: torch.Tensor) -> Ended | None:
        """Take one sampled token of ``r`` (drawn from ``logits [V]``); what ended ``r`` (an EOS id, a
        completed constraint, the length or an error), None when it goes on."""
        now = time.perf_counter()
        n = len(r.generated) + 1
        if nonfinite:
            where = "prefill" if n == 1 else f"decode step {n - 1}"
            error = NonFiniteLogitsError(f"non-finite logits (NaN or inf) at {where} (generated token {n})")
            return Ended(r, "error", error)
        processor = r.processor
        if processor is not None and processor.error is not None:
            return Ended(r, "error", ValueError(f"{processor.error} (generated token {n})"))
        if n == 1:
            r.first = now
        r.generated.append(token)
        logprobs = None
        if r.params.logprobs is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)
            top: list[tuple[int, float]] = []
            if r.params.logprobs > 0:
                values, ids = lp.topk(min(r.params.logprobs, lp.shape[-1]))
                top = list(zip(ids.tolist(), values.tolist(), strict=True))
            logprobs = [TokenLogprob(token, float(lp[token]), top)]
        complete = processor is not None and processor.accept(token)  # nothing but EOS may follow
        if processor is not None and processor.error is not None:
            refused = ValueError(f"{processor.error} (generated token {n})")
            return Ended(r, "error", refused, [token], logprobs)
        if token in r.eos:
            detail = "stop" if token in r.params.stop_token_ids else "eos"
            return Ended(r, "stop", None, [token], logprobs, detail)
        if complete or n >= r.max_new:
            return Ended(r, "stop" if complete else "length", None, [token], logprobs)
        r.pending = [token]
        r.emit([token], logprobs)
        return None


__all__ = ["Outputs"]
