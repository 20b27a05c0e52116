"""Generation as free functions: prefill, one-token decode steps, sampling.

`generate_steps` drives any `DecoderLM` (resident or streamed): it left-pads a
batch of token-id prompts, prefills them into a preallocated `KVCache`, then
decodes one token per step and yields the new tokens of every row until each row
has stopped (EOS id, stop string, or ``max_new_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from infer.models.base import DecoderLM


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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

    context, chunk = context_limits(model, len(prompts))
    longest = max(len(p) for p in prompts)
    if longest + 1 > context:
        raise ValueError(f"prompt has {longest} tokens; the model's context is {context} tokens")
    max_new_tokens = min(max_new_tokens, context - longest)
    rows = [RowState(len(p)) for p in prompts]
    if max_new_tokens <= 0:
        for r in rows:
            r.finish_reason = "length"
        return
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
    next_tokens = sample(logits, params, generator)
    if timings is not None:
        timings["prefill_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    for step in range(max_new_tokens):
        chosen = next_tokens.tolist()
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
        if all(r.finish_reason is not None for r in rows) or step == max_new_tokens - 1:
            break
        h = model.forward_hidden(next_tokens[:, None], cache)  # [B, 1, D]
        next_tokens = sample(model.head(h)[:, -1], params, generator)
    if timings is not None:
        timings["decode_s"] = time.perf_counter() - t1
        timings["decode_steps"] = float(max(len(r.tokens) for r in rows) - 1)


def run_to_end(steps: Iterator[list[RowState]]) -> list[RowState]:
    """Exhaust `generate_steps` and return the final row states."""
    rows: list[RowState] = []
    for state in steps:
        rows = state
    return rows
