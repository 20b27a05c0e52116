"""A stand-in for `infer.engine` while it is being written: the same interface, one request at a time.

It runs each request alone through `LLM`'s generation loop in one worker thread (so the
model has one owner), keeps a bounded waiting queue, and reports no logprobs. The
server is written against the interface; `infer.engine.Engine` replaces this.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from infer.generate import SamplingParams as _StepParams
from infer.generate import generate_steps


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    error: str | None = None


class EngineFull(Exception):
    """The waiting queue is at its bound."""


_END = object()
_ids = itertools.count()


class RequestHandle:
    def __init__(self, prompt: list[int], params: SamplingParams) -> None:
        self.id = f"req-{next(_ids)}"
        self.prompt = prompt
        self.prompt_tokens = len(prompt)
        self.params = params
        self.cancelled = threading.Event()
        self.events: queue.Queue[Any] = queue.Queue()

    def __iter__(self) -> Iterator[Delta]:
        while True:
            item = self.events.get()
            if item is _END:
                return
            yield item

    def cancel(self) -> None:
        self.cancelled.set()


class Engine:
    def __init__(self, llm: Any, *, max_batch: int = 16, max_waiting: int = 64) -> None:
        self.llm = llm
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self._queue: queue.Queue[RequestHandle | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._tokens = 0
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name="infer-interim-engine", daemon=True)
        self._worker.start()

    def submit(self, prompt: str | list[int], params: SamplingParams) -> RequestHandle:
        ids = self.llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        context = self.llm.config.max_position_embeddings
        if len(ids) >= context:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {context} tokens")
        with self._lock:
            if self._closed:
                raise EngineFull("the engine is closed")
            if self._waiting >= self.max_waiting:
                raise EngineFull(f"{self._waiting} requests are waiting (max_waiting={self.max_waiting})")
            self._waiting += 1
        handle = RequestHandle(ids, params)
        self._queue.put(handle)
        return handle

    def stats(self) -> dict[str, float | int]:
        with self._lock:
            return {
                "running": self._running,
                "waiting": self._waiting,
                "batch_size": self._running,
                "generated_tokens": self._tokens,
            }

    def close(self, drain: bool = True) -> None:
        with self._lock:
            self._closed = True
        self._queue.put(None)
        if drain:
            self._worker.join()

    def _loop(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is None:
                return
            with self._lock:
                self._waiting -= 1
                self._running += 1
            try:
                self._serve(handle)
            except Exception as e:
                handle.events.put(Delta([], "", None, "error", f"{type(e).__name__}: {e}"))
            finally:
                with self._lock:
                    self._running -= 1
                handle.events.put(_END)

    def _serve(self, handle: RequestHandle) -> None:
        from infer.api import TextStream, _cut_at_stop

        llm, p = self.llm, handle.params
        step = _StepParams(p.temperature, p.top_k, p.top_p, p.seed)
        stops = list(p.stop)
        out = TextStream(llm.tokenizer)
        sent = 0
        eos = list(p.stop_token_ids) if p.ignore_eos else [*llm._eos_ids(), *p.stop_token_ids]
        steps = generate_steps(
            llm.model,
            [handle.prompt],
            max_new_tokens=p.max_tokens,
            params=step,
            eos_ids=eos,
            pad_id=llm.tokenizer.pad_token_id or 0,
            stop_check=(lambda row, tokens: _cut_at_stop(llm.tokenizer.decode(tokens), stops)[1])
            if stops
            else None,
            stepper=llm.stepper,
        )
        for rows in steps:
            row = rows[0]
            if handle.cancelled.is_set():
                handle.events.put(Delta([], "", None, "cancelled"))
                return
            new = row.tokens[sent:]
            sent = len(row.tokens)
            with self._lock:
                self._tokens += len(new)
            if row.finish_reason is None:
                handle.events.put(Delta(new, out.push(row.tokens, stops), None, None))
                continue
            final, _ = _cut_at_stop(llm.tokenizer.decode(row.tokens), stops)
            rest = final[len(out.emitted) :] if final.startswith(out.emitted) else ""
            reason = "stop" if row.finish_reason in ("eos", "stop") else "length"
            handle.events.put(Delta(new, rest, None, reason))
            return


__all__ = ["Delta", "Engine", "EngineFull", "RequestHandle", "SamplingParams", "TokenLogprob"]
