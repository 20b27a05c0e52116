"""Requests run through the engine with the logits each token was drawn from, for tests and
benchmarks that compare them (a prompt alone and in a batch, compiled and eager steps).

`trace` runs prompts on a fresh `infer.engine.Engine` whose runner (`Recording`) keeps, per
request, the logits the engine sampled each token from, as it computed them (nothing run again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from infer.engine import Engine, Model, Runner, SamplingParams
from infer.engine.plan import Draw, Plan, Ran
from infer.execution import Execution
from infer.kv import KVSlots


@dataclass
class Traced:
    """One request's generation: its tokens, and the logits each was drawn from (row ``i`` picked
    ``tokens[i]``)."""

    tokens: list[int]
    logits: torch.Tensor  # [len(tokens), V] float32


class Recording(Runner):
    """A `Runner` that keeps, by request id, the logits each of the request's tokens was drawn from."""

    def __init__(self, slots: KVSlots[Any], execution: Execution) -> None:
        super().__init__(slots, execution)
        self.logits: dict[str, list[torch.Tensor]] = {}

    def run(self, plan: Plan, draws: Sequence[Draw]) -> list[Ran]:
        ran = super().run(plan, draws)
        for forward, result in zip(plan.forwards, ran, strict=True):
            if result.out is None:
                continue
            assert forward.kind != "verify", "a verify pass gives several tokens a row: see `trace`"
            for row, request in forward.requests.items():
                if len(forward.feeds[row]) == len(request.pending):  # its last fed token picks its next one
                    kept = self.logits.setdefault(request.handle.id, [])
                    kept.append(result.out.logits[row - forward.lo].clone())
        return ran


def trace(
    llm: Model,
    prompts: Sequence[list[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    execution: Execution | None = None,
    **options: Any,
) -> list[Traced]:
    """``prompts`` submitted together (one `SamplingParams`, or one each) to a fresh engine of
    ``llm`` (``options``: `Engine`'s keywords) whose steps ``execution`` runs (default
    ``llm.execution``); each prompt's tokens and logits, in order. A failed request raises its error.
    Speculative decoding must be off (a verify pass draws several tokens of a row from one forward)."""
    if llm.speculative is not None:
        raise ValueError(
            "trace: the model speculates (lookup or draft); load it without speculative decoding"
        )
    rows = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    runners: list[Recording] = []

    def runner(max_batch: int, context: int) -> Runner:
        slots = KVSlots(llm.model, max_batch, context, record=True)
        runners.append(Recording(slots, execution if execution is not None else llm.execution))
        return runners[-1]

    engine = Engine(llm, runner=runner, **options)
    try:
        handles = engine.submit_many(list(prompts), rows, text=False, wait=True, drive=True)
        for h in handles:
            for _ in h:
                pass
            if h.finish_detail == "error":
                raise h.exception or RuntimeError(f"trace: request {h.id} failed")
    finally:
        engine.close(drain=False)
    (recording,) = runners
    return [Traced(h.token_ids, torch.stack(recording.logits[h.id][: len(h.token_ids)])) for h in handles]


__all__ = ["Recording", "Traced", "trace"]
