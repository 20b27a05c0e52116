"""A step's sampling: what the step samples with (`step_sampling`) and the fix-ups of processed rows
(`resample_processed`: constraints, biases and penalties, sampled on the host after the step)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.engine.request import Request
from infer.engine.runner import Runner
from infer.params import SamplingParams
from infer.runtime.step import (
    Sampling,
    SamplingValues,
    StepOutput,
    gumbel_noise,
    sample,
    sampling_inputs,
    stack_noise,
)
from infer.text.structured import narrow

RESCORED = 64  # a greedy processed row's best allowed tokens re-scored exactly (`resample_processed`)
# Greedy processed rows in a step up to which they re-score their candidates; with more, the step
# computes the exact head (one product for every row costs less than many rows' re-scoring).
RESCORED_ROWS = 2
GREEDY = SamplingParams()


@dataclass
class RowValues:
    """One row's sampling values for a host-side draw (`resample_processed`)."""

    temperature: float
    top_k: int
    top_p: float


def step_sampling(
    requests: Sequence[Request | None], runner: Runner
) -> tuple[Sampling, SamplingValues | None, torch.Tensor | None]:
    """``(mode, values, noise)`` of a step whose rows run ``requests`` (None: a row fed nothing)."""
    model = runner.model
    params = [GREEDY if r is None else r.params for r in requests]
    # Logprobs and sampled processed rows need every logit exact (a greedy head is exact at the
    # argmax only); a few greedy processed rows re-score their best allowed candidates instead
    # (`resample_processed`), more of them make the step compute the exact head.
    live = [r for r in requests if r is not None]
    greedy_processed = sum(1 for r in live if r.processor is not None and r.params.greedy)
    limit = RESCORED_ROWS if runner.exact_logits_allowed else 0
    exact = greedy_processed > limit or any(
        r.params.logprobs is not None or (r.processor is not None and not r.params.greedy) for r in live
    )
    mode, values = sampling_inputs(params, model.device, exact_head=exact)
    if mode.greedy:
        return mode, values, None
    vocab, device = model.vocab_size, model.device
    rows: list[torch.Tensor | None] = []
    for r in requests:
        if r is None or r.generator is None:
            rows.append(None)
        elif r.noise is not None:  # speculation on: the rows a verify pass read ahead come first
            rows.append(r.noise.take())
        else:
            rows.append(gumbel_noise(1, vocab, r.generator, device))
    return mode, values, stack_noise(rows, vocab, device)


def resample_processed(
    runner: Runner,
    out: StepOutput,
    lo: int,
    feeds: dict[int, list[int]],
    requests: list[Request | None],
    noise: torch.Tensor | None,
    tokens: list[int],
    exact: bool = True,
) -> None:
    """Resample in ``tokens`` the rows that take a token this step and have a `RowProcessor`: their
    exact logits, processed (penalties, bias), sampled among the tokens the constraint allows
    with `sample`, the row's own values and the noise the step drew for it (so a seeded row
    draws as it would alone).

    A greedy step's logits (``exact`` false) are exact at each row's own argmax only (a packed
    head scans fewer bytes: `infer.quant.linear.QuantizedLinear.greedy`), so a greedy processed
    row takes its `RESCORED` best allowed tokens by those logits, computes their logits
    exactly from the step's hidden state (`Runner.exact_logits`), processes them again, and
    picks the best: exact arithmetic's choice whenever it is among those candidates (the head's
    own greedy scan ranks the exact winner within its first 51 on real text), at the cost of
    64 rows of the head instead of every one (Gemma 3: 262,144). With more than
    `RESCORED_ROWS` such rows the step's head is exact instead (`step_sampling`)."""
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
        if r.params.greedy and not exact and out.hidden is not None:
            pool = logits[k] if allowed is None else logits[k, allowed]
            best = pool.topk(min(RESCORED, pool.shape[0])).indices
            ids = best if allowed is None else allowed[best]  # [K] candidates
            scores = processor.adjust(ids, runner.exact_logits(out.hidden[j], ids))
            tokens[j] = int(ids[int(scores.argmax())])
            continue
        row = logits[k] if allowed is None else logits[k, allowed]  # [n]: the tokens it may pick
        p = r.params
        drawn = None
        if not p.greedy and noise is not None:
            drawn = noise[j] if allowed is None else noise[j, allowed]
        values = RowValues(p.temperature, p.top_k, p.top_p)
        narrowed = None if p.greedy else narrow(row, p.temperature, p.top_k, p.top_p)
        if narrowed is not None:  # a top-k / top-p draw: sort its candidates, not the vocabulary
            positions, values.top_p = narrowed
            row = row[positions]
            drawn = None if drawn is None else drawn[positions]
            allowed = positions if allowed is None else allowed[positions]
        mode, sampled = sampling_inputs([values], row.device)
        pick = int(sample(row[None], mode, sampled, None if drawn is None else drawn[None])[0])
        tokens[j] = pick if allowed is None else int(allowed[pick])


__all__ = ["RESCORED", "RESCORED_ROWS", "resample_processed", "step_sampling"]
