"""`Engine`: continuous batching over one loaded model.

Each iteration (`Engine.step`) is one plan handed from stage to stage: schedule (`Scheduler`) ->
run (`Runner`) -> sample (`Sampler`) -> output (`Outputs`, then `Scheduler.update`);
`infer.engine.driver` says which thread runs it. docs/engine.md, *The flow of one step*.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import torch

from infer.combinations import check_request
from infer.engine import chunks
from infer.engine.driver import Driver
from infer.engine.output import Outputs
from infer.engine.request import Request, RequestHandle
from infer.engine.runner import Runner
from infer.engine.sampling import Sampler
from infer.engine.scheduler import Policy, Scheduler
from infer.engine.served import ServedModel
from infer.execution import Execution
from infer.kv.slots import KVSlots
from infer.models.base import DecoderLM
from infer.models.hooks import submission_scope
from infer.params import SamplingParams, check_int
from infer.sampling import Sampling, global_seed
from infer.speculative import Drafter, NoiseQueue, Speculative, Speculator
from infer.text.structured import Grammars, RowProcessor, check_logit_bias

if TYPE_CHECKING:
    from infer.loader.tokenizer import Tokenizer


class Model(Protocol):
    """What the engine needs of a loaded model (`infer.LLM` has it; the engine sits below the
    API and does not import it)."""

    model: DecoderLM
    execution: Execution
    tokenizer: Tokenizer
    source: Path  # the checkpoint (a server names the model after it)
    speculative: Speculative | None  # speculative decoding (`infer.speculative`), None: off

    @property
    def eos_ids(self) -> Sequence[int]: ...

    def encode(self, prompt: str | list[int], what: str = "prompt") -> list[int]: ...


class Engine:
    """Continuous batching over one loaded model (see the module's docstring).

    ``max_batch`` rows run at once (KV memory at most ``max_batch x context x`` bytes per token:
    `KVSlots`); at most ``max_waiting`` requests wait for a row (`EngineFull` past that);
    ``context`` (default the model's) bounds prompt + generated tokens of a request;
    ``prefill_chunk`` bounds the prompt tokens read per iteration while other requests decode
    (their next token waits for that forward), ``idle_prefill_chunk`` while none does (default:
    the length measured fastest for this model on this CPU, `infer.engine.chunks`).
    ``runner(max_batch, context)`` makes what runs the steps (default a `Runner` of the model's
    execution; a parallel run's rank 0 makes one that sends each plan to the other ranks:
    `infer.engine.parallel`).
    """

    def __init__(
        self,
        llm: Model,
        *,
        max_batch: int = 16,
        max_waiting: int = 64,
        context: int | None = None,
        prefill_chunk: int = 256,
        idle_prefill_chunk: int | None = None,
        runner: Callable[[int, int], Runner] | None = None,
    ) -> None:
        model = llm.model
        check_int("max_batch", max_batch, 1)
        check_int("max_waiting", max_waiting, 0)
        check_int("prefill_chunk", prefill_chunk, 1)
        if idle_prefill_chunk is not None:
            check_int("idle_prefill_chunk", idle_prefill_chunk, 1)
        limit = model.config.max_position_embeddings
        if context is not None:
            limit = min(limit, check_int("context", context, 2))
        per_forward = None
        limits = llm.execution.limits
        if limits is not None:  # a streamed model planned its memory for these
            max_batch = min(max_batch, limits.max_batch_size)
            limit = min(limit, limits.max_context)
            per_forward = limits.max_batch_size * limits.max_prefill_tokens
            prefill_chunk = min(prefill_chunk, per_forward)
        self.llm = llm
        self.model = model
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.context = limit
        self.prefill_chunk = prefill_chunk
        self.idle_prefill_chunk = idle_prefill_chunk
        self.per_forward = per_forward
        if runner is None:
            self.runner = Runner(KVSlots(model, max_batch, limit, record=True), llm.execution)
        else:
            self.runner = runner(max_batch, limit)
        self.slots = self.runner.slots
        speculator = None
        if llm.speculative is not None:
            draft = llm.speculative.draft
            if draft is not None:  # the draft model's KV: one row per row here (never shared)
                room = min(limit, draft.model.config.max_position_embeddings)
                slots = KVSlots(draft.model, max_batch, room, share=False)
                self.runner.drafter = Drafter(draft, Runner(slots, draft.execution))
            speculator = Speculator(
                llm.speculative, limit, per_forward, model.vocab_size, self.runner.drafter
            )
        execution = self.runner.execution
        idle_chunk, measured = idle_prefill_chunk, None
        if idle_chunk is None and chunks.measurable(model, per_forward is not None, execution.parallel):
            measured = self.runner.prompt_chunk  # asked when a prompt first needs it
        elif idle_chunk is None:
            idle_chunk = chunks.DEFAULT
        if idle_chunk is not None and per_forward is not None:
            idle_chunk = min(idle_chunk, per_forward)
        policy = Policy(max_batch, limit, prefill_chunk, idle_chunk, per_forward,
                        execution.bucketed, execution.exact_logits_allowed)  # fmt: skip
        self.scheduler = Scheduler(self.slots, policy, speculator, measured)
        exact_logits = self.runner.exact_logits if execution.exact_logits_allowed else None
        self.sampler = Sampler(model.vocab_size, model.device, exact_logits)
        self.outputs = Outputs()
        self.driver = Driver(self)
        self.eos = frozenset(llm.eos_ids)
        self._ids = itertools.count()
        self._grammars: Grammars | None = None  # built on the first constrained request

    # ---- one iteration -----------------------------------------------------------------------

    def step(self, admitted: Sequence[Request] = ()) -> None:
        """One iteration: schedule -> run -> sample -> output, one plan handed from stage to stage
        (``admitted``: the requests the driver took from the queue for it)."""
        plan = self.scheduler.schedule(admitted)
        ran = self.runner.run(plan, self.sampler.draws(plan))
        sampled = self.sampler.sample(plan, ran)
        self.scheduler.update(self.outputs.take(plan, sampled))

    # ---- callers' side (any thread) ------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.driver.closed

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None) -> RequestHandle:
        """Queue a request (thread-safe). `ValueError` for a bad prompt or one too long for the
        context, `EngineFull` when the waiting queue is full, `EngineClosed` after `close`."""
        return self.submit_many([prompt], [params or SamplingParams()])[0]

    def submit_many(
        self,
        prompts: Sequence[str | list[int]],
        params: Sequence[SamplingParams],
        *,
        text: bool = True,
        wait: bool = False,
        drive: bool = False,
        checked: bool = False,
    ) -> list[RequestHandle]:
        """Queue ``prompts`` in order; those that fit join the same step. ``text``: running events
        carry text (else the final one carries all of it). ``wait``: block for room instead of
        raising `EngineFull`. ``drive``: the caller will iterate the handles (and so run the loop
        itself), so no background thread is started for them. ``checked``: the prompts are token
        ids their caller checked (`infer.LLM.encode`), taken as they are."""
        if params and not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("params must be infer.SamplingParams")
        what = "prompt" if len(prompts) == 1 else "prompt {}"
        ids = [cast(list[int], p) if checked else self.llm.encode(p, what.format(i))
               for i, p in enumerate(prompts)]  # fmt: skip
        requests = [self._request(i, toks, p, text, len(prompts)) for i, (toks, p) in
                    enumerate(zip(ids, params, strict=True))]  # fmt: skip
        self.driver.submit(requests, self.max_waiting, wait=wait, drive=drive)
        return [r.handle for r in requests]

    def _request(self, i: int, toks: list[int], p: SamplingParams, text: bool, n: int) -> Request:
        if len(toks) + 1 > self.context:
            where = "prompt" if n == 1 else f"prompt {i}"
            raise ValueError(f"{where} has {len(toks)} tokens; the model's context is {self.context} tokens")
        check_request(p, speculative=self.scheduler.speculator is not None)
        processor = self._processor(toks, p) if p.processed else None
        handle = RequestHandle(f"req-{next(self._ids)}", len(toks), self.driver, p, self.llm.tokenizer, text)
        generator = None
        if not p.greedy:
            generator = torch.Generator(device=self.model.device)
            # Unseeded: a seed drawn from torch's global generator, so torch.manual_seed makes the
            # run reproducible (as lm-eval and transformers' sampling expect); torch.seed() reseeded it.
            generator.manual_seed(p.seed if p.seed is not None else global_seed())
        eos = frozenset(p.stop_token_ids) if p.ignore_eos else self.eos | set(p.stop_token_ids)
        max_new = min(p.max_tokens, self.context - len(toks))
        r = Request(handle, toks, p, max_new, eos, generator, time.perf_counter(), processor=processor)
        scope = submission_scope()
        if scope is not None:  # inside `infer.lens.hooks`: the hooks act on this request's forwards
            r.hooks = scope.for_request(len(toks) + max(max_new - 1, 0))  # the positions it may feed
            handle.activations = r.hooks.kept
        if self.scheduler.speculator is not None and generator is not None:
            r.noise = NoiseQueue(generator, self.model.vocab_size, self.model.device)
        return r

    @property
    def grammars(self) -> Grammars:
        """The compiled constraints of this model's tokenizer (`infer.text.structured.Grammars`)."""
        with self.driver.cond:
            if self._grammars is None:
                self._grammars = Grammars(self.llm.tokenizer, self.model.vocab_size, sorted(self.eos))
            return self._grammars

    def _processor(self, prompt: list[int], p: SamplingParams) -> RowProcessor:
        """The request's `RowProcessor`; `ValueError` naming the argument for a constraint that does
        not compile or a biased token id past the vocabulary."""
        check_logit_bias(p.logit_bias, self.model.vocab_size)
        matcher = None if p.constraint is None else self.grammars.matcher(p.constraint)
        return RowProcessor(
            self.model.vocab_size, prompt, matcher=matcher, logit_bias=p.logit_bias,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
        )  # fmt: skip

    def stats(self) -> dict[str, float | int]:
        """Counters for monitoring: running, waiting, rows and KV bytes held, tokens, steps."""
        with self.driver.cond:
            out = self.scheduler.stats()
            out.update(
                max_batch=self.max_batch, max_waiting=self.max_waiting, context=self.context,
                kv_rows=self.slots.rows, kv_capacity=self.slots.capacity, kv_bytes=self.slots.nbytes,
            )  # fmt: skip
        return out

    @property
    def served(self) -> ServedModel:
        """What a server shows of the model: its name (the checkpoint's), tokenizer, vocabulary, context."""
        source = self.llm.source
        name = str(source.stem if source.suffix == ".gguf" else source.name) or "model"
        return ServedModel(name, self.llm.tokenizer, self.model.config.vocab_size, self.context)

    def prepare(self, rows: Sequence[int], modes: Sequence[Sampling]) -> list[str]:
        """Queue the builds of the compiled decode steps of ``rows`` kinds x ``modes`` ahead of need
        (`infer.aot.PackageCache.prepare`): the keys queued, [] where packages are off."""
        from infer.aot import PackageCache

        packages = self.llm.execution.packages
        return packages.prepare(rows, modes) if isinstance(packages, PackageCache) else []

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """While a server serves this engine: under torchrun the other ranks are kept following it, and
        at the end the engine closes and lets them go (`infer.engine.parallel.Ranks.serving`)."""
        from infer.engine.parallel import Broadcasting

        runner = self.runner
        if not isinstance(runner, Broadcasting):
            yield
            return
        runner.keep_alive()
        try:
            yield
        finally:
            self.close(drain=False)
            runner.close()

    def settle(self, timeout: float = 5.0) -> None:
        """Wait until the background thread has let go of the engine (`Driver.settle`)."""
        self.driver.settle(timeout)

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting; finish (``drain``) or cancel the running and waiting requests; end the loop."""
        self.driver.close(drain, timeout)


__all__ = ["Engine", "Model"]
