"""The one place the engine runs the model: a step over a range of KV rows.

`Runner.step` (a decode step or a prefill chunk: each row's last fed token through the head and
sampling), `Runner.verify_rows` (the logits after every fed token: speculative verify passes)
and `Runner.exact_logits` (a few vocabulary rows of the head, exactly). Each takes the rows'
view from `KVSlots` and tells it what was written; a step that fails leaves the rows as they
were. A parallel run's rank 0 uses `infer.engine.parallel.Broadcasting`, which sends each step
to the other ranks before running it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from infer.engine.slots import KVSlots
from infer.models.base import DecoderLM
from infer.models.cache import KVCache
from infer.runtime.step import Sampling, SamplingValues, StepFeed, StepOutput, Stepper


class Runner:
    """Runs steps of ``slots``' rows with ``stepper`` (eager, compiled or packaged: `infer.runtime.step`)."""

    def __init__(self, slots: KVSlots, stepper: Stepper | None = None) -> None:
        self.slots = slots
        self.model: DecoderLM = slots.model
        self.stepper = stepper if stepper is not None else Stepper(slots.model)
        slots.bucketed = self.stepper.bucketed

    @property
    def compiled(self) -> bool:
        return self.stepper.compiled

    @property
    def exact_logits_allowed(self) -> bool:
        """Whether `exact_logits` may run (a parallel run computes the whole head instead)."""
        return True

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
        """One forward over rows ``[lo, hi)``: row ``r`` in ``feeds`` is fed ``feeds[r]``, the
        others nothing; each row's last fed token goes through the head and sampling."""
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
        last = (n_new - 1).clamp_min(0)
        feed = StepFeed(ids, n_new, last, mode, values, noise)
        self.before_step(lo, hi, feeds, mode, pad_to)
        with self.forward(), self._bound(lo, hi, feeds) as view:
            assert view.batch_size == B
            return self.stepper(view, feed)

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

    def before_step(self, lo: int, hi: int, feeds: dict[int, list[int]], mode: Sampling, pad_to: int) -> None:
        """Called before each step runs (a parallel run's rank 0 sends it to the other ranks)."""

    def forward(self) -> contextlib.AbstractContextManager[None]:
        """Around each forward (a parallel run names a rank that stopped answering)."""
        return contextlib.nullcontext()

    def verify(self, row: int, tokens: Sequence[int]) -> torch.Tensor:
        """Feed ``tokens`` (k >= 1) to ``row`` in one step; the logits after each: ``[k, V]`` float32.

        Logit ``i`` predicts the token after ``tokens[i]``. Roll back with `KVSlots.rollback`.
        """
        if len(tokens) < 1:
            raise ValueError("verify: tokens must hold at least one token")
        return self.verify_rows(row, row + 1, {row: list(tokens)})[row]

    @torch.inference_mode()
    def verify_rows(
        self, lo: int, hi: int, feeds: dict[int, list[int]], greedy: bool = False
    ) -> dict[int, torch.Tensor]:
        """One forward over rows ``[lo, hi)``: row ``r`` in ``feeds`` is fed ``feeds[r]`` (>= 1
        token), the others nothing; the logits after every fed token, ``{r: [len(feeds[r]), V]}``
        float32 (logit ``i`` predicts the token after ``feeds[r][i]``). ``greedy``: only each
        row's argmax must be exact (a packed head then scans less). A step with every fed token
        through the head (``Sampling.every_token``): from its package where one serves its shape
        (`infer.aot`), else eagerly like a prefill chunk (rows read their shared prefixes as a
        step does); in the deterministic mode each row's logits are bitwise its one-token steps'."""
        slots = self.slots
        T = max(len(t) for t in feeds.values())
        slots.fit(lo, hi, T, feeds)
        rows = [feeds.get(r, []) for r in range(lo, hi)]
        device = self.model.device
        ids = torch.tensor([t + [0] * (T - len(t)) for t in rows], dtype=torch.long).to(device)  # [B, T]
        n_new = torch.tensor([len(t) for t in rows], dtype=torch.long).to(device)
        fed = torch.tensor([b * T + j for b, t in enumerate(rows) for j in range(len(t))], dtype=torch.long)
        mode = Sampling(greedy=True, exact_head=not greedy, every_token=True)
        feed = StepFeed(ids, n_new, fed.to(device), mode, None, None)
        self.before_step(lo, hi, feeds, mode, 0)
        with self.forward(), self._bound(lo, hi, feeds) as view:
            logits = self.stepper(view, feed).logits  # [N, V]: the fed tokens, row by row
        out: dict[int, torch.Tensor] = {}
        start = 0
        for r in range(lo, hi):
            t = feeds.get(r)
            if t:
                out[r] = logits[start : start + len(t)]
                start += len(t)
        return out

    def exact_logits(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The exact logits of vocabulary rows ``ids`` for one row's hidden state
        (`DecoderLM.exact_logits`)."""
        return self.model.exact_logits(hidden, ids)


__all__ = ["Runner"]
