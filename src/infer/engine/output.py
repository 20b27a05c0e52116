"""What a step's sampled tokens do to their requests: `Outputs.take` checks a token (non-finite
logits, a constraint's verdict), computes its logprobs, ends the request on an EOS id, a completed
constraint or its length, and hands the token to the request's handle (which decodes the text and
finds stop strings: `infer.engine.request.RequestHandle`). `Outputs.finish` ends a request."""

from __future__ import annotations

import time

import torch

from infer.engine.request import Delta, Ending, Request, TokenLogprob
from infer.engine.scheduler import Scheduler
from infer.params import NonFiniteLogitsError


class Outputs:
    """The output stage of one engine (its scheduler frees the rows of ended requests)."""

    def __init__(self, scheduler: Scheduler, stats: dict[str, float]) -> None:
        self.scheduler = scheduler
        self.stats = stats

    def take(self, r: Request, token: int, nonfinite: bool, logits: torch.Tensor, index: int) -> bool:
        """Take one sampled token of ``r`` (drawn from ``logits[index]``); whether ``r`` goes on
        (an EOS id, a completed constraint, the length or an error ends it)."""
        now = time.perf_counter()
        n = len(r.generated) + 1
        if nonfinite:
            where = "prefill" if n == 1 else f"decode step {n - 1}"
            error = NonFiniteLogitsError(f"non-finite logits (NaN or inf) at {where} (generated token {n})")
            self.finish(r, "error", error)
            return False
        processor = r.processor
        if processor is not None and processor.error is not None:
            self.finish(r, "error", ValueError(f"{processor.error} (generated token {n})"))
            return False
        if n == 1:
            r.first = r.handle.first_token = now
        r.generated.append(token)
        self.scheduler.used[r.row] = now
        self.stats["generated_tokens"] += 1
        logprobs = None
        if r.params.logprobs is not None:
            lp = torch.log_softmax(logits[index].float(), dim=-1)
            top: list[tuple[int, float]] = []
            if r.params.logprobs > 0:
                values, ids = lp.topk(min(r.params.logprobs, lp.shape[-1]))
                top = list(zip(ids.tolist(), values.tolist(), strict=True))
            logprobs = [TokenLogprob(token, float(lp[token]), top)]
        complete = processor is not None and processor.accept(token)  # nothing but EOS may follow
        if processor is not None and processor.error is not None:
            refused = ValueError(f"{processor.error} (generated token {n})")
            self.finish(r, "error", refused, [token], logprobs)
            return False
        if token in r.eos:
            detail = "stop" if token in r.params.stop_token_ids else "eos"
            self.finish(r, "stop", None, [token], logprobs, detail)
            return False
        if complete or n >= r.max_new:
            reason = "stop" if complete else "length"
            self.finish(r, reason, None, [token], logprobs)
            return False
        r.pending = [token]
        r.handle.put(Delta([token], "", logprobs, None))
        return True

    def finish(
        self,
        r: Request,
        reason: str,
        error: BaseException | None = None,
        tokens: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
        detail: str | None = None,
    ) -> None:
        """End ``r`` with ``reason`` ("stop", "length", "error", "cancelled"): its row is free and its
        final event goes to its handle."""
        now = time.perf_counter()
        self.scheduler.release(r)
        start = r.started or now
        ending = Ending(detail or reason, error, (r.first or now) - start, now - r.first if r.first else 0.0)
        self.stats["finished"] += 1
        self.end(r, Delta(tokens or [], "", logprobs, reason, None if error is None else str(error)), ending)

    def end(self, r: Request, delta: Delta, ending: Ending | None = None) -> None:
        """Send ``r``'s final event (``delta`` has its finish reason)."""
        r.ended = True
        r.handle.put(delta, ending or Ending(delta.finish_reason or "cancelled", None, 0.0, 0.0))


__all__ = ["Outputs"]
