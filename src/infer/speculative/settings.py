"""Speculative decoding's settings (`Speculative`: what `infer.load` takes) and the check that a
draft model fits its target (`check_draft`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infer.params import MAX_SPECULATIVE, check_int

MAX_TOKENS = MAX_SPECULATIVE  # proposed tokens per pass at most (any setting)
DEFAULT_TOKENS = 16  # proposed tokens per pass at most, unless set
MAX_LOOKUP = 16  # n-gram lookup matches the last N tokens at most
KNEE_TOKENS = 8  # cost prior: a forward of N tokens costs ~ (1 + N / KNEE_TOKENS) units
PROBE_EVERY = 64  # passes skipped because they looked too costly before one is tried again
DECAY = 0.9  # per pass: how fast a row's acceptance estimate forgets
MARGIN = 0.05  # a verify pass must promise 5% more tokens per second than a plain decode step


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding settings of a loaded model (`infer.load(..., lookup=, draft=,
    speculative_tokens=)`).

    ``lookup``: n-gram lookup, trying the last ``lookup`` tokens first, then fewer (0: off).
    ``draft``: a draft model (an `infer.LLM` whose tokenizer equals the target's), or None.
    ``max_tokens``: tokens proposed per pass at most; each pass proposes what pays (0 to this).
    """

    lookup: int = 0
    draft: Any = None  # infer.LLM | None (Any: the API sits above this module)
    max_tokens: int = DEFAULT_TOKENS

    def __post_init__(self) -> None:
        check_int("lookup", self.lookup, 0, MAX_LOOKUP)
        check_int("speculative_tokens", self.max_tokens, 1, MAX_TOKENS)
        if self.lookup == 0 and self.draft is None:
            raise ValueError("speculative decoding needs lookup >= 1 or a draft model")

    @property
    def method(self) -> str:
        parts = []
        if self.draft is not None:
            parts.append("draft")
        if self.lookup:
            parts.append(f"lookup{self.lookup}")
        return "+".join(parts)


def check_draft(target: Any, draft: Any) -> None:
    """`ValueError` unless ``draft`` (an `infer.LLM`) can propose tokens for ``target``: the same
    tokens under the same ids (the first that differs is named), on the same device."""
    a, b = target.tokenizer, draft.tokenizer
    na, nb = a.vocab_size, b.vocab_size
    ta: list[str] = a.hf.convert_ids_to_tokens(list(range(na)))
    tb: list[str] = b.hf.convert_ids_to_tokens(list(range(nb)))
    where = f"draft model {draft.source}"
    for i in range(max(na, nb)):
        x = ta[i] if i < na else None
        y = tb[i] if i < nb else None
        if x != y:
            raise ValueError(
                f"{where}: its tokenizer differs from the target's ({target.source}) at token id {i}: "
                f"{x!r} in the target, {y!r} in the draft ({na} and {nb} tokens)"
            )
    if draft.model.device != target.model.device:
        raise ValueError(f"{where} is on {draft.model.device}, the target on {target.model.device}")
    if draft.speculative is not None:
        raise ValueError(f"{where} has speculative settings of its own; load it without them")
