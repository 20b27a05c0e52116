"""A request inside the engine (`Request`) and the caller's side of it (`RequestHandle`).

The engine hands a request's tokens to its handle as they are sampled (`RequestHandle.put`); the
handle turns them into `Delta` events with text (`infer.text.stream.TextStream`), on the event
loop's thread for an asyncio reader (`RequestHandle.aiter`), else as each token arrives. A stop
string found there ends the stream at once; the engine frees the row at its next iteration.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from infer.params import SamplingParams
from infer.text.stream import Decoder, TextStream, cut_at_stop

if TYPE_CHECKING:
    from infer.speculative.state import NoiseQueue, SpecState
    from infer.text.structured import RowProcessor


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first; empty unless logprobs > 0


@dataclass
class Delta:
    """One event of a request's stream."""

    token_ids: list[int]  # new tokens in this event (may be empty on the final event)
    text: str  # new text (stop-string hold-back applied: see docs/reliability.md)
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # None while running; then "stop", "length", "error", "cancelled"
    error: str | None = None  # set when finish_reason == "error"


class EngineFull(Exception):
    """`Engine.submit` when the waiting queue is at its bound (retry later)."""


class EngineClosed(RuntimeError):
    """`Engine.submit` after `Engine.close`."""


class Driver(Protocol):
    """What a handle asks of the thread hand-off (`infer.engine.driver.Driver`)."""

    def next_event(self, handle: RequestHandle) -> Delta: ...
    def start_background(self) -> None: ...
    def wake(self) -> None: ...


@dataclass(frozen=True)
class Progress:
    """What the engine says of a request with each of its events: when it was admitted and its first
    token sampled (`time.perf_counter`, 0.0: not yet), prompt tokens reused and computed."""

    admitted: float
    first_token: float
    cached: int
    prefilled: int


@dataclass
class Ending:
    """How the engine ended a request (given with its final event)."""

    detail: str  # "eos" when an EOS id ended it, else the finish reason
    exception: BaseException | None
    prefill_seconds: float
    decode_seconds: float


@dataclass(eq=False)
class RequestHandle:
    """A submitted request: iterate it for its `Delta` events; `cancel` ends it within one step.

    After the final event: ``token_ids`` (every generated token, up to the one that completed a
    stop string), ``finish_detail`` ("eos" when an EOS id ended it, else the finish reason),
    ``prefill_seconds`` / ``decode_seconds`` (admission to first token, first token to end),
    ``prefilled`` (prompt tokens computed) and ``cached`` (prompt tokens whose KV was reused from
    an earlier request: the prefix cache). ``text``: whether running events carry text (else only
    the final one does, with all of it).
    """

    id: str
    prompt_tokens: int
    driver: Driver
    params: SamplingParams
    decoder: Decoder
    text: bool = True
    events: queue.SimpleQueue[Delta] = field(default_factory=queue.SimpleQueue)  # delivered, with text
    cancelled: bool = False  # the caller (or a stop string) ended it: the engine frees its row
    finished: bool = False  # its final event is made
    done: bool = False  # its final event is read
    token_ids: list[int] = field(default_factory=list)
    finish_detail: str | None = None
    exception: BaseException | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefilled: int = 0
    cached: int = 0
    admitted: float = 0.0  # perf_counter() when the engine admitted it (from its events' `Progress`)
    first_token: float = 0.0  # ... when its first token was sampled
    activations: Any = None  # what `infer.lens.hooks(cache=...)` keeps of its positions, else None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue[Delta]] | None = None
        self._stream = TextStream(self.decoder) if self.text or self.params.stop else None
        self._tokens: list[int] = []  # every token received

    # ---- the engine's side ---------------------------------------------------------------

    def put(self, raw: Delta, progress: Progress, ending: Ending | None = None) -> None:
        """An event from the engine (tokens, no text yet; ``ending`` with the final one) and where the
        request stands: delivered with its text, on this thread for a plain-Python reader, on the
        event loop's for an asyncio one. The handle's fields are written here, from its events only."""
        with self._lock:
            if self._async is None:
                delta = self._receive(raw, progress, ending)
                if delta is not None:
                    self.events.put(delta)
                return
            loop = self._async[0]
        try:
            loop.call_soon_threadsafe(self._deliver, raw, progress, ending)
        except RuntimeError:  # the event loop is closed: nobody reads this request any more
            self.cancel()

    def _deliver(self, raw: Delta, progress: Progress, ending: Ending | None) -> None:
        assert self._async is not None
        delta = self._receive(raw, progress, ending)
        if delta is not None:
            self._async[1].put_nowait(delta)

    def _receive(self, raw: Delta, progress: Progress, ending: Ending | None = None) -> Delta | None:
        """``raw`` with its text; None once the stream has ended (a stop string ended it first)."""
        if self.finished:
            return None
        self.admitted, self.first_token = progress.admitted, progress.first_token
        self.cached, self.prefilled = progress.cached, progress.prefilled
        self._tokens += raw.token_ids
        stream, stops = self._stream, self.params.stop
        if raw.finish_reason is None:
            if stream is None:
                return raw
            piece = stream.push(self._tokens, stops)
            if not stream.stopped:
                return Delta(raw.token_ids, piece if self.text else "", raw.logprobs, None)
            self.cancel()  # the engine frees the row at its next iteration
            self._end("stop", None)
            text = piece + stream.finish(self._tokens, stops) if self.text else self._final()
            return Delta(raw.token_ids, text, raw.logprobs, "stop")
        self._end(raw.finish_reason, ending)
        if raw.finish_reason in ("error", "cancelled"):
            text = ""
        elif self.text and stream is not None:
            text = stream.finish(self._tokens, stops)
        else:
            text = self._final()
        return Delta(raw.token_ids, text, raw.logprobs, raw.finish_reason, raw.error)

    def _final(self) -> str:
        """The whole text, cut at the first stop string (one full decode)."""
        return cut_at_stop(self.decoder.decode(self._tokens), self.params.stop)[0]

    def _end(self, reason: str, ending: Ending | None) -> None:
        self.finished = True
        self.token_ids = list(self._tokens)
        self.finish_detail = reason if ending is None else ending.detail
        if ending is not None:
            self.exception = ending.exception
            self.prefill_seconds, self.decode_seconds = ending.prefill_seconds, ending.decode_seconds
        elif self.first_token:  # a stop string ended it here
            self.prefill_seconds = self.first_token - (self.admitted or self.first_token)
            self.decode_seconds = time.perf_counter() - self.first_token

    # ---- the caller's side -----------------------------------------------------------------

    def __iter__(self) -> Iterator[Delta]:
        """The events in order. While nobody else runs the engine's loop, the iterating thread
        runs it (every running request advances, not only this one)."""
        while not self.done:
            delta = self.driver.next_event(self)
            if delta.finish_reason is not None:
                self.done = True
            yield delta

    async def aiter(self) -> AsyncIterator[Delta]:
        """The events for asyncio code: ``async for delta in handle.aiter()`` (no thread per request:
        the engine's thread hands each event to this event loop, which decodes its text)."""
        events: asyncio.Queue[Delta] = asyncio.Queue()
        with self._lock:
            while True:
                try:
                    events.put_nowait(self.events.get_nowait())
                except queue.Empty:
                    break
            self._async = (asyncio.get_running_loop(), events)
        self.driver.start_background()  # never run the model on the event loop's thread
        try:
            while not self.done:
                delta = await events.get()
                if delta.finish_reason is not None:
                    self.done = True
                yield delta
        finally:
            if not self.done:
                self.cancel()

    def cancel(self) -> None:
        """End the request: its row is freed at the next step; the stream ends with "cancelled"."""
        if not self.cancelled:
            self.cancelled = True
            self.driver.wake()


@dataclass
class Request:
    """A request as the engine holds it: its prompt, settings, row and what it generated."""

    handle: RequestHandle
    prompt: list[int]
    params: SamplingParams
    max_new: int  # max_tokens, less when the context ends first
    eos: frozenset[int]
    generator: torch.Generator | None
    submitted: float
    row: int = -1
    pending: list[int] = field(default_factory=list)  # tokens to feed next
    generated: list[int] = field(default_factory=list)
    started: float = 0.0  # admitted
    first: float = 0.0  # first token
    cached: int = 0  # prompt tokens whose KV was reused (the prefix cache, a shared prefix)
    prefilled: int = 0  # prompt tokens computed
    ended: bool = False  # its final event is sent
    # (row, n): the first n prompt tokens are being computed by the request in that row; this one
    # waits for them and then shares them (`Scheduler.resolve_waits`) instead of computing them too.
    waits: tuple[int, int] | None = None
    processor: RowProcessor | None = None  # constraint, bias, penalties (`infer.text.structured`)
    # With speculation on: a sampled request's noise, token by token, drawn from ``generator``
    # (a verify pass reads ahead and gives back the rows of rejected positions).
    noise: NoiseQueue | None = None
    spec: SpecState | None = None  # its speculation state (`infer.speculative`), made on first use
    # Submitted inside `infer.lens.hooks`: its scope (`infer.models.hooks`). Its forwards run alone,
    # eagerly, under that scope; it reuses no K/V and its row is never reused (`Scheduler.admit`).
    hooks: Any = None

    @property
    def decoding(self) -> bool:
        return bool(self.generated)

    def progress(self) -> Progress:
        return Progress(self.started, self.first, self.cached, self.prefilled)

    def emit(self, tokens: list[int], logprobs: list[TokenLogprob] | None) -> None:
        """A running event: ``tokens`` sampled (with their logprobs when asked)."""
        self.handle.put(Delta(tokens, "", logprobs, None), self.progress())

    def end(self, delta: Delta, ending: Ending | None = None) -> None:
        """The final event (``delta`` has its finish reason)."""
        self.ended = True
        reason = delta.finish_reason or "cancelled"
        self.handle.put(delta, self.progress(), ending or Ending(reason, None, 0.0, 0.0))


def collect(handle: RequestHandle) -> tuple[list[int], str]:
    """Wait for ``handle``'s end: ``(generated tokens, text)``."""
    text = []
    for delta in handle:
        text.append(delta.text)
    return handle.token_ids, "".join(text)


__all__ = [
    "Delta",
    "Ending",
    "EngineClosed",
    "EngineFull",
    "Progress",
    "Request",
    "RequestHandle",
    "TokenLogprob",
    "collect",
]
