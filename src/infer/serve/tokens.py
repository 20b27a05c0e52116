"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info``: the served model's tokenizer over HTTP, in
vLLM's shape (``prompt`` / ``messages``, ``add_special_tokens``; ``tokens``, ``count``,
``max_model_len``; ``prompt`` back) and llama-server's (``content``, ``add_special``,
``with_pieces``; ``content`` back). lm-eval's remote tokenizer (``tokenizer_backend=remote``) reads
``/tokenizer_info`` and these two."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from infer.serve.errors import bad
from infer.serve.logprobs import token_text
from infer.serve.schemas import ChatMessage
from infer.serve.state import ServeState


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: StrictStr | None = None  # vLLM
    content: StrictStr | None = None  # llama-server
    messages: list[ChatMessage] | None = None  # vLLM: the chat rendered with its template
    add_special_tokens: StrictBool | None = None  # vLLM (default true)
    add_special: StrictBool | None = None  # llama-server (default false)
    add_generation_prompt: StrictBool = True
    with_pieces: StrictBool = False  # llama-server: each token with its text


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: Annotated[list[StrictInt], Field(min_length=0)]


def _check_model(state: ServeState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise bad(f"model {model!r} is not served here; this server serves {state.model_name!r}", "model")


def tokenize(state: ServeState, body: TokenizeRequest) -> dict[str, Any]:
    _check_model(state, body.model)
    tokenizer = state.model.tokenizer
    given = [k for k in ("prompt", "content", "messages") if getattr(body, k) is not None]
    if len(given) != 1:
        raise bad("give exactly one of prompt, content or messages", given[1] if given else "prompt")
    if body.messages is not None:
        text = tokenizer.apply_chat_template([m.plain() for m in body.messages], body.add_generation_prompt)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        text = body.prompt if body.prompt is not None else body.content or ""
        add = body.add_special_tokens
        if add is None:
            add = body.add_special if body.add_special is not None else body.prompt is not None
        ids = tokenizer.encode(text, add_special_tokens=add)
    tokens: list[Any] = list(ids)
    if body.with_pieces:
        tokens = [{"id": t, "piece": token_text(tokenizer, t)} for t in ids]
    return {"tokens": tokens, "count": len(ids), "max_model_len": state.context}


def detokenize(state: ServeState, body: DetokenizeRequest) -> dict[str, Any]:
    _check_model(state, body.model)
    vocab = state.model.vocab_size
    for i, t in enumerate(body.tokens):
        if not 0 <= t < vocab:
            raise bad(f"tokens[{i}]: {t} is not a token id (the vocabulary has {vocab})", f"tokens[{i}]")
    text = state.model.tokenizer.decode(body.tokens, skip_special_tokens=False)
    return {"prompt": text, "content": text}


def tokenizer_info(state: ServeState) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info``: the special tokens' texts, the chat template, the context."""
    tokenizer = state.model.tokenizer

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else token_text(tokenizer, token_id)

    eos = tokenizer.eos_token_ids
    return {
        "eos_token": text(eos[0] if eos else None),
        "bos_token": text(tokenizer.bos_token_id),
        "pad_token": text(tokenizer.pad_token_id),
        "chat_template": tokenizer.chat_template,
        "model_max_length": state.context,
        "vocab_size": state.model.vocab_size,
    }


__all__ = ["DetokenizeRequest", "TokenizeRequest", "detokenize", "tokenize", "tokenizer_info"]
