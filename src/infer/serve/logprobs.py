"""Logprobs in OpenAI's two formats: chat's (``content``: token, logprob, bytes, top_logprobs) and
completions' (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

from infer.engine import TokenLogprob

if TYPE_CHECKING:
    from infer.loader.tokenizer import Tokenizer


@functools.cache
def byte_decoder() -> dict[str, int]:
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


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_bytes(tokenizer: Tokenizer, token_id: int, text: str | None = None) -> bytes:
    """A token's bytes: from its byte-level BPE spelling or a SentencePiece ``<0xHH>`` piece, or its
    text (a byte-level token that is part of a UTF-8 character decodes to U+FFFD)."""
    if text is None:
        text = token_text(tokenizer, token_id)
    convert = getattr(tokenizer.hf, "convert_ids_to_tokens", None)  # transformers' or tokenizers'
    piece = convert(token_id) if convert is not None else None
    if isinstance(piece, str) and piece:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            with contextlib.suppress(ValueError):
                return bytes([int(piece[3:5], 16)])
        if "\ufffd" in text:
            decoder = byte_decoder()
            if all(c in decoder for c in piece):
                return bytes(decoder[c] for c in piece)
    return text.encode("utf-8")


def chat_logprobs(tokenizer: Tokenizer, items: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``: each token with its bytes and top alternatives."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(token_bytes(tokenizer, token_id, text))}

    return [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in items
    ]


def text_logprobs(tokenizer: Tokenizer, items: list[TokenLogprob], offset: int) -> tuple[dict[str, Any], int]:
    """Completions' ``logprobs`` of tokens whose text starts at ``offset`` of the choice's text, and
    the offset after them."""
    tokens, offsets = [], []
    for lp in items:
        text = token_text(tokenizer, lp.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    out = {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{token_text(tokenizer, i): v for i, v in lp.top} for lp in items],
        "text_offset": offsets,
    }
    return out, offset


__all__ = ["byte_decoder", "chat_logprobs", "text_logprobs", "token_bytes", "token_text"]
