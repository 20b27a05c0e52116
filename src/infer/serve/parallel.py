"""Serving a tensor- or pipeline-parallel model: rank 0 answers HTTP, every rank runs each step.

Under ``torchrun`` every rank holds a part of the model and must run the same steps in the
same order. Rank 0 runs the server with a `RankZeroEngine`: one worker thread takes the
requests one at a time, broadcasts each (prompt ids and parameters) to the other ranks and
runs it in lockstep with them (`LLM`'s parallel path, as `infer generate` under torchrun),
broadcasting after every step whether the request goes on (so a cancel ends it on every
rank at the same step). The other ranks run `follow`: receive, run, repeat, until rank 0
says the server has stopped. While idle, rank 0 broadcasts a keep-alive every
`KEEPALIVE_S` so no rank's collective reaches its timeout.

Limits (docs/distributed.md): one request at a time (no continuous batching across
ranks yet), no logprobs, ``ignore_eos`` and ``stop_token_ids`` are not honoured.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
from collections.abc import Generator, Iterator
from typing import Any

from infer.engine import Delta, EngineClosed, EngineFull, SamplingParams
from infer.generate import SamplingParams as StepParams
from infer.generate import cut_at_stop, stop_prefix

KEEPALIVE_S = 60.0
_STOP = "stop"
_KEEPALIVE = "keepalive"


@dataclasses.dataclass
class _Job:
    prompt: list[int]
    params: SamplingParams


class _Handle:
    """A request of `RankZeroEngine`: the engine interface's `RequestHandle`."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.id = request_id
        self.prompt = prompt
        self.prompt_tokens = len(prompt)
        self.params = params
        self.cancelled = False
        self.events: queue.SimpleQueue[Delta] = queue.SimpleQueue()

    def __iter__(self) -> Iterator[Delta]:
        while True:
            delta = self.events.get()
            yield delta
            if delta.finish_reason is not None:
                return

    def cancel(self) -> None:
        self.cancelled = True


def _steps(llm: Any, job: _Job) -> Generator[Any, None, None]:
    """The lockstep generation of ``job`` (the same call on every rank)."""
    p = job.params
    step = StepParams(p.temperature, p.top_k, p.top_p, p.seed)
    steps: Generator[Any, None, None] = llm._run([job.prompt], p.max_tokens, step, list(p.stop))
    return steps


def _go_on(llm: Any, decision: bool) -> bool:
    """Rank 0's ``decision`` (go on with the request?) on every rank."""
    from infer.distributed.runtime import broadcast_object

    return bool(broadcast_object(llm.parallel, decision))


class RankZeroEngine:
    """The engine interface on rank 0 of a parallel run (see the module's docstring)."""

    def __init__(self, llm: Any, *, max_waiting: int = 64) -> None:
        if llm.parallel is None or llm.parallel.rank != 0:
            raise ValueError("RankZeroEngine runs on rank 0 of a tensor/pipeline-parallel LLM")
        self.llm = llm
        self.max_batch = 1
        self.max_waiting = max_waiting
        self.context: int = llm.config.max_position_embeddings
        self._queue: queue.Queue[_Handle | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._generated = 0
        self._closed = False
        self._ids = itertools.count()
        self._worker = threading.Thread(target=self._loop, name="infer-rank0-engine", daemon=True)
        self._worker.start()

    def submit(self, prompt: str | list[int], params: SamplingParams) -> _Handle:
        ids = self.llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(ids) + 1 > self.context:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {self.context} tokens")
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is closed")
            if self._waiting >= self.max_waiting:
                raise EngineFull(f"{self._waiting} requests are waiting (max_waiting={self.max_waiting})")
            self._waiting += 1
        handle = _Handle(f"req-{next(self._ids)}", ids, params)
        self._queue.put(handle)
        return handle

    def stats(self) -> dict[str, float | int]:
        with self._lock:
            return {
                "running": self._running,
                "waiting": self._waiting,
                "batch_size": self._running,
                "generated_tokens": self._generated,
                "ranks": self.llm.parallel.world,
            }

    def close(self, drain: bool = True) -> None:
        """Stop admitting; end the followers' loop once the queue is done (cancelling it unless ``drain``)."""
        with self._lock:
            already = self._closed
            self._closed = True
        if not already:
            self._queue.put(None)
        if not drain:
            for handle in list(self._pending()):
                handle.cancel()
        self._worker.join()

    def _pending(self) -> list[_Handle]:
        return [h for h in list(self._queue.queue) if h is not None]

    def _loop(self) -> None:
        from infer.distributed.runtime import broadcast_object

        while True:
            try:
                handle = self._queue.get(timeout=KEEPALIVE_S)
            except queue.Empty:
                broadcast_object(self.llm.parallel, _KEEPALIVE)
                continue
            if handle is None:
                broadcast_object(self.llm.parallel, _STOP)
                return
            with self._lock:
                self._waiting -= 1
                self._running += 1
            try:
                if handle.cancelled:
                    handle.events.put(Delta([], "", None, "cancelled"))
                    continue
                broadcast_object(self.llm.parallel, _Job(handle.prompt, handle.params))
                self._serve(handle)
            except Exception as e:  # a collective failed: this request ends; the run is likely over
                handle.events.put(Delta([], "", None, "error", f"{type(e).__name__}: {e}"))
            finally:
                with self._lock:
                    self._running -= 1

    def _serve(self, handle: _Handle) -> None:
        tokenizer = self.llm.tokenizer
        stops = list(handle.params.stop)
        sent_tokens = 0
        emitted = ""
        steps = _steps(self.llm, _Job(handle.prompt, handle.params))
        for rows in steps:
            row = rows[0]
            new = row.tokens[sent_tokens:]
            sent_tokens = len(row.tokens)
            with self._lock:
                self._generated += len(new)
            if row.finish_reason is not None:
                final = cut_at_stop(tokenizer.decode(row.tokens), stops)[0]
                rest = final[len(emitted) :] if final.startswith(emitted) else ""
                reason = "stop" if row.finish_reason in ("eos", "stop") else "length"
                handle.events.put(Delta(new, rest, None, reason))
                steps.close()
                return
            go_on = _go_on(self.llm, not handle.cancelled)
            full = tokenizer.decode(row.tokens).rstrip("\ufffd")  # an incomplete character waits
            safe = full[: max(len(emitted), len(full) - stop_prefix(full, stops))]
            piece = safe[len(emitted) :] if safe.startswith(emitted) else ""
            emitted += piece
            if not go_on:
                steps.close()
                handle.events.put(Delta(new, piece, None, "cancelled"))
                return
            handle.events.put(Delta(new, piece, None, None))


def follow(llm: Any) -> int:
    """A rank other than 0 of a served parallel run: run every request rank 0 broadcasts; 0 at the end."""
    from infer.distributed.runtime import broadcast_object

    while True:
        job = broadcast_object(llm.parallel, None)
        if job == _STOP:
            return 0
        if job == _KEEPALIVE:
            continue
        assert isinstance(job, _Job), f"rank 0 sent {type(job).__name__}"
        steps = _steps(llm, job)
        for rows in steps:
            if rows[0].finish_reason is not None:
                break
            if not _go_on(llm, False):
                break
        steps.close()


__all__ = ["KEEPALIVE_S", "RankZeroEngine", "follow"]
