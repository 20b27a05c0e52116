"""`Engine`: continuous batching over one loaded model.

Each iteration (`Engine.step`) reads as schedule -> run -> sample -> output:

1. **schedule** (`infer.engine.scheduler.Scheduler`): requests cancelled since the last step
   leave (their rows are free at once); waiting requests join, each on a free row, reusing
   what the engine holds of their prompts (the prefix cache, shared prefixes);
2. **run** (`infer.engine.runner.Runner`, the one place that runs the model): one decode step
   feeds the last sampled token of every decoding row, one batched forward over the contiguous
   rows that hold them (each weight read once per step for the whole batch; a verify pass of
   proposed tokens when speculation pays: `infer.speculative`); then chunked prefill: prompts
   still being read get at most `Engine.prefill_chunk` tokens per iteration, so running
   streams never wait for a whole long prompt;
3. **sample** (`infer.engine.sampling`): each row's logits are sampled with its own parameters,
   generator and noise inside the step; rows with a constraint, a bias or a penalty are fixed
   up on the host;
4. **output** (`infer.engine.output.Outputs`): each token is checked, its request ended on an
   EOS id, a completed constraint or its length, and handed to the request's handle, which
   decodes its text off the model's thread (`infer.engine.request.RequestHandle`).

Which thread runs the iterations: `infer.engine.driver`. Numerics: in the deterministic mode
(``infer.load(..., deterministic=True)``) a row's tokens and logits do not depend on the other
rows of a step, on how its prompt was chunked or on which row it runs in, so a request's output
is bitwise the same alone or among other requests (docs/numerics.md); in the default mode it is
within float32 rounding.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from infer.engine.driver import Driver
from infer.engine.output import Outputs
from infer.engine.request import Delta, EngineClosed, EngineFull, Request, RequestHandle
from infer.engine.runner import Runner
from infer.engine.sampling import resample_processed, step_sampling
from infer.engine.scheduler import Scheduler
from infer.engine.slots import KVSlots
from infer.models.base import DecoderLM
from infer.params import SamplingParams, check_int
from infer.runtime.step import MIN_PREFILL, StepOutput, Stepper
from infer.speculative import NoiseQueue, Speculative, Speculator
from infer.text.structured import Grammars, RowProcessor, check_logit_bias

if TYPE_CHECKING:
    from infer.loader.tokenizer import Tokenizer


class Model(Protocol):
    """What the engine needs of a loaded model (`infer.LLM` has it; the engine sits below the
    API and does not import it)."""

    model: DecoderLM
    stepper: Stepper
    tokenizer: Tokenizer
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
    (their next token waits for that forward), ``idle_prefill_chunk`` while none does.
    ``runner(max_batch, context)`` makes what runs the steps (default a `Runner` of the model's
    stepper; a parallel run's rank 0 makes one that sends each step to the other ranks:
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
        idle_prefill_chunk: int = 2048,
        runner: Callable[[int, int], Runner] | None = None,
    ) -> None:
        model = llm.model
        check_int("max_batch", max_batch, 1)
        check_int("max_waiting", max_waiting, 0)
        check_int("prefill_chunk", prefill_chunk, 1)
        check_int("idle_prefill_chunk", idle_prefill_chunk, 1)
        limit = model.config.max_position_embeddings
        if context is not None:
            limit = min(limit, check_int("context", context, 2))
        per_forward = None
        limits = model.executor.limits
        if limits is not None:  # a streamed model planned its memory for these
            max_batch = min(max_batch, limits.max_batch_size)
            limit = min(limit, limits.max_context)
            per_forward = limits.max_batch_size * limits.max_prefill_tokens
            prefill_chunk = min(prefill_chunk, per_forward)
            idle_prefill_chunk = min(idle_prefill_chunk, per_forward)
        self.llm = llm
        self.model = model
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.context = limit
        self.prefill_chunk = prefill_chunk
        self.idle_prefill_chunk = idle_prefill_chunk
        self.per_forward = per_forward
        if runner is None:
            self.runner = Runner(KVSlots(model, max_batch, limit), llm.stepper)
        else:
            self.runner = runner(max_batch, limit)
        self.slots = self.runner.slots
        self.spec: Speculator | None = None
        if llm.speculative is not None:
            draft, draft_runner = llm.speculative.draft, None
            if draft is not None:  # the draft model's KV: one row per row here (never shared)
                room = min(limit, draft.model.config.max_position_embeddings)
                draft_runner = Runner(KVSlots(draft.model, max_batch, room, share=False), draft.stepper)
            self.spec = Speculator(llm.speculative, self.runner, limit, per_forward, draft_runner)
        self.eos = frozenset(llm.eos_ids)
        self.stats_counters: dict[str, float] = {
            "requests": 0, "finished": 0, "prompt_tokens": 0, "prefill_tokens": 0, "cached_tokens": 0,
            "generated_tokens": 0, "steps": 0, "batch_size": 0,
        }  # fmt: skip
        self.scheduler = Scheduler(self.slots, max_batch, max_waiting, self.stats_counters)
        self.outputs = Outputs(self.scheduler, self.stats_counters)
        self.driver = Driver(self)
        self.closed = False
        self.aborted = False  # close(drain=False): end everything
        self._ids = itertools.count()
        self._grammars: Grammars | None = None  # built on the first constrained request

    # ---- callers' side (any thread) ------------------------------------------------------

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
    ) -> list[RequestHandle]:
        """Queue ``prompts`` in order; those that fit join the same step. ``text``: running events
        carry text (else the final one carries all of it). ``wait``: block for room instead of
        raising `EngineFull`. ``drive``: the caller will iterate the handles (and so run the loop
        itself), so no background thread is started for them."""
        if params and not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("params must be infer.SamplingParams")
        what = "prompt" if len(prompts) == 1 else "prompt {}"
        ids = [self.llm.encode(p, what.format(i)) for i, p in enumerate(prompts)]
        requests = [self._request(i, toks, p, text, len(prompts)) for i, (toks, p) in
                    enumerate(zip(ids, params, strict=True))]  # fmt: skip
        cond = self.driver.cond
        for r in requests:
            while wait and drive and self._full(max(1, self.max_waiting)):
                self.driver.drive_once()  # make room by running the loop (or wait while another does)
            with cond:
                while not self.closed and self.scheduler.full(max(1, self.max_waiting)) and wait:
                    if drive:
                        break  # filled since the check above by another caller: one more waits
                    self.driver.start_locked()
                    cond.wait(0.5)
                if self.closed:
                    raise EngineClosed("the engine is closed")
                if self.scheduler.full(self.max_waiting) and not wait:
                    waiting = len(self.scheduler.waiting)
                    raise EngineFull(f"{waiting} requests are waiting (max_waiting={self.max_waiting})")
                self.scheduler.waiting.append(r)
                self.stats_counters["requests"] += 1
                self.stats_counters["prompt_tokens"] += len(r.prompt)
                if not drive:
                    self.driver.start_locked()
                cond.notify_all()
        return [r.handle for r in requests]

    def _request(self, i: int, toks: list[int], p: SamplingParams, text: bool, n: int) -> Request:
        if len(toks) + 1 > self.context:
            where = "prompt" if n == 1 else f"prompt {i}"
            raise ValueError(f"{where} has {len(toks)} tokens; the model's context is {self.context} tokens")
        processor = self._processor(toks, p) if p.processed else None
        handle = RequestHandle(f"req-{next(self._ids)}", len(toks), self.driver, p, self.llm.tokenizer, text)
        generator = None
        if not p.greedy:
            generator = torch.Generator(device=self.model.device)
            generator.manual_seed(p.seed if p.seed is not None else torch.seed())
        eos = frozenset(p.stop_token_ids) if p.ignore_eos else self.eos | set(p.stop_token_ids)
        max_new = min(p.max_tokens, self.context - len(toks))
        r = Request(handle, toks, p, max_new, eos, generator, time.perf_counter(), processor=processor)
        if self.spec is not None and generator is not None:
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

    def _full(self, bound: int) -> bool:
        with self.driver.cond:
            return not self.closed and self.scheduler.full(bound)

    def stats(self) -> dict[str, float | int]:
        """Counters for monitoring: running, waiting, rows and KV bytes held, tokens, steps."""
        with self.driver.cond:
            out: dict[str, float | int] = {k: int(v) for k, v in self.stats_counters.items()}
            out.update(
                running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                max_batch=self.max_batch, max_waiting=self.max_waiting, context=self.context,
                kv_rows=self.slots.rows, kv_capacity=self.slots.capacity, kv_bytes=self.slots.nbytes,
            )  # fmt: skip
            if self.spec is not None:
                out.update(self.spec.stats())
        return out

    def settle(self, timeout: float = 5.0) -> None:
        """Wait until the background thread has let go of the engine (`Driver.settle`)."""
        self.driver.settle(timeout)

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting; finish (``drain``) or cancel the running and waiting requests; end the loop."""
        s = self.scheduler
        with self.driver.cond:
            self.closed = True
            if not drain:
                self.aborted = True  # also ends requests being admitted right now (in no list)
                for r in [*s.waiting, *s.running.values()]:
                    r.handle.cancelled = True
            if s.waiting or s.running:
                self.driver.start_locked()  # ends them even if no caller is iterating them
            self.driver.cond.notify_all()
        self.driver.join(timeout)

    # ---- for the driver (`infer.engine.driver`), its ``cond`` held where named ``_locked`` ---------

    def poll_locked(self) -> list[Request] | None:
        """Requests to admit now ([] when only running ones need a step); None when idle."""

        def dropped(r: Request) -> bool:
            if r.handle.cancelled or self.aborted:
                self.outputs.end(r, Delta([], "", None, "cancelled"))
                return True
            return False

        admitted = self.scheduler.take_waiting(dropped)
        if admitted:
            self.driver.cond.notify_all()  # room in the waiting queue
        if admitted or self.scheduler.running:
            self.driver.parked = False
            return admitted
        return None

    def idle_locked(self) -> bool:
        return not self.scheduler.waiting and not self.scheduler.running

    def exit_locked(self) -> bool:
        """Whether the background thread should end now (nothing waiting or running)."""
        if not self.idle_locked():
            return False
        self.driver.thread = None
        return True

    def reap(self) -> None:
        """End cancelled requests now when no thread is running the loop, so a caller that stopped
        iterating early does not leave its row held until somebody runs the next step."""
        s = self.scheduler
        with self.driver.cond:
            if self.driver.running_elsewhere():
                return  # the running loop ends them at its next iteration
            for r in [r for r in s.waiting if r.handle.cancelled]:
                s.waiting.remove(r)
                self.outputs.end(r, Delta([], "", None, "cancelled"))
            for r in [r for r in s.running.values() if r.handle.cancelled]:
                self.outputs.finish(r, "cancelled")

    def work(self, admitted: list[Request], interruptible: bool = False) -> None:
        """Admit ``admitted``, then one `step`. A failure ends what ran (the engine keeps serving);
        an interrupt (``interruptible``: a caller drives) is raised after that."""
        try:
            for r in admitted:
                try:
                    self.scheduler.admit(r)
                except Exception as e:
                    self.outputs.finish(r, "error", e)
            self.step()
        except BaseException as e:  # a bug or a failing model: end what ran, keep serving
            for r in [*admitted, *self.scheduler.running.values()]:
                if not r.ended:
                    self.outputs.finish(r, "error", e)
            if interruptible and not isinstance(e, Exception):
                raise  # Ctrl-C in a caller driving the loop is the caller's

    # ---- one iteration -----------------------------------------------------------------------

    def step(self) -> None:
        """One iteration: schedule -> run -> sample -> output, for the decoding rows and then for
        a chunk of the prompts still being read."""
        running = self.scheduler.running
        for r in list(running.values()):
            if r.handle.cancelled or self.aborted:
                self.outputs.finish(r, "cancelled")
        if not running:
            return
        decoding = self.scheduler.decoding()
        if decoding:
            self._decode(decoding)
        self._prefill()

    def _decode(self, rows: list[int]) -> None:
        running, spec = self.scheduler.running, self.spec
        if spec is not None:
            span = range(rows[0], rows[-1] + 1)  # a verify pass feeds these rows (and pads the idle)
            room = min(self.context - self.slots.length(i) for i in span if i in running)
            verified = spec.decode([running[i] for i in rows], room)
            if verified is not None:  # the step ran as a verify pass of proposed tokens
                for v in verified:
                    taken = 0
                    for i, t in enumerate(v.tokens):
                        taken += 1
                        if not self.outputs.take(v.request, t, v.nonfinite[i], v.logits, i):
                            break
                    spec.settle(v, taken)
                self.stats_counters["steps"] += 1
                self.stats_counters["batch_size"] = len(rows)
                return
        t0 = time.perf_counter()
        lo, hi = rows[0], rows[-1] + 1
        if self.slots.bucketed:
            # A power-of-two window of rows around the decoding ones (few graphs, one per size),
            # not every allocated row: one stream among 16 idle rows computes 1 row, not 16.
            width = min(self.slots.rows, 1 << (hi - lo - 1).bit_length())
            lo = min(lo, self.slots.rows - width)
            hi = lo + width
        requests = [running.get(i) if i in rows else None for i in range(lo, hi)]
        feeds = {i: running[i].pending for i in rows}
        ran = self._run(lo, hi, feeds, requests)
        if ran is None:
            return
        out, tokens, bad = ran
        self.stats_counters["batch_size"] = len(rows)
        for i in rows:
            self.outputs.take(running[i], tokens[i - lo], bad[i - lo], out.logits, i - lo)
        if spec is not None:
            spec.observe_decode(len(rows), time.perf_counter() - t0)

    def _run(
        self, lo: int, hi: int, feeds: dict[int, list[int]], requests: list[Request | None], pad_to: int = 0
    ) -> tuple[StepOutput, list[int], list[bool]] | None:
        """Run and sample one step of rows ``[lo, hi)`` fed ``feeds`` as ``requests`` ask, and its host
        read: ``(out, tokens, nonfinite)``; None when it failed (its fed rows finish with the error)."""
        mode, values, noise = step_sampling(requests, self.runner)
        try:
            out = self.runner.step(lo, hi, feeds, mode, values, noise, pad_to)
            tokens: list[int] = out.tokens.tolist()  # the step's host read
            bad: list[bool] = out.nonfinite.tolist()
            resample_processed(self.runner, out, lo, feeds, requests, noise, tokens, exact=mode.exact_head)
        except Exception as e:
            for i in feeds:
                self.outputs.finish(self.scheduler.running[i], "error", e)
            return None
        self.stats_counters["steps"] += 1
        return out, tokens, bad

    def _prefill(self) -> None:
        """Up to `prefill_chunk` prompt tokens: runs of contiguous prefilling rows, one forward each."""
        running = self.scheduler.running
        groups = self.scheduler.prefill_groups()
        # Running streams wait for this forward: a short chunk. Nobody waits: a long one, which
        # dequantizes each packed weight once for more tokens (Gemma 3, a 4,096-token prompt:
        # 818 tok/s in chunks of 256, 1,161 in chunks of 2,048; AMD EPYC, 2 threads).
        idle = not any(r.decoding for r in running.values())
        budget = self.idle_prefill_chunk if idle else self.prefill_chunk
        for group in groups:
            if budget <= 0:
                break
            # The chunk bounds the tokens of the forward, not of each row: a burst of new prompts
            # shares it, so the running streams never wait for more than one chunk's forward.
            T = min(max(1, budget // len(group)), max(len(running[i].pending) for i in group))
            if self.per_forward is not None:
                T = max(1, min(T, self.per_forward // len(group)))
            feeds = {i: running[i].pending[:T] for i in group}
            requests: list[Request | None] = [running[i] for i in group]
            pad_to = 0
            if self.runner.compiled:
                pad_to = max(MIN_PREFILL, 1 << (T - 1).bit_length()) if T > 1 else 1
            ran = self._run(group[0], group[-1] + 1, feeds, requests, pad_to)
            if ran is None:
                continue
            out, tokens, bad = ran
            budget -= sum(len(t) for t in feeds.values())
            for j, i in enumerate(group):
                r = running[i]
                fed = len(feeds[i])
                r.handle.prefilled += fed
                self.stats_counters["prefill_tokens"] += fed
                del r.pending[:fed]
                if not r.pending:  # the prompt is read: this step's logits pick the first token
                    self.outputs.take(r, tokens[j], bad[j], out.logits, j)


__all__ = ["Engine", "Model"]
