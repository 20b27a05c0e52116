"""The OpenAI-compatible HTTP API over an engine: `create_app` builds the ASGI app and its routes.

The parts, one job each:

* `infer.serve.handler` — a generation request from its body to its response;
* `infer.serve.translate` — a body as the engine takes it: prompt ids, constraint, `SamplingParams`;
* `infer.serve.fields`, `infer.serve.schemas` — which fields infer honours; the bodies' types and ranges;
* `infer.serve.writers` — the streamed (server-sent events) and the whole response;
* `infer.serve.job`, `infer.serve.choices` — a request's choices, tool calls, response objects;
* `infer.serve.logprobs` — logprobs in OpenAI's two formats;
* `infer.serve.echo` — completions' ``echo``: the prompt's own logprobs, scored beside the engine;
* `infer.serve.tokens` — ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` (vLLM's and llama-server's);
* `infer.serve.state` — `ServeState`: the engine, the running requests, the shutdown;
* `infer.serve.client` — `EngineClient`: what the server uses of an engine and of a request;
* `infer.serve.errors`, `infer.serve.body_limit`, `infer.serve.metrics` — OpenAI's error body,
  the 413 for a body too large, ``/metrics``.

Each request is checked (schema, model name, context) before it reaches the engine, so a bad
one is a 400 naming the field; `EngineFull` is a 429 with ``Retry-After``. A client that goes
away cancels its request (the engine frees its row within one step). `ServeState.begin_shutdown`
(SIGTERM) stops admitting and lets running requests finish, ending them after a timeout.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from infer.engine import Engine
from infer.serve.body_limit import MAX_BODY_BYTES, BodyLimit
from infer.serve.client import EngineClient
from infer.serve.echo import PromptScorer
from infer.serve.errors import APIError, validation_error
from infer.serve.handler import generate
from infer.serve.logprobs import byte_decoder
from infer.serve.metrics import Metrics
from infer.serve.schemas import ChatCompletionRequest, CompletionRequest
from infer.serve.state import ServeState
from infer.serve.tokens import DetokenizeRequest, TokenizeRequest, detokenize, tokenize, tokenizer_info

if TYPE_CHECKING:
    from infer.llm import LLM

_byte_decoder = byte_decoder  # the name benchmarks/grammar_engines.py imports


def _llm_engine(llm: LLM, max_batch: int | None, max_waiting: int | None) -> EngineClient:
    """``llm.engine`` (the one owner of the model), made with these bounds when it does not exist yet."""
    options = {k: v for k, v in (("max_batch", max_batch), ("max_waiting", max_waiting)) if v is not None}
    try:
        return llm.start_engine(**options)
    except ValueError as e:
        raise ValueError(
            f"create_app: {e}; pass the bounds before the LLM generates, or pass its engine"
        ) from None


def create_app(
    llm_or_engine: LLM | EngineClient,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_batch: int | None = None,
    max_waiting: int | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The ASGI app serving ``llm_or_engine``: an `infer.LLM`, or an engine (an
    `infer.engine.Engine`, or anything with what `EngineClient` lists: the server needs nothing else,
    the model it serves included, which the engine describes: `EngineClient.served`).

    Requests go to the model's one engine (``llm.engine``; made here with ``max_batch``
    rows and ``max_waiting`` queued requests when those are given and it does not exist
    yet), or to the engine passed. Shutting the app down cancels its own running
    requests and leaves the engine to its owner.
    ``model_name`` is what ``/v1/models`` lists and requests must name (default: the
    checkpoint's directory or file name). ``api_key``: every endpoint but ``/health``
    and the chat page wants ``Authorization: Bearer <api_key>``. A request body over
    ``max_body_bytes`` is answered 413 before it is read whole (`BodyLimit`).
    """
    from infer.llm import LLM

    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    scorer = None
    if isinstance(llm_or_engine, LLM):
        engine = _llm_engine(llm_or_engine, max_batch, max_waiting)
        scorer = PromptScorer.of(llm_or_engine)
    else:
        engine = llm_or_engine
        if not all(hasattr(engine, name) for name in ("served", "submit_many", "stats")):
            raise TypeError(f"create_app takes an infer.LLM or an engine, got {type(engine).__name__}")
        if max_batch is not None or max_waiting is not None:
            raise ValueError("create_app: max_batch / max_waiting configure the LLM's engine: pass the LLM")
    if api_key is not None and not api_key:
        raise ValueError("api_key is empty: pass None for no key")
    served = engine.served
    name: str = model_name or served.name
    metrics = Metrics(lambda: dict(engine.stats()))
    state = ServeState(engine, served, name, api_key, engine.context, metrics)
    if scorer is None and isinstance(engine, Engine) and isinstance(engine.llm, LLM):
        scorer = PromptScorer.of(engine.llm)
    state.scorer = scorer

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.cancel_all()  # the engine stays its owner's: end only this app's requests

    app = FastAPI(title="infer", version="0.1.0", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.serve = state
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

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
        return await generate(state, "chat", body, request)

    @app.post("/v1/completions", dependencies=keyed, response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await generate(state, "text", body, request)

    @app.post("/tokenize", dependencies=keyed)
    async def tokenize_text(body: TokenizeRequest) -> dict[str, Any]:
        return tokenize(state, body)

    @app.post("/detokenize", dependencies=keyed)
    async def detokenize_ids(body: DetokenizeRequest) -> dict[str, Any]:
        return detokenize(state, body)

    @app.get("/tokenizer_info", dependencies=keyed)
    async def tokenizer() -> dict[str, Any]:
        return tokenizer_info(state)

    return app


__all__ = ["MAX_BODY_BYTES", "APIError", "BodyLimit", "EngineClient", "ServeState", "create_app"]
