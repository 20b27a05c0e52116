"""Structured output: a per-request constraint (JSON schema, regex, grammar) and logits processing.

`Constraint` says what a request's text must match; `Grammars` compiles constraints for one
tokenizer with llguidance and caches them; `RowProcessor` is the engine's per-row seam
(penalties, logit bias, the grammar's mask). See docs/structured.md.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch

from infer.params import check_logit_bias

if TYPE_CHECKING:
    import llguidance

Kind = Literal["json_schema", "regex", "grammar"]

# JSON is written compactly with a space after ',' and ':' (what models write, as json.dumps does),
# and no other whitespace: a model cannot spend its tokens on blank space.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_CACHE = 256  # compiled grammars kept per tokenizer


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (a schema keyword llguidance cannot enforce, a bad regex,
    a grammar syntax error); the message names the argument (``json_schema``, ``regex``, ``grammar``)."""


@dataclass(frozen=True)
class Constraint:
    """What a request's generated text must match. Make one with `json_schema`, `json_object`,
    `regex` or `grammar`; ``source`` is its canonical text (equal constraints share a compiled grammar)."""

    kind: Kind
    source: str
    model: Any = field(default=None, compare=False)  # the pydantic class the schema came from, if any

    @property
    def what(self) -> str:
        """The argument it came from, for error messages."""
        return self.kind

    @staticmethod
    def json_schema(schema: Any) -> Constraint:
        """A JSON schema: a dict, its JSON text, or a pydantic model class (its ``model_json_schema()``)."""
        model = None
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            model = schema
            schema = schema.model_json_schema()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"json_schema: not valid JSON: {e}") from None
        if isinstance(schema, bool):
            raise ConstraintError("json_schema: must be an object (a dict), not a boolean schema")
        if not isinstance(schema, Mapping):
            raise TypeError(
                "json_schema must be a dict, a JSON string or a pydantic model class, "
                f"got {type(schema).__name__}"
            )
        try:
            text = json.dumps(schema, sort_keys=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConstraintError(f"json_schema: not JSON data: {e}") from None
        return Constraint("json_schema", text, model)

    @staticmethod
    def json_object() -> Constraint:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return Constraint("json_schema", '{"type":"object"}')

    @staticmethod
    def regex(pattern: str) -> Constraint:
        """The whole generated text matches ``pattern`` (Rust regex syntax, anchored at both ends)."""
        if not isinstance(pattern, str):
            raise TypeError(f"regex must be a string, got {type(pattern).__name__}")
        if not pattern:
            raise ConstraintError("regex is empty")
        return Constraint("regex", pattern)

    @staticmethod
    def grammar(text: str) -> Constraint:
        """A context-free grammar: llguidance's Lark dialect (``start: ...``) or llama.cpp's GBNF
        (``root ::= ...``; converted to Lark by llguidance)."""
        if not isinstance(text, str):
            raise TypeError(f"grammar must be a string, got {type(text).__name__}")
        if not text.strip():
            raise ConstraintError("grammar is empty")
        return Constraint("grammar", text)

    def llguidance_grammar(self) -> str:
        """The llguidance grammar definition (JSON text) of this constraint."""
        import llguidance

        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        try:
            return llguidance.grammar_from("grammar", self.source)
        except ValueError as e:  # a GBNF grammar that does not convert
            raise ConstraintError(f"grammar: {str(e).splitlines()[0]}") from None


def constraint_of(
    json_schema: Any = None, regex: str | None = None, grammar: str | None = None
) -> Constraint | None:
    """The one constraint these arguments ask for (None for none); `ValueError` when several are given."""
    given = [name for name, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar))
             if v is not None]  # fmt: skip
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema, regex and grammar, got {' and '.join(given)}")
    if json_schema is not None:
        return Constraint.json_schema(json_schema)
    if regex is not None:
        return Constraint.regex(regex)
    if grammar is not None:
        return Constraint.grammar(grammar)
    return None


class Vocabulary(Protocol):
    """What `Grammars` reads of a tokenizer (`infer.loader.tokenizer.Tokenizer` has it)."""

    def backend_json(self) -> str: ...


class Grammars:
    """Compiles constraints for one tokenizer and keeps the compiled grammars (thread-safe).

    The llguidance vocabulary is built on first use; `GRAMMAR_CACHE` compiled grammars are kept,
    and each request gets its own copy of its matcher.
    """

    def __init__(self, tokenizer: Vocabulary, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._lock = threading.Lock()
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltokenizer is None:
                import llguidance

                self._lltokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend_json(), n_vocab=self.vocab_size, eos_token=self.eos_ids
                )
            return self._lltokenizer

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for ``constraint`` (`ConstraintError` naming it when it does not compile)."""
        import llguidance

        lltokenizer = self.lltokenizer
        with self._lock:
            pristine = self._compiled.get(constraint)
            if pristine is not None:
                self._compiled.move_to_end(constraint)
                return pristine.deep_copy()
        grammar = constraint.llguidance_grammar()
        pristine = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
        if pristine.is_error():
            raise ConstraintError(f"{constraint.what}: {_first_line(pristine.get_error())}")
        probe = pristine.deep_copy()  # a constraint that matches no text fails at its first mask
        probe.compute_bitmask()
        if probe.is_error():
            raise ConstraintError(f"{constraint.what}: matches no text ({_first_line(probe.get_error())})")
        with self._lock:
            self._compiled[constraint] = pristine
            while len(self._compiled) > GRAMMAR_CACHE:
                self._compiled.popitem(last=False)
        return pristine.deep_copy()

    def is_special(self, token_id: int) -> bool:
        return bool(self.lltokenizer.is_special_token(token_id))


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "invalid"


class RowProcessor:
    """One request's logits processing: penalties, logit bias and the grammar's mask, in that order.

    ``apply(logits)`` changes that row's ``[V]`` float32 logits in place (penalties, bias) and
    returns the ids the constraint allows, ascending (None without a constraint): the engine
    samples among those only. ``accept(token)`` takes the sampled token (advances the matcher;
    counts it for the penalties) and says whether the constraint is complete (only EOS may follow).
    ``error`` is set when the matcher refused a token, allows none, or its grammar hit a limit:
    the engine ends the request with it.

    Penalties as OpenAI and vLLM define them: ``presence_penalty`` is subtracted once from every
    token generated so far, ``frequency_penalty`` once per time it was generated;
    ``repetition_penalty`` (vLLM's and transformers' extension, 1 = off) divides the positive
    logits and multiplies the negative ones of every token in the prompt or generated so far.
    """

    def __init__(
        self,
        vocab_size: int,
        prompt: Sequence[int],
        *,
        matcher: llguidance.LLMatcher | None = None,
        logit_bias: Sequence[tuple[int, float]] = (),
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
    ) -> None:
        self.vocab_size = vocab_size
        self.matcher = matcher
        self.presence = presence_penalty
        self.frequency = frequency_penalty
        self.repetition = repetition_penalty
        self.error: str | None = None
        self.counts: dict[int, int] = {}
        self._seen: set[int] = set(prompt) if repetition_penalty != 1.0 else set()
        self._bias_ids = torch.tensor([t for t, _ in logit_bias], dtype=torch.long)
        self._bias = torch.tensor([b for _, b in logit_bias], dtype=torch.float32)
        words = (vocab_size + 31) // 32
        self._mask = np.zeros(words, dtype=np.int32)  # one bit per token, as llguidance writes it

    @property
    def constrained(self) -> bool:
        return self.matcher is not None

    def apply(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Penalties and bias on one row's ``logits [V]`` (float32, in place); the allowed ids."""
        if self.repetition != 1.0 and self._seen:
            ids = torch.tensor(sorted(self._seen), dtype=torch.long, device=logits.device)
            got = logits[ids]
            logits[ids] = torch.where(got > 0, got / self.repetition, got * self.repetition)
        if (self.presence or self.frequency) and self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long, device=logits.device)
            n = torch.tensor(list(self.counts.values()), dtype=torch.float32, device=logits.device)
            logits[ids] -= self.frequency * n + self.presence
        if self._bias_ids.numel():
            logits[self._bias_ids.to(logits.device)] += self._bias.to(logits.device)
        if self.matcher is None:
            return None
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        if self.matcher.is_error():
            self.error = _first_line(self.matcher.get_error())
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: logits.shape[-1]]
        allowed = torch.from_numpy(np.flatnonzero(bits)).to(logits.device)
        if not allowed.numel() and self.error is None:
            self.error = "the constraint allows no token here"
        return allowed

    def adjust(self, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """What `apply` does to the logits of tokens ``ids [K]`` (penalties, bias), on their values
        ``[K]`` (float32): a copy, no mask."""
        out = values.clone()
        ids_list = ids.tolist()
        if self.repetition != 1.0 and self._seen:
            seen = torch.tensor([t in self._seen for t in ids_list], dtype=torch.bool, device=out.device)
            out = torch.where(seen, torch.where(out > 0, out / self.repetition, out * self.repetition), out)
        if (self.presence or self.frequency) and self.counts:
            n = torch.tensor(
                [self.counts.get(t, 0) for t in ids_list], dtype=torch.float32, device=out.device
            )
            out = out - torch.where(n > 0, self.frequency * n + self.presence, 0.0)
        if self._bias_ids.numel():
            bias = dict(zip(self._bias_ids.tolist(), self._bias.tolist(), strict=True))
            out = out + torch.tensor(
                [bias.get(t, 0.0) for t in ids_list], dtype=torch.float32, device=out.device
            )
        return out

    def accept(self, token: int) -> bool:
        """Take the sampled ``token``; whether the constraint is now complete."""
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.repetition != 1.0:
            self._seen.add(token)
        if self.matcher is None:
            return False
        if not self.matcher.consume_token(token):
            self.error = f"the constraint refused token {token}: {_first_line(self.matcher.get_error())}"
            return False
        return bool(self.matcher.is_stopped())


__all__ = [
    "Constraint",
    "ConstraintError",
    "Grammars",
    "RowProcessor",
    "check_logit_bias",
    "constraint_of",
]
