"""Errors as OpenAI answers them: `APIError` (``{"error": {"message", "type", "param", "code"}}``),
and a pydantic validation error as a 400 naming the field (`validation_error`)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

RETRY_AFTER_S = 1  # the ``Retry-After`` of a 429 (queue full) or a 503 (shutting down)


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


def bad(message: str, param: str | None, code: str | None = None) -> APIError:
    """A 400 (``invalid_request_error``) naming ``param``."""
    return APIError(400, message, param=param, code=code)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's names of union members


def param_of(loc: tuple[Any, ...]) -> str | None:
    """A pydantic error location as the OpenAI ``param``: ``messages[0].content``."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and p not in _UNION_TAGS and not any(c in p for c in "[-"):
            out += ("." if out else "") + p
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first error of a body that does not fit its schema, as a 400 naming its field."""
    errors: list[dict[str, Any]] = [dict(e) for e in exc.errors()]
    first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx", {})
        return bad(f"malformed JSON body: {ctx.get('error', first.get('msg'))}", None, "invalid_json")
    loc = tuple(first.get("loc", ()))
    param = param_of(loc)
    if loc == ("body",):
        return bad(f"the body must be a JSON object: {first.get('msg')}", None, "invalid_body")
    for e in errors:  # a validator's own message, without pydantic's prefix
        e["msg"] = str(e.get("msg", "")).removeprefix("Value error, ")
    # A union (str | list[...]) reports one error per member: name the field and what it takes.
    same_field = [e for e in errors if param_of(tuple(e.get("loc", ()))) == param]
    if len(same_field) > 1:
        wants = "; or ".join(sorted({str(e.get("msg")) for e in same_field}))
        message = f"{param}: {wants}"
    else:
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if "input" in first and first.get("type") != "missing":
        message += f" (got {json.dumps(first['input'], default=str)[:80]})"
    return bad(message, param, "invalid_value" if first.get("type") != "missing" else "missing_field")


__all__ = ["RETRY_AFTER_S", "APIError", "bad", "param_of", "validation_error"]
