"""`BodyLimit`: a request body over the limit is answered 413 and never held whole."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException

from infer.serve.errors import APIError

# A request body larger than this is refused with 413 before it is read whole (`--max-body-bytes`).
# 4 MiB holds a prompt of ~1M characters or of ~500k token ids: beyond any context infer serves.
MAX_BODY_BYTES = 4 << 20


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


__all__ = ["MAX_BODY_BYTES", "BodyLimit"]
