"""`ServedModel`: what a server shows of the model an engine serves, and nothing more: its name, its
tokenizer (prompts, chat templates, logprobs' text), its vocabulary (logit bias ids) and the
engine's context (``max_model_len``). `infer.serve` takes an engine client and this description;
a test's scripted engine describes a tokenizer without loading a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infer.loader.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServedModel:
    """The model a server serves (`infer.engine.Engine.served`)."""

    name: str
    tokenizer: Tokenizer
    vocab_size: int
    context: int

    def chat_prompt(
        self, messages: Sequence[dict[str, Any]], *, parse_special_in_content: bool = False
    ) -> list[int]:
        """The token ids of ``messages`` rendered by the chat template, with the assistant's turn opened."""
        ids: list[int] = self.tokenizer.encode_chat(
            list(messages), add_generation_prompt=True, parse_special_in_content=parse_special_in_content
        )
        return ids


__all__ = ["ServedModel"]
