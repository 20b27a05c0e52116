"""Generation as free functions: prefill, one-token decode steps, sampling.

`generate_steps` drives any `DecoderLM` (resident or streamed): it left-pads a
batch of token-id prompts, prefills them into a preallocated `KVCache`, then
decodes one token per step and yields the new tokens of every row until each row
has stopped (EOS id, stop string, or ``max_new_tokens``).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from infer.models.base import DecoderLM

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes a 64-bit seed


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]``; `TypeError` for bools, floats and others."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    v = operator.index(value)
    if v < minimum or (maximum is not None and v > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {bound}, got {v}")
    return v


def check_float(name: str, value: Any) -> float:
    """``value`` as a finite float; `TypeError` for bools and non-numbers, `ValueError` for NaN/inf."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def check_max_new_tokens(value: Any) -> int:
    """``max_new_tokens`` is an int >= 1: a generation call always generates."""
    return check_int("max_new_tokens", value, 1)


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters.

    Values are checked (and normalized to int / float) on construction: ``temperature``
    finite and >= 0, ``top_k`` an int >= 0, ``top_p`` finite in (0, 1], ``seed`` None or
    an int in [0, 2**64 - 1].
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        temperature = check_float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
        top_p = check_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_k", check_int("top_k", self.top_k, 0))
        object.__setattr__(self, "top_p", top_p)
        if self.seed is not None:
            object.__setattr__(self, "seed", check_int("seed", self.seed, 0, SEED_MAX))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or infinite logits (non-finite weights, or overflow in float16/bfloat16)."""


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row from ``logits [B, V]`` -> ``[B]``."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_checked(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample`, and the same tokens with -1 in rows whose logits are not finite: ``([B], [B])``.

    A row is bad when its maximum is NaN or +inf (NaN propagates through ``amax``) or
    when every logit is -inf. The host reads the second tensor with the ``.tolist()``
    it needs for the tokens anyway, so the check costs no extra synchronization; the
    first (always a valid id) is what the model is fed.
    """
    ok = logits.amax(dim=-1).isfinite()  # [B]
    if not params.greedy:  # multinomial refuses NaN probabilities: sample bad rows from zeros
        logits = torch.where(ok[:, None], logits, 0.0)
    tokens = sample(logits, params, generator)
    return tokens, torch.where(ok, tokens, -1)


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


def context_limits(model: DecoderLM, batch: int) -> tuple[int, int | None]:
    """``(context, prefill chunk)`` for a batch: the model's context, capped by what the executor planned for.

    A streaming executor plans its memory for ``max_batch_size x max_context`` cached
    tokens and ``max_batch_size x max_prefill_tokens`` tokens per forward (batches
    trade with length); a resident model has no such limits (chunk None).
    """
    context = model.config.max_position_embeddings
    limits = model.executor.limits
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
) -> Iterator[list[RowState]]:
    """Yield the rows' states after every generated token (prefill included).

    Each row stops at one of ``eos_ids`` (kept as its last token), when
    ``stop_check`` says so, or after ``max_new_tokens``; stopped rows keep computing
    in the batch but their outputs are ignored.
    """
    import time

    max_new_tokens = check_max_new_tokens(max_new_tokens)
    if not prompts or not all(prompts):
        raise ValueError("every prompt needs at least one token")
    context, chunk = context_limits(model, len(prompts))
    longest = max(len(p) for p in prompts)
    if longest + 1 > context:
        raise ValueError(f"prompt has {longest} tokens; the model's context is {context} tokens")
    max_new_tokens = min(max_new_tokens, context - longest)
    rows = [RowState(len(p)) for p in prompts]
    device = model.device
    ids, pad = left_pad(prompts, pad_id)
    ids, pad = ids.to(device), pad.to(device)
    cache = model.make_cache(len(prompts), longest + max_new_tokens, pad=pad)
    generator = None
    if not params.greedy:
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed if params.seed is not None else torch.seed())
    eos = set(eos_ids)

    t0 = time.perf_counter()
    step = chunk or ids.shape[1]
    for start in range(0, ids.shape[1], step):  # chunked prefill when the executor asks for it
        h = model.forward_hidden(ids[:, start : start + step], cache)
    logits = model.head(h[:, -1:])[:, -1]  # [B, V]: only the last position is needed
    next_tokens, checked = sample_checked(logits, params, generator)
    if timings is not None:
        timings["prefill_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    for step in range(max_new_tokens):
        chosen = checked.tolist()
        for b, tok in enumerate(chosen):
            row = rows[b]
            if row.finish_reason is not None:
                continue
            if tok < 0:
                where = "prefill" if step == 0 else f"decode step {step}"
                raise NonFiniteLogitsError(
                    f"non-finite logits (NaN or inf) at {where} (generated token {step + 1}), batch row {b}: "
                    "the weights hold NaN/inf or the activations overflowed (try dtype=torch.float32)"
                )
            row.tokens.append(tok)
            if tok in eos:
                row.finish_reason = "eos"
            elif stop_check is not None and stop_check(b, row.tokens):
                row.finish_reason = "stop"
            elif len(row.tokens) >= max_new_tokens:
                row.finish_reason = "length"
        yield rows
        if all(r.finish_reason is not None for r in rows) or step == max_new_tokens - 1:
            break
        h = model.forward_hidden(next_tokens[:, None], cache)  # [B, 1, D]
        next_tokens, checked = sample_checked(model.head(h)[:, -1], params, generator)
    if timings is not None:
        timings["decode_s"] = time.perf_counter() - t1
        timings["decode_steps"] = float(max(len(r.tokens) for r in rows) - 1)


def run_to_end(steps: Iterator[list[RowState]]) -> list[RowState]:
    """Exhaust `generate_steps` and return the final row states."""
    rows: list[RowState] = []
    for state in steps:
        rows = state
    return rows
