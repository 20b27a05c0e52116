"""One generation step — the model's walk on a static cache, the head, sampling — eager or compiled.

`model_step` is plain tensor code with fixed shapes for a given ``(batch, capacity,
tokens)``: positions, masks and cache writes come from tensors (`infer.cache`), the
head runs on each row's last real token only, and sampling takes its randomness as an
input (Gumbel noise drawn outside the step from the caller's ``torch.Generator``), so
nothing in it reads a tensor on the host. `Stepper` runs it eagerly (the exact
reference) or compiled whole with ``torch.compile(fullgraph=True)`` per bucket: the
same code either way.

Compiled on CPU it is inductor's C++ (the packed int4/int8 products stay torch's aten
kernels); on CUDA the step is also captured as a CUDA graph (``mode="reduce-overhead"``:
the cache tensors are marked static, so each bucket keeps one cache whose addresses do
not move). Layer streaming swaps weights between steps and always runs eagerly.

Inductor's caches live under ``infer.gguf.tokenizer.cache_root() / "inductor"`` (unless
``TORCHINDUCTOR_CACHE_DIR`` is set), so a second process skips the C++ compilation.
"""

from __future__ import annotations

import os
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from infer.cache import KVCache, round_up
from infer.models.base import DecoderLM

MIN_CAPACITY = 256  # compiled steps: cache capacities are powers of two from here
MIN_PREFILL = 16  # compiled prefill: prompt lengths are padded to powers of two from here


@dataclass(frozen=True)
class Sampling:
    """The static part of sampling (it selects the graph); the values are tensors in `SamplingValues`."""

    greedy: bool = True
    filtered: bool = False  # top-k and/or top-p


@dataclass
class SamplingValues:
    temperature: torch.Tensor  # [] float32
    top_k: torch.Tensor  # [] int64, 0 = off
    top_p: torch.Tensor  # [] float32, 1 = off


@dataclass
class StepOutput:
    tokens: torch.Tensor  # [B] int64
    logits: torch.Tensor  # [B, V] float32
    nonfinite: torch.Tensor  # [B] bool: a row's logits held NaN or +inf, or were all -inf


def sample(
    logits: torch.Tensor, mode: Sampling, values: SamplingValues | None, noise: torch.Tensor | None
) -> torch.Tensor:
    """One token per row of ``logits [B, V]`` (float32) -> ``[B]``.

    Greedy is ``argmax``. Otherwise the Gumbel-max trick: ``argmax(logits / temperature +
    noise)`` with ``noise = -log(Exp(1))`` samples from ``softmax(logits / temperature)``,
    restricted to the ``top_k`` highest and to the smallest set reaching ``top_p`` (the
    first always kept) when ``mode.filtered``.
    """
    if mode.greedy:
        return logits.argmax(dim=-1)
    assert values is not None and noise is not None
    scores = logits / values.temperature
    if not mode.filtered:
        return (scores + noise).argmax(dim=-1)
    V = scores.shape[-1]
    ordered, order = torch.sort(scores, dim=-1, descending=True)  # [B, V]
    rank = torch.arange(V, device=scores.device)
    keep = rank < torch.where(values.top_k > 0, values.top_k, V)
    ordered = ordered.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
    keep = (probs.cumsum(dim=-1) - probs) < values.top_p
    ordered = ordered.masked_fill(~keep, float("-inf"))
    pick = (ordered + noise.gather(-1, order)).argmax(dim=-1, keepdim=True)  # [B, 1]
    return order.gather(-1, pick)[:, 0]


def gumbel_noise(batch: int, vocab: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``-log(E)``, ``E ~ Exp(1)``, ``[batch, vocab]`` float32 from ``generator`` (outside any graph)."""
    e = torch.empty(batch, vocab, dtype=torch.float32, device=device).exponential_(generator=generator)
    return -torch.log(e.clamp_min(torch.finfo(torch.float32).tiny))


def model_step(
    model: DecoderLM,
    cache: KVCache,
    ids: torch.Tensor,
    n_new: torch.Tensor,
    last: torch.Tensor,
    mode: Sampling,
    values: SamplingValues | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``ids [B, T]`` through the model on ``cache`` (``n_new [B]`` real tokens per row,
    right-padded), then the head on each row's token ``last [B]`` and sampling.

    Returns ``(tokens [B], logits [B, V] float32, nonfinite [B])`` (see `StepOutput`).
    Tensors only: no host synchronization, no data-dependent branches.
    """
    h = model.hidden(ids, cache, None, n_new)  # [B, T, D]
    if ids.shape[1] > 1:
        h = h.gather(1, last[:, None, None].expand(-1, 1, h.shape[-1]))  # [B, 1, D]: one token per row
    return head_and_sample(model, h, mode, values, noise)


def head_and_sample(
    model: DecoderLM,
    h: torch.Tensor,
    mode: Sampling,
    values: SamplingValues | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Head and sampling for ``h [B, 1, D]``: ``(tokens, logits, nonfinite)``."""
    logits = model.head(h, greedy=mode.greedy)[:, 0].float()  # [B, V]
    # A row is bad when its maximum is NaN or +inf (NaN propagates through amax) or every logit is -inf.
    nonfinite = ~logits.amax(dim=-1).isfinite()  # [B]
    tokens = sample(logits, mode, values, noise)
    return tokens, logits, nonfinite


StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def enable_disk_cache() -> None:
    """Point inductor's (and triton's) on-disk caches at infer's cache directory, unless the
    user set them, and raise dynamo's per-function recompile limit to hold every bucket."""
    from infer.gguf.tokenizer import cache_root

    root = cache_root()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 64)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 512)


class Stepper:
    """Runs `model_step` for one resident model: eagerly, or compiled whole per bucket.

    ``compile=True``: ``torch.compile(model_step, fullgraph=True, dynamic=False)``; every
    distinct ``(batch, capacity, tokens, sampling mode)`` is one graph. Capacities are
    rounded to powers of two (from `MIN_CAPACITY`) and prefill lengths to powers of two
    (from `MIN_PREFILL`) so a few graphs serve every request; caches are kept per
    ``(batch, capacity)`` and reused. ``compile_seconds`` accumulates the time spent in
    first calls of new buckets.
    """

    def __init__(self, model: DecoderLM, compile: bool = False) -> None:
        self.model = model
        self.compiled = compile
        self.compile_seconds = 0.0
        self._seen: set[tuple[Any, ...]] = set()
        self._caches: dict[tuple[int, int], KVCache] = {}
        self._fn: StepFn = model_step
        if compile:
            enable_disk_cache()
            # A code object of its own: dynamo keeps its compiled entries per code object, and
            # these skip the ~900 guards on the model's modules (1.2 ms a step on SmolLM2) and
            # inductor's per-call size asserts, so they must never be tried on another model.
            fn = types.FunctionType(
                model_step.__code__.replace(co_name=f"model_step_{id(self):x}"),
                model_step.__globals__,
                name=model_step.__name__,
            )
            options: dict[str, Any] = {
                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                "size_asserts": False,
                "alignment_asserts": False,
            }
            if model.device.type == "cuda":  # CUDA graphs: one launch per step
                options["triton.cudagraphs"] = True
            self._fn = torch.compile(fn, fullgraph=True, dynamic=False, options=options)

    def capacity(self, needed: int) -> int:
        """KV slots for a request that needs ``needed``: exact when eager, a power-of-two bucket compiled."""
        if not self.compiled:
            return needed
        bucket = max(MIN_CAPACITY, 1 << (needed - 1).bit_length())
        return max(needed, min(bucket, round_up(self.model.config.max_position_embeddings, 64)))

    def prefill_length(self, longest: int) -> int:
        """Tokens per row of the prefill step (prompts are right-padded to it): the longest
        prompt when eager, a power of two from `MIN_PREFILL` when compiled."""
        if not self.compiled:
            return longest
        return max(MIN_PREFILL, 1 << (longest - 1).bit_length())

    def cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache: a fresh one when eager, the bucket's reused one when compiled."""
        if not self.compiled:
            return self.model.make_cache(batch, capacity)
        key = (batch, capacity)
        cache = self._caches.get(key)
        if cache is None:
            cache = self.model.make_cache(batch, capacity)
            if self.model.device.type == "cuda":
                for t in cache.tensors():
                    torch._dynamo.mark_static_address(t)
            self._caches[key] = cache
        else:
            cache.reset()
        return cache

    def __call__(
        self,
        cache: KVCache,
        ids: torch.Tensor,
        n_new: torch.Tensor,
        last: torch.Tensor,
        mode: Sampling,
        values: SamplingValues | None,
        noise: torch.Tensor | None,
    ) -> StepOutput:
        key = (ids.shape, cache.capacity, mode)
        first = self.compiled and key not in self._seen
        t0 = time.perf_counter()
        with torch.inference_mode():
            tokens, logits, nonfinite = self._fn(self.model, cache, ids, n_new, last, mode, values, noise)
        if first:
            self._seen.add(key)
            self.compile_seconds += time.perf_counter() - t0
        if self.compiled and cache.device.type == "cuda":  # outputs of a CUDA graph are overwritten next call
            tokens, logits, nonfinite = tokens.clone(), logits.clone(), nonfinite.clone()
        return StepOutput(tokens, logits, nonfinite)


__all__ = [
    "MIN_CAPACITY",
    "MIN_PREFILL",
    "Sampling",
    "SamplingValues",
    "StepOutput",
    "Stepper",
    "enable_disk_cache",
    "gumbel_noise",
    "head_and_sample",
    "model_step",
    "sample",
]
