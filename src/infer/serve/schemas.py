"""Request bodies of the OpenAI API as pydantic models (the fields infer serves; others are ignored).

Types and ranges are checked here, so a wrong one is a 400 naming the field before
anything reaches the engine. Fields clients send that infer does not use (``user``,
``presence_penalty`` at 0, ...) are accepted and ignored, as vLLM does; a value infer
cannot honour (``n`` > 1, a non-zero penalty) is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

SEED_MAX = 2**64 - 1
TOP_K_MAX = 2**63 - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat; completions' `logprobs` int: 5 there, 20 here


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class _Common(BaseModel):
    """Fields both endpoints take."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: NonNegFloat | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=TOP_K_MAX)] | None = None  # -1 or 0: off (vLLM: -1)
    seed: Annotated[StrictInt, Field(ge=0, le=SEED_MAX)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    presence_penalty: Annotated[float, Field(ge=0.0, le=0.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=0.0, le=0.0)] | None = None
    ignore_eos: StrictBool = False  # vLLM's extension: generate max_tokens whatever the model says
    return_token_ids: StrictBool = False  # vLLM's extension: each choice also lists its "token_ids"
    user: Any = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


class CompletionRequest(_Common):
    prompt: (
        StrictStr
        | Annotated[list[StrictInt], Field(min_length=1)]
        | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
    )
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: Annotated[StrictBool, Field(description="not supported: must be false")] = False
    suffix: StrictStr | None = None


__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "StreamOptions"]
