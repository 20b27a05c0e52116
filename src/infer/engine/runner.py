"""The one place the engine runs a model: a plan's forwards over ranges of KV rows.

`Runner.run` runs each forward of an `infer.engine.plan.Plan` in order through the model's
`infer.execution.Execution` (a draft model, when there is one, first reads the prompts the plan
finishes and drafts what its verify passes ask for), each under the scope of the hooks of its
request (`infer.models.hooks.engine_forward`: None for none), and hands back what each gave
(`infer.engine.plan.Ran`); a forward that fails leaves its rows as they were. A parallel run's
rank 0 uses `infer.engine.parallel.Broadcasting`, which sends each plan to the other ranks first.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch

from infer.engine import chunks
from infer.engine.plan import Draw, Plan, Ran
from infer.execution import Execution, StepFeed, StepOutput
from infer.kv.cache import KVCache
from infer.kv.slots import KVSlots
from infer.models.base import DecoderLM
from infer.models.hooks import engine_forward
from infer.sampling import Sampling, SamplingValues
from infer.speculative import DRAFTED, Drafter, Proposal


class Runner:
    """Runs steps of ``slots``' rows with ``execution`` (`infer.execution.Execution`); ``drafter``: the
    draft model's side when the engine speculates with one (its steps run here, on its own slots)."""

    def __init__(
        self, slots: KVSlots[DecoderLM], execution: Execution | None = None, drafter: Drafter | None = None
    ) -> None:
        self.slots = slots
        self.model: DecoderLM = slots.model
        self.execution = execution if execution is not None else Execution(slots.model)
        self.drafter = drafter
        slots.bucketed = self.execution.bucketed

    def run(self, plan: Plan, draws: Sequence[Draw]) -> list[Ran]:
        """Run ``plan``'s forwards in order, each sampling with its ``draws`` entry. A forward that
        raises gives its exception (its rows as they were) and the others run."""
        self.draft(plan)
        self.send(plan)
        out: list[Ran] = []
        for forward, draw in zip(plan.forwards, draws, strict=True):
            t0 = time.perf_counter()
            try:
                with engine_forward(forward.hooks):
                    result = self.step(forward.lo, forward.hi, forward.feeds, draw.mode, draw.values,
                                       draw.noise, forward.pad_to)  # fmt: skip
            except Exception as e:
                out.append(Ran(draw, None, e))
                continue
            out.append(Ran(draw, result, None, time.perf_counter() - t0))
        return out

    def prompt_chunk(self) -> int:
        """The idle prompt chunk measured for this model on this CPU (`infer.engine.chunks`: the
        first block's forwards, run here, where the model runs; once per CPU and model shape)."""
        return chunks.prompt_chunk(self.execution.model)

    def draft(self, plan: Plan) -> None:
        """The draft model's part of ``plan``, before it runs: it reads the prompts the plan's chunks
        finish (`Forward.draft_reads`), and drafts each verify pass's ``drafting`` rows, whose
        proposals and feeds it completes."""
        d = self.drafter
        if d is None:
            return
        for f in plan.forwards:
            if f.draft_reads:
                d.catch_up(f.draft_reads)
            if not f.drafting:
                continue
            chosen = [f.requests[row] for row in sorted(f.drafting)]
            limits = {row: limit for row, (limit, _) in f.drafting.items()}
            for row, (tokens, q) in d.draft(chosen, limits, self.model.vocab_size).items():
                limit, alpha = f.drafting[row]
                if tokens[:limit]:
                    f.proposals[row] = Proposal(
                        tokens[:limit], DRAFTED, alpha, None if q is None else q[:limit]
                    )
                    f.feeds[row] = f.requests[row].pending + tokens[:limit]

    def send(self, plan: Plan) -> None:
        """Before a plan runs (a parallel run's rank 0 sends it to the other ranks)."""

    def step(
        self,
        lo: int,
        hi: int,
        feeds: dict[int, list[int]],
        mode: Sampling,
        values: SamplingValues | None,
        noise: torch.Tensor | None,
        pad_to: int = 0,
    ) -> StepOutput:
        """One forward over rows ``[lo, hi)``: row ``r`` in ``feeds`` is fed ``feeds[r]``, the others
        nothing. Each row's last fed token goes through the head and sampling; with
        ``mode.every_token`` (a verify pass) every fed token does, one output entry per fed token,
        row by row (logit ``i`` of a row predicts the token after its ``i``-th fed token).
        ``pad_to``: tokens per row (a compiled prefill's bucket), where every row has the room."""
        slots = self.slots
        T = max(len(t) for t in feeds.values())
        if pad_to > T and all(slots.length(r) + pad_to <= slots.context for r in range(lo, hi)):
            T = pad_to
        slots.fit(lo, hi, T, feeds)
        B = hi - lo
        rows = [feeds.get(r, []) for r in range(lo, hi)]
        device = self.model.device
        if T == 1:
            ids = torch.tensor([t or [0] for t in rows], dtype=torch.long).to(device)
        else:
            ids = torch.tensor([t + [0] * (T - len(t)) for t in rows], dtype=torch.long).to(device)  # [B, T]
        n_new = torch.tensor([len(t) for t in rows], dtype=torch.long).to(device)
        if mode.every_token:  # [N]: the flat positions b * T + j of every fed token
            flat = [b * T + j for b, t in enumerate(rows) for j in range(len(t))]
            last = torch.tensor(flat, dtype=torch.long).to(device)
        else:
            last = (n_new - 1).clamp_min(0)
        feed = StepFeed(ids, n_new, last, mode, values, noise)
        with self.guard(), self._bound(lo, hi, feeds) as view:
            assert view.batch_size == B
            return self.execution(view, feed)

    @contextlib.contextmanager
    def _bound(self, lo: int, hi: int, feeds: dict[int, list[int]]) -> Iterator[KVCache]:
        """The view of rows ``[lo, hi)`` for one forward; afterwards the rows hold ``feeds``, or, if
        the forward failed (after the cache advanced, in the head say), what they held before."""
        slots = self.slots
        view = slots.bind(lo, hi)
        try:
            yield view
        except BaseException:
            slots.restore(view, lo, hi)
            raise
        finally:
            view.shared = None
        slots.advance(feeds)

    def guard(self) -> contextlib.AbstractContextManager[None]:
        """Around each forward (a parallel run names a rank that stopped answering)."""
        return contextlib.nullcontext()

    def exact_logits(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The exact logits of vocabulary rows ``ids`` for one row's hidden state
        (`DecoderLM.exact_logits`)."""
        return self.model.exact_logits(hidden, ids)


__all__ = ["Runner"]
