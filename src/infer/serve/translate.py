"""A request body as the engine takes it: the prompt's token ids (`prompt_ids`; chat: rendered
with its tools), the constraint compiled (`compile_constraint`) and its `infer.SamplingParams`
(`sampling_params`), which checks the sampling values. What the engine or `SamplingParams`
refuses becomes a 400 naming the request's field (`refusal`): `infer.params.ParamError` carries
the argument's name."""

from __future__ import annotations

from typing import Any

from infer.params import MAX_LOGPROBS, ParamError, ParamTypeError, SamplingParams
from infer.serve.errors import APIError, bad
from infer.serve.fields import FieldError, tool_chat_of
from infer.serve.state import ServeState
from infer.text.prompts import ToolChat, encode_prompt, has_chat_template
from infer.text.structured import Constraint

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


def prompt_ids(
    state: ServeState, kind: str, body: Any, constraint: Constraint | None
) -> tuple[list[int], str, ToolChat | None]:
    """The prompt's token ids, the name of the field that holds it, and (chat) the rendered chat
    with its tools and the constraint to generate under. A text prompt is checked as it is
    encoded (`infer.text.prompts.encode_prompt`); token ids are the engine's to check (its
    `ValueError` is a 400 naming ``prompt``)."""
    model = state.model
    if kind == "chat":
        if not has_chat_template(model):
            raise bad(
                f"model {state.model_name!r} has no chat template: use /v1/completions", "messages",
                "no_chat_template",
            )  # fmt: skip
        try:
            chat = tool_chat_of(model, body, constraint)
        except FieldError as e:
            raise bad(str(e), e.param) from None
        return chat.ids, "messages", chat
    (ids, _), *_ = completion_prompts(state, body)
    return ids, "prompt", None


def completion_prompts(state: ServeState, body: Any) -> list[tuple[list[int], str | None]]:
    """A completions request's prompts (one, or a batch), each as token ids and the text it was
    sent as (None for token ids)."""
    if body.suffix:
        raise bad("suffix is not supported", "suffix", "unsupported")
    model = state.model
    prompt = body.prompt
    items = prompt if isinstance(prompt, list) and isinstance(prompt[0], str | list) else [prompt]
    out: list[tuple[list[int], str | None]] = []
    for i, item in enumerate(items):
        if not isinstance(item, str):
            out.append((list(item), None))
            continue
        try:
            out.append((encode_prompt(model.tokenizer, model.vocab_size, item), item))
        except ValueError as e:
            text = str(e) if len(items) == 1 else f"prompt[{i}]: {e}"
            raise bad(text, "prompt") from None
    return out


def check_echo(state: ServeState, body: Any, prompts: list[tuple[list[int], str | None]]) -> None:
    """What ``echo`` cannot be asked with: a 400 naming the field (streaming, logprobs past what is
    kept or without a scorer, ``max_tokens: 0`` without echo, a prompt past the context or with
    ids outside the vocabulary: an echoed prompt is scored before the engine sees it)."""
    if body.max_tokens == 0 and not body.echo:
        raise bad("max_tokens is 0: only echo: true scores a prompt without generating", "max_tokens")
    if not body.echo:
        return
    if body.stream:
        raise bad("echo is not supported with stream: true", "echo", "unsupported")
    if body.logprobs is not None:
        if not 0 <= body.logprobs <= MAX_LOGPROBS:
            raise bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {body.logprobs}", "logprobs")
        if state.scorer is None:
            raise bad(
                "echo with logprobs needs the model resident in the server's process "
                "(not under tensor/pipeline parallelism or layer streaming)", "echo", "unsupported",
            )  # fmt: skip
    for ids, _ in prompts:
        if len(ids) > state.context:
            raise bad(
                f"prompt: the prompt has {len(ids)} tokens; the context is {state.context} tokens",
                "prompt", "context_length_exceeded",
            )  # fmt: skip
        if ids and (max(ids) >= state.model.vocab_size or min(ids) < 0):
            raise bad(f"prompt: token ids must be in [0, {state.model.vocab_size})", "prompt")


def compile_constraint(state: ServeState, constraint: Constraint | None, param: str) -> None:
    """Compile ``constraint`` now (cached for the engine), so a schema llguidance cannot enforce is a
    400 naming ``param``."""
    if constraint is None:
        return
    try:
        state.engine.grammars.matcher(constraint)
    except ValueError as e:
        text = str(e).split(": ", 1)[-1] if str(e).startswith(f"{constraint.what}:") else str(e)
        raise bad(f"{param}: {text.splitlines()[0]}", param, "invalid_schema") from None


def request_field(kind: str, param: str, max_tokens_field: str = "max_tokens") -> str:
    """The request's field for `SamplingParams`' argument ``param`` (chat: ``top_logprobs`` is the
    count of alternatives, ``max_completion_tokens`` may stand for ``max_tokens``)."""
    if param == "max_tokens":
        return max_tokens_field
    if param == "logprobs" and kind == "chat":
        return "top_logprobs"
    return param


def refusal(
    e: ValueError | TypeError, kind: str, prompt_field: str, max_tokens_field: str = "max_tokens"
) -> APIError:
    """A 400 for what the engine or `SamplingParams` refused: ``param`` the field `ParamError` /
    `ParamTypeError` names (and the message with it: ``top_logprobs`` for ``logprobs``), the
    prompt's field for an error about the prompt, else None."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, ParamError | ParamTypeError):
        field = request_field(kind, e.param, max_tokens_field)
        if field != e.param and text.startswith(e.param):
            text = field + text[len(e.param) :]
        return bad(text, field)
    return bad(text, prompt_field if text.startswith("prompt") else None)


def sampling_params(
    state: ServeState,
    kind: str,
    body: Any,
    prompt_len: int,
    prompt_field: str,
    constraint: Constraint | None = None,
) -> SamplingParams:
    """The request's `SamplingParams` (a 400 naming the field for a value it refuses); ``max_tokens``
    defaults to the rest of the context (chat) or 16 (completions), and must fit the context."""
    context = state.context
    if prompt_len >= context:
        raise bad(
            f"{prompt_field}: the prompt has {prompt_len} tokens; the model's context is {context} tokens "
            "(room is needed for at least one new token)",
            prompt_field,
            "context_length_exceeded",
        )
    room = context - prompt_len
    field_name = "max_tokens"
    max_tokens = body.max_tokens
    if kind == "chat" and body.max_completion_tokens is not None:
        if max_tokens is not None and max_tokens != body.max_completion_tokens:
            raise bad(
                f"max_tokens ({max_tokens}) and max_completion_tokens ({body.max_completion_tokens}) "
                "differ: send one of them", "max_tokens",
            )  # fmt: skip
        field_name, max_tokens = "max_completion_tokens", body.max_completion_tokens
    if max_tokens is None:
        max_tokens = room if kind == "chat" else min(DEFAULT_COMPLETION_TOKENS, room)
    elif max_tokens > room:
        raise bad(
            f"{field_name} is {max_tokens}, but the prompt has {prompt_len} tokens and the model's "
            f"context is {context}: at most {room} new tokens fit",
            field_name,
            "context_length_exceeded",
        )
    if kind == "chat":
        if body.top_logprobs is not None and not body.logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    values: dict[str, Any] = {  # OpenAI's defaults where they are not infer's
        "max_tokens": max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_k": 0 if body.top_k == -1 else body.top_k or 0,  # vLLM's -1: off
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "seed": body.seed,
        "stop": body.stop,
        "logprobs": logprobs,
        "ignore_eos": body.ignore_eos,
        "constraint": constraint,
        "logit_bias": body.logit_bias,  # ids past the vocabulary: the engine's check
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
    }
    try:
        return SamplingParams(**values)
    except (ParamError, ParamTypeError) as e:
        raise refusal(e, kind, prompt_field, field_name) from None


__all__ = [
    "DEFAULT_COMPLETION_TOKENS",
    "check_echo",
    "compile_constraint",
    "completion_prompts",
    "prompt_ids",
    "refusal",
    "request_field",
    "sampling_params",
]
