"""How a user's text becomes a prompt: the one place `infer generate`, `infer chat` and `infer serve` share.

An instruct model (its tokenizer has a chat template) gets its text as a user message
rendered by that template, with the assistant's turn opened, as mlx-lm and llama.cpp's CLI
do; ``raw=True`` (``--raw``), or a model without a template, encodes the text as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from infer.chat_template import check_unicode

Message = dict[str, Any]


def has_chat_template(llm: Any) -> bool:
    """Whether ``llm``'s tokenizer carries a chat template."""
    return getattr(llm.tokenizer, "chat_template", None) is not None


def user_messages(text: str, system: str | None = None) -> list[Message]:
    """``text`` as a one-turn conversation (after ``system``'s message when given)."""
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    return messages


def chat_ids(llm: Any, messages: Sequence[Message]) -> list[int]:
    """The token ids of ``messages`` rendered by ``llm``'s chat template, the assistant's turn opened.

    `ValueError` when the model has no chat template (it names the way out: a plain prompt).
    """
    if not has_chat_template(llm):
        raise ValueError("this model's tokenizer has no chat template: send a plain prompt (completions)")
    ids: list[int] = llm.chat_prompt(list(messages))
    return ids


def prompt_ids(llm: Any, text: str, *, raw: bool = False, system: str | None = None) -> str | list[int]:
    """What to generate from for a user's ``text``: the chat-templated ids, or ``text`` itself.

    The text itself (encoded by `LLM.generate`) when ``raw`` or the model has no chat
    template; an empty ``text`` is a `ValueError` either way (a template would hide it).
    """
    if not isinstance(text, str):
        raise TypeError(f"prompt must be a string, got {type(text).__name__}")
    if not text:
        raise ValueError("prompt is empty (an empty string)")
    check_unicode("prompt", text)
    if raw or not has_chat_template(llm):
        if system:
            raise ValueError(
                "--system needs a chat template; this is a plain completion (--raw or no template)"
            )
        return text
    return chat_ids(llm, user_messages(text, system))


__all__ = ["chat_ids", "has_chat_template", "prompt_ids", "user_messages"]
