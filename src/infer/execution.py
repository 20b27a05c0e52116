"""How a loaded model runs a forward: `Execution`, chosen once at load (`Execution.choose`), called by
the engine's runner for every forward (prompt chunks, decode steps, verify passes, a draft model's
steps): the model's placement (its `Executor`) with the mode of each step, eager, ``torch.compile``
per shape bucket, or ahead-of-time packages of decode steps (`infer.aot`). `model_step` is plain
tensor code with fixed shapes, so the same code runs in every mode (docs/architecture.md, *The
step: eager or compiled*)."""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import torch

from infer.kv.cache import KVCache
from infer.models.base import DecoderLM, ExecutorLimits
from infer.sampling import Sampling, SamplingValues, sample

MIN_PREFILL = 16  # compiled prefill: prompt lengths are padded to powers of two from here
# Dynamo's per-function recompile limits while infer's compiled step runs: every bucket
# (batch x capacity x tokens x sampling mode) is one graph of that one function.
RECOMPILE_LIMIT, ACCUMULATED_RECOMPILE_LIMIT = 64, 512


class StepFeed(NamedTuple):
    """What one step is fed beside the model and its cache: the tokens, and how to sample.

    ``ids [B, T]`` int64, right-padded; ``n_new [B]`` the real tokens of each row; ``last [B]``
    the position (in ``T``) of each row's token that goes through the head, or, in a verify
    pass (``mode.every_token``), ``[N]`` the flat positions ``b * T + j`` of every fed token;
    ``mode`` the static part of sampling (with the shapes, it selects the compiled graph);
    ``values`` the sampling values and ``noise`` the Gumbel noise, one row per position through
    the head (``[B]`` / ``[B, V]``, or ``[N]`` / ``[N, V]`` in a verify pass; both None when greedy).
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
    """One entry per position through the head: each row's last fed token (``[B]``), or every fed
    token of a verify pass (``[N]``, in the order of ``StepFeed.last``)."""

    tokens: torch.Tensor  # [B] int64
    logits: torch.Tensor  # [B, V] float32 (a greedy step's: exact at each row's argmax only)
    nonfinite: torch.Tensor  # [B] bool: a row's logits held NaN or +inf, or were all -inf
    hidden: torch.Tensor | None = None  # [B, D] each row's last hidden state before the final norm


def model_step(
    model: DecoderLM, cache: KVCache, feed: StepFeed
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``feed.ids [B, T]`` through the model on ``cache`` (``feed.n_new [B]`` real tokens per
    row, right-padded), then the head on each row's token ``feed.last [B]`` (a verify pass: on
    every fed token, ``feed.last [N]``) and sampling.

    Returns ``(tokens [B], logits [B, V] float32, nonfinite [B], hidden [B, D])`` (a verify pass:
    ``[N]``, ``[N, V]``, ``[N]``, ``[N, D]``; `StepOutput`). Tensors only: no host synchronization,
    no data-dependent branches.
    """
    ids, last = feed.ids, feed.last
    h = model.hidden(ids, cache, None, feed.n_new)  # [B, T, D]
    if feed.mode.every_token:  # a verify pass: the fed tokens of every row, one position per row of h
        h = h.reshape(-1, h.shape[-1]).index_select(0, last)[:, None]  # [N, 1, D]
    elif ids.shape[1] > 1:
        h = h.gather(1, last[:, None, None].expand(-1, 1, h.shape[-1]))  # [B, 1, D]: one token per row
    tokens, logits, nonfinite = head_and_sample(model, h, feed.mode, feed.values, feed.noise)
    return tokens, logits, nonfinite, h[:, 0]


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


StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


class Packages(Protocol):
    """Ahead-of-time compiled decode steps and verify passes (`infer.aot.PackageCache`): the one
    of a shape (``batch`` rows of ``width`` tokens), or None."""

    @property
    def enabled(self) -> bool: ...

    def get(self, cache: KVCache, batch: int, mode: Sampling, width: int = 1) -> PackagedStep | None: ...


class PackagedStep(Protocol):
    def __call__(self, cache: KVCache, feed: StepFeed) -> StepOutput: ...


class Execution:
    """How one loaded model runs a forward (see the module's docstring): ``execution(cache, feed)``.

    ``compile=True``: `model_step` compiled with ``fullgraph=True, dynamic=False``, one graph per
    ``(batch, capacity, tokens, sampling mode)``; the engine then steps in buckets (`bucketed`).
    ``compile="auto"`` with ``packages``: a decode step or verify pass whose shape has a package
    runs it, any other step eagerly. ``parallel``: the model is this rank's part of a tensor- or
    pipeline-parallel run (its head is whole on rank 0; nothing re-scores vocabulary rows). It
    holds no cache: each caller passes its own. ``compile_seconds``: time spent in first calls of
    new buckets; ``packaged_steps``: steps that ran a package.
    """

    def __init__(
        self,
        model: DecoderLM,
        compile: bool | Literal["auto"] = False,
        packages: Packages | None = None,
        *,
        parallel: bool = False,
    ) -> None:
        if not isinstance(compile, bool) and compile != "auto":
            raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
        self.model = model
        self.parallel = parallel
        self.compiled = compile is True  # every step compiled
        self.packages = packages if compile == "auto" else None  # ahead-of-time compiled decode steps
        self.compile_seconds = 0.0
        self.packaged_steps = 0  # decode steps that ran a package
        self._seen: set[tuple[Any, ...]] = set()
        self._fn: StepFn = model_step
        if self.compiled:
            self._fn = self._compile_fn()

    @classmethod
    def choose(
        cls,
        model: DecoderLM,
        compile: bool | Literal["auto"],
        *,
        streamed: bool,
        parallel: bool,
        deterministic: bool,
        packages: Callable[[], Packages | None] | None = None,
    ) -> Execution:
        """The execution of a model just built, from `infer.load`'s options (checked against each
        other by `infer.combinations.check_load` first): a streamed or parallel model runs eagerly
        (weights change between steps, or a step is a collective); ``"auto"`` asks for its package
        cache (``packages()``: None where packages do not pay for this model, `infer.aot.pays`) only
        on CPU and outside the deterministic mode (whose contract is the eager kernels')."""
        if streamed or parallel:
            return cls(model, False, parallel=parallel)
        cache = None
        if compile == "auto" and packages is not None and model.device.type == "cpu" and not deterministic:
            cache = packages()
        return cls(model, compile, cache)

    @property
    def limits(self) -> ExecutorLimits | None:
        """The shapes a forward may take (a streamed model planned its memory for them), None for any."""
        return self.model.executor.limits

    @property
    def shares_prefixes(self) -> bool:
        """Whether rows may read one stored copy of a shared prefix (`DecoderLM.shares_prefixes`)."""
        return self.model.shares_prefixes

    @property
    def exact_logits_allowed(self) -> bool:
        """Whether a few vocabulary rows of the head may be computed exactly after a step
        (`DecoderLM.exact_logits`); a parallel run's vocabulary lives on several ranks."""
        return not self.parallel

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

    @property
    def bucketed(self) -> bool:
        """Whether steps run in shape buckets (``compile=True``: a graph per shape): the engine then
        steps a power-of-two window of rows and KV capacities in powers of two, so that a few
        shapes serve every batch. Packages (`infer.aot`) take any rows of their range and any
        capacity: no buckets."""
        return self.compiled

    def __call__(self, cache: KVCache, feed: StepFeed) -> StepOutput:
        """One step of ``feed`` on ``cache``: eagerly, or through the compiled function. A decode
        step or a verify pass (``feed.mode.every_token``) runs its package when there is one; a
        verify pass never compiles in-process (its shapes vary with every proposal). While a
        forward hook sits on any module of the model (`infer.models.hooks`: a user's, or an
        intervention's) every step runs eagerly, where hooks run: packages and compiled graphs
        run no Python."""
        verify = feed.mode.every_token
        hooked = self.model.hooks.active()
        if hooked:
            self.model.hooks.check_generation()
        if not self.compiled or verify or hooked:
            packaged = verify or feed.ids.shape[1] == 1
            if self.packages is not None and packaged and cache.shared is None and not hooked:
                batch, width = feed.ids.shape
                package = self.packages.get(cache, batch, feed.mode, width)
                if package is not None:
                    self.packaged_steps += 1
                    with torch.inference_mode():
                        return package(cache, feed)
            with torch.inference_mode():
                return StepOutput(*model_step(self.model, cache, feed))
        key = (feed.ids.shape, cache.capacity, feed.mode)
        first = key not in self._seen
        t0 = time.perf_counter()
        with (
            torch.inference_mode(),
            torch._dynamo.config.patch(
                recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=ACCUMULATED_RECOMPILE_LIMIT
            ),
        ):
            out = StepOutput(*self._fn(self.model, cache, feed))
        if first:
            self._seen.add(key)
            self.compile_seconds += time.perf_counter() - t0
        return out


__all__ = [
    "MIN_PREFILL",
    "Execution",
    "PackagedStep",
    "Packages",
    "StepFeed",
    "StepOutput",
    "head_and_sample",
    "model_step",
]
