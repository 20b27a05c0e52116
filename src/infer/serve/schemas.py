"""Request bodies of the OpenAI API as pydantic models.

The bodies' shape is checked here (types, required fields, what only the HTTP API bounds: ``n``,
16 stop strings), so a wrong one is a 400 naming the field; the sampling values' rules are
`infer.SamplingParams`', which `infer.serve.translate` builds from a body (a value it refuses is
a 400 naming the field too; the completions' ``logprobs`` int goes to 20 there, 5 at OpenAI).
A top-level field infer does not know is kept (``model_extra``) for
`infer.serve.fields.check_unhonoured`: a 400 naming it unless it is one of the fields that
change nothing (``user``, ``store``, ``metadata``, ...) or is null. A known field sent as null
takes its default; a number is a JSON number (a string or a boolean is a 400, never converted).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

MAX_N = 128  # OpenAI's bound on choices per request
MAX_STOPS = 16  # OpenAI's bound on stop strings
MAX_PROMPTS = 128  # prompts in one completions request (each is ``n`` choices)


class _Part(BaseModel):
    """A nested object of a request: a field infer does not know is ignored (only the top-level
    ones are checked)."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Part):
    include_usage: StrictBool = False


class TextPart(_Part):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Part):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI returns it


class ToolCallIn(_Part):
    """A call in an earlier assistant message, sent back with the conversation."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Part):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None  # None only for an assistant message with calls
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: StrictStr | None = None  # tool messages

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """A part infer cannot read (an image, audio, a file) is named, not a type error."""
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported: only 'text' parts")
        return content

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                "content is required (it may be null only in an assistant message with tool_calls)"
            )
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def plain(self) -> dict[str, Any]:
        """The message as infer's chat code takes it (OpenAI's shape; ``developer`` is ``system``)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDef(_Part):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # calls are always constrained to the parameters when required


class ToolDef(_Part):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Part):
    name: StrictStr


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Part):
    model_config = ConfigDict(populate_by_name=True)
    name: StrictStr = "response"
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None  # the schema is enforced either way


class ResponseFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object")
        return self


class _Common(BaseModel):
    """Fields both endpoints take (the sampling values' ranges: `infer.SamplingParams`)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None  # -1 or 0: off (vLLM: -1)
    seed: StrictInt | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOPS)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None  # vLLM's
    logit_bias: dict[str, StrictFloat] | None = None
    ignore_eos: StrictBool = False  # vLLM's extension: generate max_tokens whatever the model says
    return_token_ids: StrictBool = False  # vLLM's extension: each choice also lists its "token_ids"
    user: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """A field sent as null is as if not sent (OpenAI's nullable ``n``, ``stream``, ``logprobs``,
        ``echo``, ...), for those whose default is not null too."""
        if not isinstance(data, dict):
            return data
        defaults = {name for name, f in cls.model_fields.items() if f.default is not None}
        return {k: v for k, v in data.items() if v is not None or k not in defaults}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None


class CompletionRequest(_Common):
    """``prompt``: a string, token ids, or a list of either (a batch: choice ``i * n + j`` is prompt
    ``i``'s ``j``-th). ``echo``: the prompt is returned before the text, and with ``logprobs`` its
    tokens' scores (`infer.serve.echo`); ``max_tokens: 0`` with it scores without generating."""

    prompt: (
        StrictStr
        | Annotated[list[StrictInt], Field(min_length=1)]
        | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[
            list[Annotated[list[StrictInt], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)
        ]
    )
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None


__all__ = [
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_STOPS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ResponseFormat",
    "StreamOptions",
    "ToolDef",
]
