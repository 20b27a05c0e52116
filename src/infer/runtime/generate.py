"""Generation as free functions: prefill, one-token decode steps, sampling.

`generate_steps` drives any `DecoderLM` (resident or streamed) through `infer.runtime.step`:
it right-pads a batch of token-id prompts, prefills them into a preallocated
`KVCache`, then decodes one token per step and yields the new tokens of every row
until each row has stopped (EOS id, stop string, or ``max_new_tokens``). Each step is
one `model_step` call (eager or compiled, see `Stepper`); the host reads the sampled
tokens once per step (the step also returns a per-row flag of non-finite logits).

Right padding keeps a prompt's tokens at the same cache slots alone and in any batch,
so in the deterministic mode (fixed product tiles, `infer.host.rows`, and
`infer.models.common.attend_tiled`) a prompt's tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import torch

from infer.kv.cache import KVCache
from infer.models.base import DecoderLM
from infer.params import SEED_MAX, NonFiniteLogitsError, SamplingParams, check_max_new_tokens, row_seed
from infer.runtime.step import (
    Sampling,
    SamplingValues,
    StepFeed,
    StepOutput,
    Stepper,
    head_and_sample,
    row_noise,
    sampling_inputs,
)


def row_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A row's own generator: seeded by ``seed``, or from torch's global seed when None."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else torch.seed())
    return generator


@dataclass
class RowState:
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos", "stop" or "length"


StopCheck = Callable[[int, list[int]], bool]  # (row, generated tokens) -> stop now?


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids [B, T]`` left-padded with ``pad_id``, and the pad count per row ``[B]``."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    pad = torch.zeros(len(prompts), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :] = torch.tensor(p, dtype=torch.long)
        pad[b] = T - len(p)
    return ids, pad


def right_pad(prompts: list[list[int]], pad_id: int, length: int) -> torch.Tensor:
    """``input_ids [B, length]``: each prompt from slot 0, then ``pad_id``."""
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
    return ids


def context_limits(model: DecoderLM, batch: int) -> tuple[int, int | None]:
    """``(context, prefill chunk)`` for a batch: the model's context, capped by what the executor planned for.

    A streaming executor plans its memory for ``max_batch_size x max_context`` cached
    tokens and ``max_batch_size x max_prefill_tokens`` tokens per forward (batches
    trade with length); a resident model has no such limits (chunk None).
    """
    context = model.config.max_position_embeddings
    limits = getattr(model.executor, "limits", None)
    if limits is None:
        return context, None
    slots = limits.max_batch_size * limits.max_context
    context = min(context, slots // batch)
    per_forward = limits.max_batch_size * limits.max_prefill_tokens
    chunk = min(per_forward // batch, per_forward * limits.max_context // max(1, batch * context))
    return context, max(1, chunk)


@torch.inference_mode()
def generate_steps(
    model: DecoderLM,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    params: SamplingParams,
    eos_ids: list[int],
    pad_id: int = 0,
    stop_check: StopCheck | None = None,
    timings: dict[str, float] | None = None,
    stepper: Stepper | None = None,
) -> Iterator[list[RowState]]:
    """Yield the rows' states after every generated token (prefill included).

    Each row stops at one of ``eos_ids`` (kept as its last token), when
    ``stop_check`` says so, or after ``max_new_tokens``; stopped rows keep computing
    in the batch but their outputs are ignored. ``stepper`` runs the steps (default:
    eagerly); a streaming model always runs eagerly.
    """
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    if not prompts or not all(prompts):
        raise ValueError("every prompt needs at least one token")
    context, _ = context_limits(model, len(prompts))
    longest = max(len(p) for p in prompts)
    if longest + 1 > context:
        raise ValueError(f"prompt has {longest} tokens; the model's context is {context} tokens")
    max_new_tokens = min(max_new_tokens, context - longest)
    rows = [RowState(len(p)) for p in prompts]
    if max_new_tokens <= 0:
        for r in rows:
            r.finish_reason = "length"
        return
    eos = set(eos_ids)
    outputs = step_outputs(
        model, prompts, max_new_tokens=max_new_tokens, params=params, pad_id=pad_id, stepper=stepper
    )
    t0 = time.perf_counter()
    t1 = t0
    for step, out in enumerate(outputs):
        chosen: list[int] = out.tokens.tolist()  # the step's one host read (out.nonfinite comes with it)
        if out.nonfinite.any():
            b = int(out.nonfinite.nonzero()[0, 0])
            where = "prefill" if step == 0 else f"decode step {step}"
            raise NonFiniteLogitsError(
                f"non-finite logits (NaN or inf) at {where} (generated token {step + 1}), batch row {b}: "
                "the weights hold NaN/inf or the activations overflowed (try dtype=torch.float32)"
            )
        if step == 0:
            t1 = time.perf_counter()
            if timings is not None:
                timings["prefill_s"] = t1 - t0
        for b, tok in enumerate(chosen):
            row = rows[b]
            if row.finish_reason is not None:
                continue
            row.tokens.append(tok)
            if tok in eos:
                row.finish_reason = "eos"
            elif stop_check is not None and stop_check(b, row.tokens):
                row.finish_reason = "stop"
            elif len(row.tokens) >= max_new_tokens:
                row.finish_reason = "length"
        yield rows
        if all(r.finish_reason is not None for r in rows):
            break
    outputs.close()
    if timings is not None:
        timings["decode_s"] = time.perf_counter() - t1
        timings["decode_steps"] = float(max(len(r.tokens) for r in rows) - 1)


def step_outputs(
    model: DecoderLM,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    params: SamplingParams,
    pad_id: int = 0,
    stepper: Stepper | None = None,
    exact_head: bool = False,
) -> Generator[StepOutput, None, None]:
    """The steps of a generation: the prefill's output, then one per decode step, ``max_new_tokens``
    in all (each step feeds the previous one's tokens). Close it to stop early. ``exact_head``:
    every logit exact (as for logprobs), not only each row's greedy choice."""
    B = len(prompts)
    _, chunk = context_limits(model, B)
    longest = max(len(p) for p in prompts)
    if stepper is None or stepper.model is not model or chunk is not None:
        stepper = Stepper(model)
    device = model.device
    T = stepper.prefill_length(longest) if chunk is None else max(2, longest)
    ids = right_pad(prompts, pad_id, T).to(device)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    cache = stepper.cache(B, stepper.capacity(max(T, longest + max_new_tokens)))
    mode, values = sampling_inputs([params] * B, device, exact_head=exact_head)
    generators: list[torch.Generator | None] = [None] * B
    if not mode.greedy:
        seed = params.seed if params.seed is not None else torch.seed() % (SEED_MAX + 1)
        generators = [row_generator(row_seed(seed, b), device) for b in range(B)]
    vocab = model.vocab_size

    def noise() -> torch.Tensor | None:
        return row_noise(generators, vocab, device)

    if chunk is None:
        out = stepper(cache, StepFeed(ids, lengths, lengths - 1, mode, values, noise()))
    else:  # a streamed model: prefill in the chunks its plan has memory for, the head once
        out = StepOutput(*_chunked_prefill(model, cache, ids, lengths, chunk, mode, values, noise()))
    cache.length = longest
    yield out
    ones = torch.ones(B, dtype=torch.long, device=device)
    zeros = torch.zeros(B, dtype=torch.long, device=device)
    for _ in range(max_new_tokens - 1):
        cache.check(1)
        out = stepper(cache, StepFeed(out.tokens[:, None], ones, zeros, mode, values, noise()))
        cache.length += 1
        yield out


def _chunked_prefill(
    model: DecoderLM,
    cache: KVCache,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    chunk: int,
    mode: Sampling,
    values: SamplingValues | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = ids.shape[1]
    last = torch.zeros(ids.shape[0], 1, model.config.hidden_size, dtype=model.dtype, device=ids.device)
    for start in range(0, T, chunk):
        stop = min(T, start + chunk)
        cache.length = start  # the slots in use before this chunk (an upper bound for every row)
        h = model.hidden(ids[:, start:stop], cache, None, (lengths - start).clamp(0, stop - start))
        index = (lengths - 1 - start).clamp(0, stop - start - 1)
        here = ((lengths - 1 >= start) & (lengths - 1 < stop))[:, None, None]  # the row's last token is here
        last = torch.where(here, h.gather(1, index[:, None, None].expand(-1, 1, h.shape[-1])), last)
    return head_and_sample(model, last, mode, values, noise)


def run_to_end(steps: Iterator[list[RowState]]) -> list[RowState]:
    """Exhaust `generate_steps` and return the final row states."""
    rows: list[RowState] = []
    for state in steps:
        rows = state
    return rows


__all__ = [
    "NonFiniteLogitsError",
    "RowState",
    "SamplingParams",
    "check_max_new_tokens",
    "context_limits",
    "generate_steps",
    "left_pad",
    "right_pad",
    "row_generator",
    "run_to_end",
    "step_outputs",
]
