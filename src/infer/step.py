"""One generation step — the model's walk on a static cache, the head, sampling — eager or compiled.

`model_step` is plain tensor code with fixed shapes for a given ``(batch, capacity,
tokens)``: positions, masks and cache writes come from tensors (`infer.cache`), the
head runs on each row's last real token only, and sampling (`sample`, the one sampling
function of infer) takes per-row values and its randomness as inputs (Gumbel noise drawn
outside the step from each row's own ``torch.Generator``), so nothing in it reads a
tensor on the host. `Stepper` runs it eagerly (the exact reference) or compiled whole
with ``torch.compile(fullgraph=True)`` per bucket: the same code either way.

Compiled on CPU it is inductor's C++ (the packed int4/int8 products stay torch's aten
kernels). Layer streaming swaps weights between steps and always runs eagerly.
Compilation settings are scoped to infer's own compiled function: its options go to
``torch.compile(options=...)`` and dynamo's recompile limits are raised with
``torch._dynamo.config.patch`` around infer's calls only; nothing is written to
``os.environ`` or to torch's process-wide configuration. Inductor's on-disk cache is
torch's default (``TORCHINDUCTOR_CACHE_DIR`` if the user set it).

``compile="auto"`` (opt-in; `infer.api.compile_by_default` says why): steps run eagerly, and
once a process has spent `AUTO_AFTER_S` seconds in eager decode steps with more work ahead
(the engine decides: `Stepper.compile_in_background`), the decode step of that shape is
compiled on a background thread against a scratch cache of the same shape; from then on
that shape's decode steps run compiled. Prefill stays eager. A short generation never pays
for a compiler; a long session, a chat or a server gets the compiled decode after a warm-up.
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import torch

from infer.cache import KVCache, round_up
from infer.models.base import DecoderLM

MIN_CAPACITY = 256  # compiled steps: cache capacities are powers of two from here
MIN_PREFILL = 16  # compiled prefill: prompt lengths are padded to powers of two from here
# Dynamo's per-function recompile limits while infer's compiled step runs: every bucket
# (batch x capacity x tokens x sampling mode) is one graph of that one function.
RECOMPILE_LIMIT, ACCUMULATED_RECOMPILE_LIMIT = 64, 512
AUTO_AFTER_S = 10.0  # compile="auto": eager decode seconds of a stepper before a background compile
AUTO_SCRATCH_BYTES = 512 << 20  # compile="auto": the largest scratch KV cache a background compile makes
AUTO_EXIT_WAIT_S = 120.0  # at interpreter exit: how long to wait for a background compile to end

_STEPPERS: weakref.WeakSet[Stepper] = weakref.WeakSet()
_EXITING = False


@atexit.register
def _wait_for_compiles() -> None:
    """No thread may be inside dynamo or inductor while the interpreter finalizes."""
    global _EXITING
    _EXITING = True  # a compile cut short by the exit is no news
    try:
        for stepper in list(_STEPPERS):
            worker = stepper._worker
            if worker is not None:
                worker.join(AUTO_EXIT_WAIT_S)
    except KeyboardInterrupt:  # a second Ctrl-C: exit now, without a traceback
        pass


@dataclass(frozen=True)
class Sampling:
    """The static part of a step's sampling (it selects the compiled graph); values are `SamplingValues`."""

    greedy: bool = True  # every row is greedy: argmax only
    filtered: bool = False  # some row uses top-k and/or top-p
    exact_head: bool = False  # every logit must be exact (logprobs), not only each row's argmax


@dataclass
class SamplingValues:
    """Per-row sampling values, ``[B]`` each."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy row
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off


class RowSampling(Protocol):
    """What `sampling_inputs` reads of a row's parameters (`infer.generate.SamplingParams` has it)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...


class StepFeed(NamedTuple):
    """What one step is fed beside the model and its cache: the tokens, and how to sample.

    ``ids [B, T]`` int64, right-padded; ``n_new [B]`` the real tokens of each row; ``last [B]``
    the position (in ``T``) of each row's token that goes through the head; ``mode`` the
    static part of sampling (with the shapes, it selects the compiled graph); ``values`` the
    per-row sampling values and ``noise [B, V]`` the Gumbel noise (both None when greedy).
    A tuple of tensors and constants: `torch.compile` takes it as it takes them one by one.
    """

    ids: torch.Tensor
    n_new: torch.Tensor
    last: torch.Tensor
    mode: Sampling
    values: SamplingValues | None
    noise: torch.Tensor | None


@dataclass
class StepOutput:
    tokens: torch.Tensor  # [B] int64
    logits: torch.Tensor  # [B, V] float32
    nonfinite: torch.Tensor  # [B] bool: a row's logits held NaN or +inf, or were all -inf


def sampling_inputs(
    rows: Sequence[RowSampling], device: torch.device, exact_head: bool = False
) -> tuple[Sampling, SamplingValues | None]:
    """The static mode and the per-row values of ``rows`` (None when every row is greedy)."""
    greedy = all(r.temperature == 0.0 for r in rows)
    if greedy:
        return Sampling(greedy=True, exact_head=exact_head), None
    filtered = any(r.temperature > 0.0 and (r.top_k > 0 or r.top_p < 1.0) for r in rows)
    values = SamplingValues(
        temperature=torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=device),
        top_k=torch.tensor([r.top_k for r in rows], dtype=torch.long, device=device),
        top_p=torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device),
    )
    return Sampling(greedy=False, filtered=filtered, exact_head=exact_head), values


def sample(
    logits: torch.Tensor, mode: Sampling, values: SamplingValues | None, noise: torch.Tensor | None
) -> torch.Tensor:
    """One token per row of ``logits [B, V]`` (float32) -> ``[B]``, each row by its own values.

    A row with temperature 0 is greedy (``argmax``). Otherwise the Gumbel-max trick:
    ``argmax(logits / temperature + noise)`` with ``noise = -log(Exp(1))`` samples from
    ``softmax(logits / temperature)``, restricted to the row's ``top_k`` highest and to the
    smallest set reaching its ``top_p`` (the first always kept) when the row filters. A
    row's token depends on its own logits, values and noise only: the other rows'
    settings select which of the per-row results are computed, never change one.
    """
    greedy = logits.argmax(dim=-1)  # [B]
    if mode.greedy:
        return greedy
    assert values is not None and noise is not None
    t = values.temperature[:, None]  # [B, 1]
    scores = logits / torch.where(t > 0, t, 1.0)
    drawn = (scores + noise).argmax(dim=-1)  # [B]
    if mode.filtered:
        V = scores.shape[-1]
        ordered, order = torch.sort(scores, dim=-1, descending=True)  # [B, V]
        rank = torch.arange(V, device=scores.device)
        top_k = values.top_k[:, None]  # [B, 1]
        keep = rank < torch.where(top_k > 0, top_k, V)
        ordered = ordered.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        keep = (probs.cumsum(dim=-1) - probs) < values.top_p[:, None]
        ordered = ordered.masked_fill(~keep, float("-inf"))
        pick = (ordered + noise.gather(-1, order)).argmax(dim=-1, keepdim=True)  # [B, 1]
        filters = (values.top_k > 0) | (values.top_p < 1.0)  # [B]
        drawn = torch.where(filters, order.gather(-1, pick)[:, 0], drawn)
    return torch.where(values.temperature > 0, drawn, greedy)


def gumbel_noise(batch: int, vocab: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``-log(E)``, ``E ~ Exp(1)``, ``[batch, vocab]`` float32 from ``generator`` (outside any graph)."""
    e = torch.empty(batch, vocab, dtype=torch.float32, device=device).exponential_(generator=generator)
    return -torch.log(e.clamp_min(torch.finfo(torch.float32).tiny))


def model_step(
    model: DecoderLM, cache: KVCache, feed: StepFeed
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``feed.ids [B, T]`` through the model on ``cache`` (``feed.n_new [B]`` real tokens per
    row, right-padded), then the head on each row's token ``feed.last [B]`` and sampling.

    Returns ``(tokens [B], logits [B, V] float32, nonfinite [B])`` (see `StepOutput`).
    Tensors only: no host synchronization, no data-dependent branches.
    """
    ids, last = feed.ids, feed.last
    h = model.hidden(ids, cache, None, feed.n_new)  # [B, T, D]
    if ids.shape[1] > 1:
        h = h.gather(1, last[:, None, None].expand(-1, 1, h.shape[-1]))  # [B, 1, D]: one token per row
    return head_and_sample(model, h, feed.mode, feed.values, feed.noise)


def head_and_sample(
    model: DecoderLM,
    h: torch.Tensor,
    mode: Sampling,
    values: SamplingValues | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Head and sampling for ``h [B, 1, D]``: ``(tokens, logits, nonfinite)``."""
    logits = model.head(h, greedy=mode.greedy and not mode.exact_head)[:, 0].float()  # [B, V]
    # A row is bad when its maximum is NaN or +inf (NaN propagates through amax) or every logit is -inf.
    nonfinite = ~logits.amax(dim=-1).isfinite()  # [B]
    tokens = sample(logits, mode, values, noise)
    return tokens, logits, nonfinite


StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class Stepper:
    """Runs `model_step` for one resident model: eagerly, or compiled whole per bucket.

    ``compile=True``: ``torch.compile(model_step, fullgraph=True, dynamic=False)``; every
    distinct ``(batch, capacity, tokens, sampling mode)`` is one graph. Capacities are
    rounded to powers of two (from `MIN_CAPACITY`) and prefill lengths to powers of two
    (from `MIN_PREFILL`) so a few graphs serve every request. The stepper holds no cache:
    each caller passes its own (the engine owns its KV slots), so two generations never
    share one. ``compile_seconds`` accumulates the time spent in first calls of new buckets.
    """

    def __init__(self, model: DecoderLM, compile: bool | Literal["auto"] = False) -> None:
        if not isinstance(compile, bool) and compile != "auto":
            raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
        self.model = model
        self.compiled = compile is True  # every step compiled
        self.auto = compile == "auto"  # decode steps compiled in the background once they pay
        self.compile_seconds = 0.0
        self.eager_decode_seconds = 0.0  # auto: time spent in eager decode steps so far
        self.auto_after_s = AUTO_AFTER_S  # auto: eager decode seconds before compiling pays
        self._seen: set[tuple[Any, ...]] = set()
        self._ready: set[tuple[Any, ...]] = set()  # auto: decode keys compiled
        self._tried: set[tuple[Any, ...]] = set()  # auto: decode keys compiled or being compiled
        self._worker: threading.Thread | None = None
        self._fn: StepFn = model_step
        _STEPPERS.add(self)
        if self.compiled:  # (auto: at its first compile, so that loading never imports dynamo)
            self._fn = self._compile_fn()

    def _compile_fn(self) -> StepFn:
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
        return torch.compile(fn, fullgraph=True, dynamic=False, options=options)

    def capacity(self, needed: int) -> int:
        """KV slots for a request that needs ``needed``: exact when eager, a power-of-two bucket compiled."""
        if not self.compiled:
            return needed
        bucket = max(MIN_CAPACITY, 1 << (needed - 1).bit_length())
        return max(needed, min(bucket, round_up(self.model.config.max_position_embeddings, 64)))

    def prefill_length(self, longest: int) -> int:
        """Tokens per row of a prefill step (prompts are right-padded to it): the longest
        prompt when eager, a power of two from `MIN_PREFILL` when compiled."""
        if not self.compiled:
            return longest
        return max(MIN_PREFILL, 1 << (longest - 1).bit_length())

    def cache(self, batch: int, capacity: int) -> KVCache:
        """A new empty cache of ``batch`` rows (never shared between generations)."""
        return self.model.make_cache(batch, capacity)

    def __call__(self, cache: KVCache, feed: StepFeed) -> StepOutput:
        """One step of ``feed`` on ``cache``: eagerly, or through the compiled function."""
        decode = feed.ids.shape[1] == 1
        if not self.compiled:
            if self.auto and decode:
                if self._key(cache, feed) in self._ready:
                    return self._compiled(cache, feed)
                t0 = time.perf_counter()
            with torch.inference_mode():
                out = StepOutput(*model_step(self.model, cache, feed))
            if self.auto and decode:
                self.eager_decode_seconds += time.perf_counter() - t0
            return out
        key = self._key(cache, feed)
        first = key not in self._seen
        t0 = time.perf_counter()
        out = self._compiled(cache, feed)
        if first:
            self._seen.add(key)
            self.compile_seconds += time.perf_counter() - t0
        return out

    @staticmethod
    def _key(cache: KVCache, feed: StepFeed) -> tuple[Any, ...]:
        return (feed.ids.shape, cache.capacity, feed.mode)

    def _compiled(self, cache: KVCache, feed: StepFeed) -> StepOutput:
        """The compiled function on ``(cache, feed)``, with infer's recompile limits."""
        with (
            torch.inference_mode(),
            torch._dynamo.config.patch(
                recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=ACCUMULATED_RECOMPILE_LIMIT
            ),
        ):
            return StepOutput(*self._fn(self.model, cache, feed))

    @property
    def compiling(self) -> bool:
        """Whether a background compile (``compile="auto"``) is running."""
        return self._worker is not None and self._worker.is_alive()

    def compile_in_background(self, cache: KVCache, feed: StepFeed) -> bool:
        """``compile="auto"``: compile the decode step of this shape on a background thread
        (one at a time), against a scratch cache like ``cache`` and a scratch copy of ``feed``;
        whether one started. Shapes whose scratch cache would pass `AUTO_SCRATCH_BYTES` stay eager."""
        key = self._key(cache, feed)
        if not self.auto or feed.ids.shape[1] != 1 or key in self._tried or self.compiling:
            return False
        self._tried.add(key)
        if cache.nbytes > AUTO_SCRATCH_BYTES:
            return False
        if self._fn is model_step:
            self._fn = self._compile_fn()
        scratch = cache.empty_like()
        ids, values, noise = feed.ids, feed.values, feed.noise
        if values is not None:
            values = dataclasses.replace(
                values, **{f.name: getattr(values, f.name).clone() for f in dataclasses.fields(values)}
            )
        B = ids.shape[0]
        scratch_feed = feed._replace(
            ids=torch.zeros_like(ids),
            n_new=torch.ones(B, dtype=torch.long, device=ids.device),
            last=torch.zeros(B, dtype=torch.long, device=ids.device),
            values=values,
            noise=None if noise is None else noise.clone(),
        )
        self._worker = threading.Thread(
            target=self._compile, args=(key, scratch, scratch_feed), name="infer-compile", daemon=True
        )
        self._worker.start()
        return True

    def _compile(self, key: tuple[Any, ...], scratch: KVCache, feed: StepFeed) -> None:
        t0 = time.perf_counter()
        try:
            self._compiled(scratch, feed)
        except Exception as e:  # the shape stays eager; the generation never notices
            if not _EXITING:
                warnings.warn(f"infer: compiling the decode step failed, it stays eager: {e}", stacklevel=1)
            return
        finally:
            self.compile_seconds += time.perf_counter() - t0
        self._ready.add(key)


__all__ = [
    "MIN_CAPACITY",
    "MIN_PREFILL",
    "RowSampling",
    "Sampling",
    "SamplingValues",
    "StepFeed",
    "StepOutput",
    "Stepper",
    "gumbel_noise",
    "head_and_sample",
    "model_step",
    "sample",
    "sampling_inputs",
]
