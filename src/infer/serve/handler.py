"""`generate`: one request to ``/v1/chat/completions`` or ``/v1/completions``, from its body to its
response. It is checked (model name, shutdown, fields infer cannot honour, the constraint, the
prompt and the sampling values) before the engine sees it, so a bad one is a 400 naming the
field; then its ``n`` choices (of each prompt, for a batch of completions prompts) are submitted
(`EngineFull` is a 429 with ``Retry-After``) and the response is streamed or written whole
(`infer.serve.writers`). An echoed prompt is scored first (`infer.serve.echo`); with
``max_tokens: 0`` that is the whole answer."""

from __future__ import annotations

import secrets
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from infer.engine import EngineClosed, EngineFull
from infer.params import ParamTypeError
from infer.serve.client import HandleClient
from infer.serve.echo import Echo, echo_of
from infer.serve.errors import RETRY_AFTER_S, APIError, bad
from infer.serve.fields import FieldError, check_unhonoured, constraint_of
from infer.serve.job import Job
from infer.serve.state import ServeState
from infer.serve.translate import (
    check_echo,
    compile_constraint,
    completion_prompts,
    prompt_ids,
    refusal,
    sampling_params,
)
from infer.serve.writers import EventStream, sse, whole_response


def _reject(state: ServeState, endpoint: str) -> None:
    state.metrics.requests.labels(endpoint=endpoint, outcome="rejected").inc()


async def generate(state: ServeState, kind: str, body: Any, request: Request) -> Response:
    """Answer a generation request (``kind``: "chat" or "text")."""
    arrived = time.perf_counter()
    endpoint = kind
    if body.model is not None and body.model != state.model_name:
        _reject(state, endpoint)
        raise APIError(
            400, f"model {body.model!r} is not served here; this server serves {state.model_name!r}",
            param="model", code="model_not_found",
        )  # fmt: skip
    if state.draining:
        _reject(state, endpoint)
        raise APIError(
            503, "the server is shutting down", type="server_error", code="shutting_down",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )  # fmt: skip
    handles: list[HandleClient] = []
    prompt_field = "prompt"
    try:
        try:
            check_unhonoured(kind, body)
            constraint = constraint_of(body) if kind == "chat" else None
        except FieldError as e:
            raise bad(str(e), e.param, e.code) from None
        compile_constraint(state, constraint, "response_format")
        echoes = None
        if kind == "chat":
            ids, prompt_field, chat = prompt_ids(state, kind, body, constraint)
            prompts: list[tuple[list[int], str | None]] = [(ids, None)]
            if chat is not None and chat.constraint is not constraint:
                compile_constraint(state, chat.constraint, "tools")
                constraint = chat.constraint
        else:
            chat = None
            prompts = completion_prompts(state, body)
            check_echo(state, body, prompts)
            if body.echo:
                echoes = await run_in_threadpool(echo_prompts, state, prompts, body.logprobs)
                if body.max_tokens == 0:
                    return JSONResponse(scored_only(state, body, prompts, echoes))
        rows = [
            (ids, sampling_params(state, kind, body, len(ids), prompt_field, constraint))
            for ids, _ in prompts
        ]
        # Each choice draws its own (`SamplingParams.row`); the response's choices queue together.
        choices = [
            (ids, params.row(p * body.n + i)) for p, (ids, params) in enumerate(rows) for i in range(body.n)
        ]
        handles = list(
            await run_in_threadpool(
                state.engine.submit_many, [c[0] for c in choices], [c[1] for c in choices]
            )
        )
    except BaseException as e:
        for h in handles:  # choices already queued go with the request
            h.cancel()
        _reject(state, endpoint)
        if isinstance(e, EngineFull):
            raise APIError(
                429, f"the server is busy ({e}); retry later", type="rate_limit_error", code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None  # fmt: skip
        if isinstance(e, EngineClosed):
            raise APIError(
                503, "the model's engine is closed", type="server_error", code="engine_closed",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None  # fmt: skip
        if isinstance(e, ValueError | ParamTypeError):  # the engine refused a value
            raise refusal(e, kind, prompt_field) from None
        raise
    job = Job(state, kind, body, handles, arrived, chat, echoes)
    state.metrics.prompt_tokens.inc(job.prompt_tokens)
    state.admit(handles)
    if body.stream:
        return EventStream(sse(job), on_close=lambda: release(state, job))
    try:
        return await whole_response(job, request)
    finally:
        release(state, job)


def echo_prompts(
    state: ServeState, prompts: list[tuple[list[int], str | None]], logprobs: int | None
) -> list[Echo]:
    """Each prompt as echoed (`infer.serve.echo`): scored in one forward when logprobs are asked."""
    tokenizer = state.model.tokenizer
    ids = [p for p, _ in prompts]
    scores = state.scorer(ids, logprobs or 0) if logprobs is not None and state.scorer is not None else None
    return [
        echo_of(tokenizer, p, text, None if scores is None else scores[i], logprobs)
        for i, (p, text) in enumerate(prompts)
    ]


def scored_only(
    state: ServeState, body: Any, prompts: list[tuple[list[int], str | None]], echoes: list[Echo]
) -> dict[str, Any]:
    """The response to ``echo`` with ``max_tokens: 0``: each prompt echoed, nothing generated."""
    n = len(prompts) * body.n
    state.metrics.requests.labels(endpoint="text", outcome="length").inc(n)
    tokens = sum(len(ids) for ids, _ in prompts) * body.n
    state.metrics.prompt_tokens.inc(tokens)
    choices = []
    for k in range(n):
        echo = echoes[k // body.n]
        choices.append(
            {"index": k, "text": echo.text, "logprobs": echo.before(None), "finish_reason": "length"}
        )
    return {
        "id": "cmpl-" + secrets.token_hex(12),
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
    }


def release(state: ServeState, job: Job) -> None:
    """The request is over for the client: cancel it if still running (a no-op when it ended)."""
    if not state.release(job.handles):
        return
    job.cancel()
    if job.outcome == "cancelled":
        job.finish("cancelled")


__all__ = ["echo_prompts", "generate", "release", "scored_only"]
