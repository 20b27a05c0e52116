"""The two ways a response is written: streamed as server-sent events (`sse`, `EventStream`) or
whole (`whole_response`). Both read every choice's events as they come (`merged`: each request's
``aiter()``, the engine's thread handing them to the event loop) and end the request however
the response ends: done, failed, or the client gone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from infer.engine import Delta
from infer.serve.choices import Choice, finish_reason
from infer.serve.errors import APIError
from infer.serve.job import Job


def end_error(delta: Delta) -> APIError:
    """The error of a request the engine ended early: shut down (cancelled) or failed."""
    if delta.finish_reason == "cancelled":
        return APIError(
            503,
            "the request was ended: the server is shutting down",
            type="server_error",
            code="shutting_down",
        )
    return APIError(
        500,
        f"generation failed: {delta.error or 'unknown error'}",
        type="server_error",
        code="generation_error",
    )


def _no_final_event() -> APIError:
    return APIError(500, "the engine ended the request without a final event", type="server_error")


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Delta]]:
    """Every choice's events as they come (one choice: its own, in order)."""
    if len(choices) == 1:
        async for delta in choices[0].handle.aiter():
            yield choices[0], delta
        return
    events: asyncio.Queue[tuple[Choice, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for delta in choice.handle.aiter():
                await events.put((choice, delta))
        except BaseException as e:
            await events.put((choice, e))
        finally:
            await events.put((choice, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    left = len(choices)
    try:
        while left:
            choice, item = await events.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield choice, item
    finally:
        for t in tasks:
            t.cancel()


async def whole_response(job: Job, request: Request) -> Response:
    """The whole response once every choice has ended; a client that hangs up cancels the request."""

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)
        job.cancel()

    watcher = asyncio.create_task(watch())
    model = job.state.model
    try:
        async for choice, delta in merged(job.choices):
            job.observe(delta)
            choice.take(delta)
            if delta.finish_reason is None:
                continue
            if delta.finish_reason in ("error", "cancelled"):
                job.cancel()
                job.finish(delta.finish_reason)
                return end_error(delta).response()
            choice.end(model, finish_reason(delta.finish_reason))
    finally:
        watcher.cancel()
    if all(c.reason is not None for c in job.choices):
        job.finish(job.choices[0].reason or "stop")
        return JSONResponse(job.whole())
    job.finish("error")
    return _no_final_event().response()


def event(obj: Any) -> bytes:
    """One server-sent event: ``data: <json>``."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


DONE = b"data: [DONE]\n\n"


async def sse(job: Job) -> AsyncIterator[bytes]:
    """The streamed response: a chunk per event with new content, the last with the finish reason
    (and the calls), the usage chunk when asked for, ``[DONE]``; a failed or ended request's
    stream ends with an error event and ``[DONE]``."""
    model = job.state.model
    ended = 0
    async for choice, delta in merged(job.choices):
        job.observe(delta)
        choice.take(delta)
        if delta.finish_reason in ("error", "cancelled"):
            if delta.text or delta.token_ids:
                yield event(job.chunk(choice, delta, choice.stream_content(delta), None))
            job.cancel()
            job.finish(delta.finish_reason)
            yield event(end_error(delta).body())
            yield DONE
            return
        content = choice.stream_content(delta)
        if delta.finish_reason is None:
            if content or delta.token_ids or choice.first:
                yield event(job.chunk(choice, delta, content, None))
            continue
        choice.end(model, finish_reason(delta.finish_reason))
        yield event(job.chunk(choice, delta, content + choice.rest(), choice.reason, choice.calls))
        ended += 1
    if ended == len(job.choices):
        job.finish(job.choices[0].reason or "stop")
        opts = job.body.stream_options
        if opts is not None and opts.include_usage:
            yield event(job.usage_chunk())
    else:
        job.finish("error")
        yield event(_no_final_event().body())
    yield DONE


class EventStream(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the response ends (done, error, client gone)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Callable[[], Awaitable[Any]], send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


__all__ = ["DONE", "EventStream", "end_error", "event", "merged", "sse", "whole_response"]
