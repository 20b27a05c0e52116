"""Which request fields infer honours, which it may ignore, and what the structured ones become.

`check_unhonoured`: every top-level field infer does not serve is a 400 naming it, unless it
changes nothing about the answer (`IGNORED`) or is null; a few known fields are refused for
the values infer cannot honour (`modalities` other than text, `best_of` > 1). `constraint_of`
turns ``response_format`` into an `infer.text.structured.Constraint`; `tool_chat_of` renders a chat
with its ``tools`` (`infer.text.prompts.tool_chat`).
"""

from __future__ import annotations

from typing import Any

from infer.text.prompts import ToolChat, tool_chat
from infer.text.structured import Constraint, ConstraintError

# Fields that do not change the answer: accepted and ignored (docs/serving.md lists them).
IGNORED = frozenset(
    {
        "user",  # an end-user id for abuse monitoring
        "store",  # OpenAI keeps the completion for its dashboards
        "metadata",  # tags for stored completions
        "service_tier",  # OpenAI's processing tier
        "safety_identifier",  # like `user`
        "prompt_cache_key",  # OpenAI's cache routing (infer's prefix cache needs no key)
        "prediction",  # predicted output: speeds up OpenAI's decoding, does not change the answer
    }
)

# Known fields infer does not honour, with what to use instead.
REFUSED = {
    "functions": "use tools",
    "function_call": "use tool_choice",
    "audio": "infer generates text only",
    "reasoning_effort": "infer's models have no reasoning setting",
    "verbosity": "infer has no verbosity setting",
    "web_search_options": "infer does not search the web",
    "suffix": "infer does not insert text",
}


class FieldError(ValueError):
    """A field infer cannot honour: ``param`` names it, ``code`` says why (OpenAI's error code:
    "unsupported_parameter", or None for a value that is wrong rather than unsupported)."""

    def __init__(self, message: str, param: str, code: str | None = "unsupported_parameter") -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_unhonoured(kind: str, body: Any) -> None:
    """`FieldError` for the first field of ``body`` that would change the answer and that infer does
    not honour (``kind``: "chat" or "text")."""
    if body.stream_options is not None and not body.stream:
        raise FieldError("stream_options is only allowed with stream: true", "stream_options", None)
    extra: dict[str, Any] = dict(body.model_extra or {})
    for name, value in extra.items():
        if name in IGNORED or value is None:
            continue
        if name == "modalities" and kind == "chat" and value == ["text"]:
            continue
        if name == "best_of" and kind == "text" and value == 1:
            continue
        why = REFUSED.get(name, "infer does not support it, and it would change the answer")
        raise FieldError(f"{name} is not supported: {why}", name)


def constraint_of(body: Any) -> Constraint | None:
    """The constraint ``response_format`` asks for: None for text, any JSON object, or a schema."""
    fmt = getattr(body, "response_format", None)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint.json_object()
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    if schema is None:
        return Constraint.json_object()
    try:
        return Constraint.json_schema(schema)
    except (ConstraintError, TypeError) as e:
        raise FieldError(f"response_format.json_schema.schema: {e}", "response_format", None) from None


def tool_chat_of(llm: Any, body: Any, constraint: Constraint | None) -> ToolChat:
    """The chat's prompt (with its tools) and the constraint to generate under."""
    messages = [m.plain() for m in body.messages]
    tools = None if body.tools is None else [t.model_dump(exclude_none=True) for t in body.tools]
    choice: Any = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump()
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    try:
        return tool_chat(
            llm,
            messages,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            constraint=constraint,
        )
    except (ValueError, TypeError) as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        param = "messages"
        for field in ("tool_choice", "tools"):
            if message.startswith(field) or f"{field}[" in message or f"{field} " in message:
                param = field
                break
        if param == "messages" and not message.startswith("messages"):
            message = f"messages: {message}"
        raise FieldError(message, param, None) from None


__all__ = ["IGNORED", "REFUSED", "FieldError", "check_unhonoured", "constraint_of", "tool_chat_of"]
