"""The OpenAI-compatible HTTP API over an engine: `create_app` builds the ASGI app.

Each request is checked (schema, model name, context) before it reaches the engine, so
a bad one is a 400 naming the field; `EngineFull` is a 429 with ``Retry-After``. A
request's deltas reach the event loop through its handle's ``aiter()`` (the engine's
thread hands them over); a client that goes away cancels its request (the engine
frees its row within one step). `ServeState.begin_shutdown` (SIGTERM) stops
admitting and lets running requests finish, ending them after a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from infer.chat_template import check_unicode
from infer.engine import (
    Delta,
    Engine,
    EngineClosed,
    EngineFull,
    RequestHandle,
    SamplingParams,
    TokenLogprob,
)
from infer.prompts import chat_ids, has_chat_template
from infer.serve.metrics import Metrics
from infer.serve.schemas import ChatCompletionRequest, CompletionRequest

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
RETRY_AFTER_S = 1
# A request body larger than this is refused with 413 before it is read whole (`--max-body-bytes`).
# 4 MiB holds a prompt of ~1M characters or of ~500k token ids: beyond any context infer serves.
MAX_BODY_BYTES = 4 << 20


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _bad(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 and is never held whole.

    A ``Content-Length`` past the limit is answered at once, before any byte of the body is read;
    a body without one (chunked) is counted as it arrives and refused at the chunk that passes
    the limit, so at most ``limit`` bytes (plus one network chunk) are ever buffered for it.
    """

    def __init__(self, app: Callable[..., Awaitable[None]], limit: int) -> None:
        self.app, self.limit = app, limit

    def _too_large(self, size: str) -> APIError:
        return APIError(
            413,
            f"the request body is {size}; this server takes at most {self.limit} bytes (--max-body-bytes)",
            code="request_too_large",
        )

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > self.limit:
                await self._too_large(f"{declared} bytes").response()(scope, receive, send)
                return
        received = 0

        async def limited() -> Any:
            nonlocal received
            message = await receive()
            if message.get("type") == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # Raised inside the route's body read: the app answers it (exception handler).
                    raise StarletteHTTPException(413, self._too_large(f"over {self.limit} bytes").message)
            return message

        await self.app(scope, limited, send)


@dataclass
class ServeState:
    """What the app holds: the engine, the model it serves, its limits and metrics."""

    engine: Any
    llm: Any
    model_name: str
    api_key: str | None
    context: int
    metrics: Metrics
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    handles: set[Any] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin_shutdown(self, timeout: float) -> None:
        """Stop admitting; after ``timeout`` seconds cancel what still runs (streams get a final event)."""
        self.draining = True

        def end_the_rest() -> None:
            with self.lock:
                running = list(self.handles)
            for handle in running:
                handle.cancel()

        timer = threading.Timer(timeout, end_the_rest)
        timer.daemon = True
        timer.start()


def _llm_engine(llm: Any, max_batch: int | None, max_waiting: int | None) -> Any:
    """``llm.engine`` (the one owner of the model), made with these bounds when it does not exist yet."""
    options = {k: v for k, v in (("max_batch", max_batch), ("max_waiting", max_waiting)) if v is not None}
    if not options:
        return llm.engine
    with llm._engine_lock:
        if llm._engine is None:
            llm._engine = Engine(llm, **options)
        engine = llm._engine
    for key, value in options.items():
        if getattr(engine, key) != value:
            raise ValueError(
                f"create_app: this LLM's engine already runs with {key}={getattr(engine, key)}, not {value} "
                "(pass the bounds before the LLM generates, or pass its engine)"
            )
    return engine


def _context_of(engine: Any, llm: Any) -> int:
    for name in ("max_context", "max_seq_len", "context"):
        value = getattr(engine, name, None)
        if isinstance(value, int) and value > 0:
            return value
    context: int = llm.config.max_position_embeddings
    return context


def create_app(
    llm_or_engine: Any,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_batch: int | None = None,
    max_waiting: int | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The ASGI app serving ``llm_or_engine`` (an `infer.LLM` or an `infer.engine.Engine`).

    Requests go to the model's one engine (``llm.engine``; made here with ``max_batch``
    rows and ``max_waiting`` queued requests when those are given and it does not exist
    yet), or to the `Engine` passed. Shutting the app down cancels its own running
    requests and leaves the engine to the `LLM`.
    ``model_name`` is what ``/v1/models`` lists and requests must name (default: the
    checkpoint's directory or file name). ``api_key``: every endpoint but ``/health``
    and the chat page wants ``Authorization: Bearer <api_key>``. A request body over
    ``max_body_bytes`` is answered 413 before it is read whole (`BodyLimit`).
    """
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    if isinstance(llm_or_engine, Engine) or hasattr(llm_or_engine, "submit"):
        engine = llm_or_engine
        llm = getattr(engine, "llm", None)
        if llm is None:
            raise TypeError("create_app: the engine has no .llm (the model it serves)")
        if max_batch is not None or max_waiting is not None:
            raise ValueError("create_app: max_batch / max_waiting configure the LLM's engine: pass the LLM")
    else:
        llm = llm_or_engine
        if not hasattr(llm, "tokenizer") or not hasattr(llm, "config"):
            raise TypeError(f"create_app takes an infer.LLM or an Engine, got {type(llm).__name__}")
        engine = _llm_engine(llm, max_batch, max_waiting)
    if api_key is not None and not api_key:
        raise ValueError("api_key is empty: pass None for no key")
    source = llm.source
    name: str = model_name or str(source.stem if source.suffix == ".gguf" else source.name) or "model"
    metrics = Metrics(lambda: dict(engine.stats()))
    state = ServeState(engine, llm, name, api_key, _context_of(engine, llm), metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        with state.lock:  # the engine stays the LLM's: end only this app's requests
            running = list(state.handles)
        for handle in running:
            handle.cancel()

    app = FastAPI(title="infer", version="0.1.0", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.serve = state
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return APIError(exc.status_code, str(exc.detail), type=kind, code=code).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        message = f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return APIError(500, message, type="server_error").response()

    def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), state.api_key):
            raise APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    keyed = [Depends(check_key)]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "draining" if state.draining else "ok"}

    @app.get("/", response_class=HTMLResponse)
    async def chat_page() -> HTMLResponse:
        page = resources.files("infer.serve").joinpath("static/index.html").read_text(encoding="utf-8")
        return HTMLResponse(page)

    @app.get("/v1/models", dependencies=keyed)
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "infer",
                    "max_model_len": state.context,
                }
            ],
        }

    @app.get("/metrics", dependencies=keyed)
    async def metrics_text() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions", dependencies=keyed, response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _generate(state, "chat", body, request)

    @app.post("/v1/completions", dependencies=keyed, response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _generate(state, "text", body, request)

    return app


# ---- validation ------------------------------------------------------------------


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's names of union members


def _param(loc: tuple[Any, ...]) -> str | None:
    """A pydantic error location as the OpenAI ``param``: ``messages[0].content``."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and p not in _UNION_TAGS and not any(c in p for c in "[-"):
            out += ("." if out else "") + p
    return out or None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors: list[dict[str, Any]] = [dict(e) for e in exc.errors()]
    first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx", {})
        return _bad(f"malformed JSON body: {ctx.get('error', first.get('msg'))}", None, "invalid_json")
    loc = tuple(first.get("loc", ()))
    param = _param(loc)
    if loc == ("body",):
        return _bad(f"the body must be a JSON object: {first.get('msg')}", None, "invalid_body")
    # A union (str | list[...]) reports one error per member: name the field and what it takes.
    same_field = [e for e in errors if _param(tuple(e.get("loc", ()))) == param]
    if len(same_field) > 1:
        wants = "; or ".join(sorted({str(e.get("msg")) for e in same_field}))
        message = f"{param}: {wants}"
    else:
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if "input" in first and first.get("type") != "missing":
        message += f" (got {json.dumps(first['input'], default=str)[:80]})"
    return _bad(message, param, "invalid_value" if first.get("type") != "missing" else "missing_field")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    items = [stop] if isinstance(stop, str) else (stop or [])
    for i, s in enumerate(items):
        if not s:
            raise _bad("stop strings must be non-empty", "stop" if isinstance(stop, str) else f"stop[{i}]")
        check_unicode("stop", s)
    if len(items) > 16:
        raise _bad(f"at most 16 stop strings, got {len(items)}", "stop")
    return tuple(items)


def _prompt_ids(state: ServeState, kind: str, body: Any) -> tuple[list[int], str]:
    """The prompt's token ids and the name of the field that holds it."""
    llm = state.llm
    if kind == "chat":
        if not has_chat_template(llm):
            raise _bad(
                f"model {state.model_name!r} has no chat template: use /v1/completions", "messages",
                "no_chat_template",
            )  # fmt: skip
        messages = [
            {"role": m.role if m.role != "developer" else "system", "content": m.text()}
            for m in body.messages
        ]
        try:
            return chat_ids(llm, messages), "messages"
        except (ValueError, TypeError) as e:
            raise _bad(f"messages: {str(e).splitlines()[0]}", "messages") from None
    if body.echo:
        raise _bad("echo is not supported", "echo", "unsupported")
    if body.suffix:
        raise _bad("suffix is not supported", "suffix", "unsupported")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt is empty", "prompt")
        try:
            check_unicode("prompt", prompt)
        except ValueError as e:
            raise _bad(str(e), "prompt") from None
        ids: list[int] = llm.tokenizer.encode(prompt)
        if not ids:
            raise _bad("prompt encodes to no tokens", "prompt")
        return ids, "prompt"
    vocab = llm.config.vocab_size
    for i, t in enumerate(prompt):
        if not 0 <= t < vocab:
            raise _bad(f"prompt[{i}]: token id {t} is out of range [0, {vocab})", "prompt")
    return list(prompt), "prompt"


def _params(state: ServeState, kind: str, body: Any, prompt_len: int, prompt_field: str) -> SamplingParams:
    context = state.context
    if prompt_len >= context:
        raise _bad(
            f"{prompt_field}: the prompt has {prompt_len} tokens; the model's context is {context} tokens "
            "(room is needed for at least one new token)",
            prompt_field,
            "context_length_exceeded",
        )
    room = context - prompt_len
    field_name = "max_tokens"
    max_tokens = body.max_tokens
    if kind == "chat" and body.max_completion_tokens is not None:
        field_name, max_tokens = "max_completion_tokens", body.max_completion_tokens
    if max_tokens is None:
        max_tokens = room if kind == "chat" else min(DEFAULT_COMPLETION_TOKENS, room)
    elif max_tokens > room:
        raise _bad(
            f"{field_name} is {max_tokens}, but the prompt has {prompt_len} tokens and the model's "
            f"context is {context}: at most {room} new tokens fit",
            field_name,
            "context_length_exceeded",
        )
    if kind == "chat":
        if body.top_logprobs is not None and not body.logprobs:
            raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=top_k,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=_stops(body.stop),
        logprobs=logprobs,
        ignore_eos=body.ignore_eos,
    )


# ---- generation ------------------------------------------------------------------

_END = object()


async def _deltas(handle: RequestHandle) -> AsyncIterator[Delta]:
    """A request's events in the event loop: the handle's ``aiter()`` (the engine's thread hands
    them over), or, for a handle without one, its blocking iterator read by a thread of its own."""
    aiter = getattr(handle, "aiter", None)
    if aiter is not None:
        async for delta in aiter():
            yield delta
        return
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[Any] = asyncio.Queue()

    def put(item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            loop.call_soon_threadsafe(q.put_nowait, item)

    def pump() -> None:
        try:
            for delta in handle:
                put(delta)
        except BaseException as e:
            put(e)
        finally:
            put(_END)

    threading.Thread(target=pump, name=f"infer-serve-{handle.id}", daemon=True).start()
    while True:
        item = await q.get()
        if item is _END:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet back to bytes (the printable stand-ins BPE vocabularies use)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """A token's bytes: from its byte-level BPE spelling or a SentencePiece ``<0xHH>`` piece, or its text."""
    convert = getattr(tokenizer.hf, "convert_ids_to_tokens", None)
    piece = convert(token_id) if convert is not None else None
    if isinstance(piece, str) and piece:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            with contextlib.suppress(ValueError):
                return bytes([int(piece[3:5], 16)])
        if "\ufffd" in text:
            decoder = _byte_decoder()
            if all(c in decoder for c in piece):
                return bytes(decoder[c] for c in piece)
    return text.encode("utf-8")


def _finish_reason(reason: str | None) -> str | None:
    return "stop" if reason in ("stop", "eos") else reason


class _Job:
    """One admitted request: its handle, what it produced so far, its metrics."""

    def __init__(
        self, state: ServeState, kind: str, body: Any, handle: RequestHandle, arrived: float
    ) -> None:
        self.state, self.kind, self.body, self.handle, self.arrived = state, kind, body, handle, arrived
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.prompt_tokens = handle.prompt_tokens
        self.completion_tokens = 0
        self.last_token_at: float | None = None
        self.text_offset = 0
        self.outcome = "cancelled"

    def observe(self, delta: Delta) -> None:
        n = len(delta.token_ids)
        if not n:
            return
        now = time.perf_counter()
        m = self.state.metrics
        if self.last_token_at is None:
            m.ttft.observe(now - self.arrived)
        else:
            gap = (now - self.last_token_at) / n
            for _ in range(n):
                m.inter_token.observe(gap)
        self.last_token_at = now
        self.completion_tokens += n
        m.generation_tokens.inc(n)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    # -- logprobs in the two formats --

    def _token_text(self, token_id: int) -> str:
        text: str = self.state.llm.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (a byte-level token that is part of a UTF-8 character decodes to U+FFFD)."""
        return list(_token_bytes(self.state.llm.tokenizer, token_id, self._token_text(token_id)))

    def chat_logprobs(self, items: list[TokenLogprob]) -> list[dict[str, Any]]:
        out = []
        for lp in items:
            text = self._token_text(lp.token_id)
            out.append(
                {
                    "token": text,
                    "logprob": lp.logprob,
                    "bytes": self._token_bytes(lp.token_id),
                    "top_logprobs": [
                        {"token": self._token_text(i), "logprob": v, "bytes": self._token_bytes(i)}
                        for i, v in lp.top
                    ],
                }
            )
        return out

    def text_logprobs(self, items: list[TokenLogprob]) -> dict[str, Any]:
        tokens, offsets = [], []
        for lp in items:
            text = self._token_text(lp.token_id)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{self._token_text(i): v for i, v in lp.top} for lp in items],
            "text_offset": offsets,
        }

    def logprobs(self, items: list[TokenLogprob] | None) -> Any:
        if items is None:
            return None
        return {"content": self.chat_logprobs(items)} if self.kind == "chat" else self.text_logprobs(items)

    # -- response objects --

    def chunk(self, delta: Delta, first: bool) -> dict[str, Any]:
        reason = _finish_reason(delta.finish_reason)
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": self.logprobs(delta.logprobs),
            "finish_reason": reason,
        }
        if self.body.return_token_ids:
            choice["token_ids"] = list(delta.token_ids)
        if self.kind == "chat":
            choice["delta"] = ({"role": "assistant"} if first else {}) | (
                {"content": delta.text} if delta.text or first else {}
            )
        else:
            choice["text"] = delta.text
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": [choice],
        }
        if self.kind == "chat":
            chunk["system_fingerprint"] = None
        opts = self.body.stream_options
        if opts is not None and opts.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": [],
            "usage": self.usage(),
        }

    def whole(
        self, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None, reason: str | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": self.logprobs(logprobs), "finish_reason": reason}
        if self.body.return_token_ids:
            choice["token_ids"] = token_ids
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": [choice],
            "usage": self.usage(),
        }

    def finish(self, outcome: str) -> None:
        self.outcome = outcome
        m = self.state.metrics
        m.requests.labels(endpoint=self.kind, outcome=outcome).inc()
        m.duration.observe(time.perf_counter() - self.arrived)


def _end_error(delta: Delta) -> APIError:
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


async def _generate(state: ServeState, kind: str, body: Any, request: Request) -> Response:
    arrived = time.perf_counter()
    endpoint = kind
    if body.model is not None and body.model != state.model_name:
        state.metrics.requests.labels(endpoint=endpoint, outcome="rejected").inc()
        raise APIError(
            400, f"model {body.model!r} is not served here; this server serves {state.model_name!r}",
            param="model", code="model_not_found",
        )  # fmt: skip
    if state.draining:
        state.metrics.requests.labels(endpoint=endpoint, outcome="rejected").inc()
        raise APIError(
            503, "the server is shutting down", type="server_error", code="shutting_down",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )  # fmt: skip
    try:
        ids, prompt_field = _prompt_ids(state, kind, body)
        params = _params(state, kind, body, len(ids), prompt_field)
        handle = await run_in_threadpool(state.engine.submit, ids, params)
    except EngineFull as e:
        state.metrics.requests.labels(endpoint=endpoint, outcome="rejected").inc()
        raise APIError(
            429, f"the server is busy ({e}); retry later", type="rate_limit_error", code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None  # fmt: skip
    except EngineClosed:
        state.metrics.requests.labels(endpoint=endpoint, outcome="rejected").inc()
        raise APIError(
            503, "the model's engine is closed", type="server_error", code="engine_closed",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None  # fmt: skip
    except APIError:
        state.metrics.requests.labels(endpoint=endpoint, outcome="rejected").inc()
        raise
    except ValueError as e:  # the engine's own checks: the message names the field
        state.metrics.requests.labels(endpoint=endpoint, outcome="rejected").inc()
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        param = next(
            (
                f
                for f in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs")
                if f in text
            ),
            prompt_field if "prompt" in text else None,
        )
        raise _bad(text, param) from None
    state.metrics.prompt_tokens.inc(handle.prompt_tokens)
    job = _Job(state, kind, body, handle, arrived)
    with state.lock:
        state.handles.add(handle)
    state.metrics.in_flight.inc()
    if body.stream:
        return _Stream(_sse(job), on_close=lambda: _release(state, job))
    try:
        return await _whole(job, request)
    finally:
        _release(state, job)


def _release(state: ServeState, job: _Job) -> None:
    """The request is over for the client: cancel it if still running (a no-op when it ended)."""
    with state.lock:
        if job.handle not in state.handles:
            return
        state.handles.discard(job.handle)
    state.metrics.in_flight.dec()
    job.handle.cancel()
    if job.outcome == "cancelled":
        job.finish("cancelled")


async def _whole(job: _Job, request: Request) -> Response:
    async def watch() -> None:  # a client that hangs up cancels its request
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)
        job.handle.cancel()

    watcher = asyncio.create_task(watch())
    text: list[str] = []
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    try:
        async for delta in _deltas(job.handle):
            job.observe(delta)
            text.append(delta.text)
            token_ids += delta.token_ids
            if delta.logprobs is not None:
                logprobs = (logprobs or []) + list(delta.logprobs)
            if delta.finish_reason is not None:
                if delta.finish_reason in ("error", "cancelled"):
                    job.finish(delta.finish_reason)
                    return _end_error(delta).response()
                reason = _finish_reason(delta.finish_reason)
                job.finish(reason or "stop")
                return JSONResponse(job.whole("".join(text), token_ids, logprobs, reason))
    finally:
        watcher.cancel()
    job.finish("error")
    return APIError(500, "the engine ended the request without a final event", type="server_error").response()


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


async def _sse(job: _Job) -> AsyncIterator[bytes]:
    first = True
    async for delta in _deltas(job.handle):
        job.observe(delta)
        if delta.finish_reason in ("error", "cancelled"):
            if delta.text or delta.token_ids:
                yield _event(job.chunk(Delta(delta.token_ids, delta.text, delta.logprobs, None), first))
            job.finish(delta.finish_reason)
            yield _event(_end_error(delta).body())
            break
        if delta.text or delta.token_ids or delta.finish_reason is not None or first:
            yield _event(job.chunk(delta, first))
            first = False
        if delta.finish_reason is not None:
            job.finish(_finish_reason(delta.finish_reason) or "stop")
            opts = job.body.stream_options
            if opts is not None and opts.include_usage:
                yield _event(job.usage_chunk())
            break
    else:
        job.finish("error")
        yield _event(
            APIError(500, "the engine ended the request without a final event", type="server_error").body()
        )
    yield b"data: [DONE]\n\n"


class _Stream(StreamingResponse):
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


__all__ = ["APIError", "ServeState", "create_app"]
