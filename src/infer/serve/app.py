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
import dataclasses
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
from infer.generate import row_seed
from infer.prompts import ToolChat, has_chat_template, read_reply
from infer.serve.fields import FieldError, check_unhonoured, constraint_of, tool_chat_of
from infer.serve.metrics import Metrics
from infer.serve.schemas import ChatCompletionRequest, CompletionRequest
from infer.structured import Constraint, check_logit_bias
from infer.tools import ToolCall

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


def _prompt_ids(
    state: ServeState, kind: str, body: Any, constraint: Constraint | None
) -> tuple[list[int], str, ToolChat | None]:
    """The prompt's token ids, the name of the field that holds it, and (chat) the rendered chat
    with its tools and the constraint to generate under."""
    llm = state.llm
    if kind == "chat":
        if not has_chat_template(llm):
            raise _bad(
                f"model {state.model_name!r} has no chat template: use /v1/completions", "messages",
                "no_chat_template",
            )  # fmt: skip
        try:
            chat = tool_chat_of(llm, body, constraint)
        except FieldError as e:
            raise _bad(str(e), e.param) from None
        return chat.ids, "messages", chat
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
        return ids, "prompt", None
    vocab = llm.config.vocab_size
    for i, t in enumerate(prompt):
        if not 0 <= t < vocab:
            raise _bad(f"prompt[{i}]: token id {t} is out of range [0, {vocab})", "prompt")
    return list(prompt), "prompt", None


def _compile(state: ServeState, constraint: Constraint | None, param: str) -> None:
    """Compile ``constraint`` now (cached for the engine), so a schema llguidance cannot enforce is a
    400 naming ``param``."""
    grammars = getattr(state.engine, "grammars", None)
    if constraint is None or grammars is None:
        return
    try:
        grammars.matcher(constraint)
    except ValueError as e:
        text = str(e).split(": ", 1)[-1] if str(e).startswith(f"{constraint.what}:") else str(e)
        raise _bad(f"{param}: {text.splitlines()[0]}", param, "invalid_schema") from None


def _params(
    state: ServeState,
    kind: str,
    body: Any,
    prompt_len: int,
    prompt_field: str,
    constraint: Constraint | None = None,
) -> SamplingParams:
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
    try:
        bias = check_logit_bias(body.logit_bias, state.llm.config.vocab_size)
    except ValueError as e:
        raise _bad(str(e), "logit_bias") from None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=top_k,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=_stops(body.stop),
        logprobs=logprobs,
        ignore_eos=body.ignore_eos,
        constraint=constraint,
        logit_bias=bias,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
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


class _Choice:
    """One choice of a response: its engine request and what it produced. With tools offered
    (chat), the reply is read for calls at its end (`infer.prompts.read_reply`), and while
    streaming, text that may begin a call is held back (`ToolFormat.call_start` / ``hold``)."""

    def __init__(
        self, index: int, handle: RequestHandle, chat: ToolChat | None, specials: dict[str, int]
    ) -> None:
        self.index, self.handle, self.chat = index, handle, chat
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.text_offset = 0  # completions' logprobs
        self.first = True  # no chunk sent yet
        self.reason: str | None = None
        self.calls: list[ToolCall] = []
        self.content = ""
        self.emitted = ""  # content streamed so far
        self.call_at: int | None = None  # where, in the text, calls begin
        fmt = self.format
        self._marker_ids = {specials[m] for m in fmt.markers if m in specials} if fmt is not None else set()

    @property
    def format(self) -> Any:
        return None if self.chat is None else self.chat.format

    def take(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)

    def stream_content(self, delta: Delta) -> str:
        """The new content of this delta that cannot be part of a call (everything without tools)."""
        if self.format is None:
            return delta.text
        seen = "".join(self.text)
        if self.call_at is None:
            if self._marker_ids.intersection(delta.token_ids):  # a call opened with a control token
                self.call_at = len(seen) - len(delta.text)
            else:
                self.call_at = self.format.call_start(seen)
        upto = self.call_at if self.call_at is not None else len(seen) - self.format.hold(seen)
        upto = len(seen[:upto].rstrip())  # whitespace before a call is not content: it waits
        piece = seen[len(self.emitted) : upto] if upto > len(self.emitted) else ""
        self.emitted += piece
        return piece

    def end(self, llm: Any, reason: str | None) -> None:
        """The final event came: read the calls out of the reply (when tools were offered)."""
        text = "".join(self.text)
        self.reason, self.content = reason, text
        if self.chat is not None and self.chat.format is not None:
            self.content, self.calls = read_reply(llm, self.chat, self.token_ids, text)
            if self.calls:
                self.reason = "tool_calls"

    def rest(self) -> str:
        """Streaming, at the end: the content not streamed yet."""
        if self.format is None or not self.content.startswith(self.emitted):
            return ""
        return self.content[len(self.emitted) :]


class _Job:
    """One admitted request: its choices (``n`` engine requests), what they produced, its metrics."""

    def __init__(
        self,
        state: ServeState,
        kind: str,
        body: Any,
        handles: list[RequestHandle],
        arrived: float,
        chat: ToolChat | None = None,
    ) -> None:
        self.state, self.kind, self.body, self.arrived = state, kind, body, arrived
        self.handles = handles
        specials: dict[str, int] = {}
        if chat is not None and chat.format is not None:
            specials = dict(getattr(state.llm.tokenizer, "special_tokens", {}))
        self.choices = [_Choice(i, h, chat, specials) for i, h in enumerate(handles)]
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.prompt_tokens = handles[0].prompt_tokens
        self.completion_tokens = 0
        self.last_token_at: float | None = None
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

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()

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

    def text_logprobs(self, choice: _Choice, items: list[TokenLogprob]) -> dict[str, Any]:
        tokens, offsets = [], []
        for lp in items:
            text = self._token_text(lp.token_id)
            tokens.append(text)
            offsets.append(choice.text_offset)
            choice.text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{self._token_text(i): v for i, v in lp.top} for lp in items],
            "text_offset": offsets,
        }

    def logprobs(self, choice: _Choice, items: list[TokenLogprob] | None) -> Any:
        if items is None:
            return None
        if self.kind == "chat":
            return {"content": self.chat_logprobs(items)}
        return self.text_logprobs(choice, items)

    # -- response objects --

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
        }
        if self.kind == "chat":
            chunk["system_fingerprint"] = None
        opts = self.body.stream_options
        if opts is not None and opts.include_usage:
            chunk["usage"] = None
        return chunk

    def chunk(
        self,
        choice: _Choice,
        delta: Delta,
        content: str,
        reason: str | None,
        calls: list[ToolCall] | None = None,
    ) -> dict[str, Any]:
        """One streamed event of ``choice``: ``content`` (chat: the new text), its tokens' logprobs,
        ``calls`` (as ``delta.tool_calls``), ``reason`` on the last."""
        out: dict[str, Any] = {
            "index": choice.index,
            "logprobs": self.logprobs(choice, delta.logprobs),
            "finish_reason": reason,
        }
        if self.body.return_token_ids:
            out["token_ids"] = list(delta.token_ids)
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant"} if choice.first else {}
            if content or choice.first:
                message["content"] = content
            if calls:
                message["tool_calls"] = [{"index": k, **c.openai()} for k, c in enumerate(calls)]
            out["delta"] = message
        else:
            out["text"] = content
        choice.first = False
        return self._envelope([out])

    def usage_chunk(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": [],
            "usage": self.usage(),
        }

    def whole(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            out: dict[str, Any] = {
                "index": c.index,
                "logprobs": self.logprobs(c, c.logprobs),
                "finish_reason": c.reason,
            }
            if self.body.return_token_ids:
                out["token_ids"] = c.token_ids
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": c.content}
                if c.calls:
                    message["content"] = c.content or None
                    message["tool_calls"] = [call.openai() for call in c.calls]
                out["message"] = message
            else:
                out["text"] = c.content
            choices.append(out)
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
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


def _reject(state: ServeState, endpoint: str) -> None:
    state.metrics.requests.labels(endpoint=endpoint, outcome="rejected").inc()


async def _generate(state: ServeState, kind: str, body: Any, request: Request) -> Response:
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
    handles: list[RequestHandle] = []
    prompt_field = "prompt"
    try:
        try:
            check_unhonoured(kind, body)
            constraint = constraint_of(body) if kind == "chat" else None
        except FieldError as e:
            raise _bad(
                str(e), e.param, "unsupported_parameter" if e.param != "response_format" else None
            ) from None
        _compile(state, constraint, "response_format")
        ids, prompt_field, chat = _prompt_ids(state, kind, body, constraint)
        if chat is not None and chat.constraint is not constraint:
            _compile(state, chat.constraint, "tools")
            constraint = chat.constraint
        params = _params(state, kind, body, len(ids), prompt_field, constraint)
        for i in range(body.n):
            p = params
            if i and params.seed is not None and not params.greedy:
                p = dataclasses.replace(params, seed=row_seed(params.seed, i))  # each choice draws its own
            handles.append(await run_in_threadpool(state.engine.submit, ids, p))
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
        if isinstance(e, ValueError) and not isinstance(e, APIError):  # the engine's checks name the field
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            fields = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs", "logit_bias",
                      "presence_penalty", "frequency_penalty", "repetition_penalty")  # fmt: skip
            param = next((f for f in fields if f in text), prompt_field if "prompt" in text else None)
            raise _bad(text, param) from None
        raise
    state.metrics.prompt_tokens.inc(handles[0].prompt_tokens)
    job = _Job(state, kind, body, handles, arrived, chat)
    with state.lock:
        state.handles.update(handles)
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
        if not any(h in state.handles for h in job.handles):
            return
        state.handles.difference_update(job.handles)
    state.metrics.in_flight.dec()
    job.cancel()
    if job.outcome == "cancelled":
        job.finish("cancelled")


async def _merged(choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, Delta]]:
    """Every choice's events as they come (one choice: its own, in order)."""
    if len(choices) == 1:
        async for delta in _deltas(choices[0].handle):
            yield choices[0], delta
        return
    events: asyncio.Queue[tuple[_Choice, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(choice: _Choice) -> None:
        try:
            async for delta in _deltas(choice.handle):
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


async def _whole(job: _Job, request: Request) -> Response:
    async def watch() -> None:  # a client that hangs up cancels its request
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)
        job.cancel()

    watcher = asyncio.create_task(watch())
    llm = job.state.llm
    try:
        async for choice, delta in _merged(job.choices):
            job.observe(delta)
            choice.take(delta)
            if delta.finish_reason is None:
                continue
            if delta.finish_reason in ("error", "cancelled"):
                job.cancel()
                job.finish(delta.finish_reason)
                return _end_error(delta).response()
            choice.end(llm, _finish_reason(delta.finish_reason))
    finally:
        watcher.cancel()
    if all(c.reason is not None for c in job.choices):
        job.finish(job.choices[0].reason or "stop")
        return JSONResponse(job.whole())
    job.finish("error")
    return APIError(500, "the engine ended the request without a final event", type="server_error").response()


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


async def _sse(job: _Job) -> AsyncIterator[bytes]:
    llm = job.state.llm
    ended = 0
    async for choice, delta in _merged(job.choices):
        job.observe(delta)
        choice.take(delta)
        if delta.finish_reason in ("error", "cancelled"):
            if delta.text or delta.token_ids:
                yield _event(job.chunk(choice, delta, choice.stream_content(delta), None))
            job.cancel()
            job.finish(delta.finish_reason)
            yield _event(_end_error(delta).body())
            yield b"data: [DONE]\n\n"
            return
        content = choice.stream_content(delta)
        if delta.finish_reason is None:
            if content or delta.token_ids or choice.first:
                yield _event(job.chunk(choice, delta, content, None))
            continue
        choice.end(llm, _finish_reason(delta.finish_reason))
        yield _event(job.chunk(choice, delta, content + choice.rest(), choice.reason, choice.calls))
        ended += 1
    if ended == len(job.choices):
        job.finish(job.choices[0].reason or "stop")
        opts = job.body.stream_options
        if opts is not None and opts.include_usage:
            yield _event(job.usage_chunk())
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
