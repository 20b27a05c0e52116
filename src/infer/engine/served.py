"""`ServedModel`: what a server shows of the model an engine serves, and nothing more: its name, its
tokenizer (prompts, chat templates, logprobs' text: `infer.text.prompts`), its vocabulary (logit
bias ids) and the engine's context (``max_model_len``). `infer.serve` takes an engine client and
this description; a test's scripted engine describes a tokenizer without loading a model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infer.loader.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServedModel:
    """The model a server serves (`infer.engine.Engine.served`)."""

    name: str
    tokenizer: Tokenizer
    vocab_size: int
    context: int


__all__ = ["ServedModel"]
