"""What a request may ask for, checked in one place: `SamplingParams` and the bounds every entry
point shares (the Python API, the CLI's options, the server's bodies, the engine).

Torch-free, so the CLI can name the bounds in its ``--help`` before torch is imported. A bad value
is a `ParamError` (a `ValueError`) or a `ParamTypeError` (a `TypeError`) whose ``param`` names the
argument (the server answers 400 naming that field). Also each prompt's seed in a seeded batch
(`row_seed`), `check_unicode` and `NonFiniteLogitsError`.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes a 64-bit seed
TOP_K_MAX = 2**63 - 1  # top_k travels as an int64 tensor; any k >= the vocabulary keeps every token
MAX_LOGPROBS = 20  # top alternatives per token at most (OpenAI's limit)
PENALTY_MAX = 2.0  # OpenAI's bound on presence / frequency penalties
LOGIT_BIAS_MAX = 100.0  # OpenAI's bound on a logit_bias value
MAX_SPECULATIVE = 32  # tokens proposed per speculative pass at most (any setting)
# Below this temperature a row is greedy: ``logits / t`` overflows float32 as t nears 0 (at 1e-40
# every positive logit became +inf and the draw took the first), and from 1e-5 down the draw is
# the argmax but for logits closer than that (vLLM's ``_SAMPLING_EPS``).
MIN_TEMPERATURE = 1e-5


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or infinite logits (non-finite weights, or overflow in float16/bfloat16)."""


def row_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th prompt of a batch generated with ``seed``: ``seed`` itself for
    the first (so a prompt alone and first in a batch draw the same), distinct for the others."""
    return (seed + index * 0x9E3779B97F4A7C15) % (SEED_MAX + 1)


class ParamError(ValueError):
    """A request's argument has a bad value; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ParamTypeError(TypeError):
    """A request's argument has the wrong type; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]``; `ParamTypeError` for bools, floats and others."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ParamTypeError(name, f"{name} must be an int, got {value!r} ({type(value).__name__})")
    v = operator.index(value)
    if v < minimum or (maximum is not None and v > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ParamError(name, f"{name} must be an int {bound}, got {_int_text(v)}")
    return v


def _int_text(v: int) -> str:
    """``v`` in an error message: a power of two as ``2**n`` (``2**63``), a huge number shortened."""
    if v > 1 and v & (v - 1) == 0 and v >= 2**32:
        return f"2**{v.bit_length() - 1}"
    text = str(v)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"


def check_float(name: str, value: Any) -> float:
    """``value`` as a finite float; `ParamTypeError` for bools and non-numbers, `ParamError` for NaN/inf."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ParamTypeError(name, f"{name} must be a number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v):
        raise ParamError(name, f"{name} must be finite, got {v}")
    return v


def check_unicode(what: str, text: str) -> None:
    """`ParamError` naming ``what`` when ``text`` holds a lone surrogate (``"\\ud800"``): not
    encodable as UTF-8 (a prompt, a message's content, a stop string)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ParamError(
            what,
            f"{what}: holds {text[e.start]!r} at index {e.start}, a lone surrogate, which is not valid "
            "Unicode: text must be encodable as UTF-8 (decode bytes with errors='replace')",
        ) from None


def check_stop(stop: Any) -> tuple[str, ...]:
    """``stop`` (None, a string, or a list of strings) as a tuple of non-empty, valid strings; an
    empty one is a `ParamError` naming it (``stop[1]``)."""
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple):
        raise ParamTypeError("stop", f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for i, s in enumerate(items):
        where = "stop" if isinstance(stop, str) else f"stop[{i}]"
        if not isinstance(s, str):
            message = f"stop must be a string or a list of strings, found {s!r} ({type(s).__name__})"
            raise ParamTypeError(where, message)
        if not s:
            what = "stop must be a string or a list of strings, and stop strings must be non-empty"
            raise ParamError(where, f"{what}: {where} is ''")
        check_unicode(where, s)
    return tuple(items)


def check_max_new_tokens(value: Any) -> int:
    """``max_new_tokens`` is an int >= 1: a generation call always generates."""
    return check_int("max_new_tokens", value, 1)


def check_logit_bias(bias: Any, vocab_size: int | None = None) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (ids as ints or decimal strings, as OpenAI sends them) as sorted pairs;
    each bias finite in [-100, 100]; with ``vocab_size``, ids below it."""
    if bias is None:
        return ()
    if isinstance(bias, tuple):
        items: Any = bias
    elif isinstance(bias, Mapping):
        items = bias.items()
    else:
        raise ParamTypeError(
            "logit_bias", f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}"
        )
    out: dict[int, float] = {}
    for key, value in items:
        try:
            if isinstance(key, bool):
                raise ValueError
            token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
            if not isinstance(token, int) or isinstance(token, bool):
                raise ValueError
        except ValueError:
            raise ParamError("logit_bias", f"logit_bias: keys must be token ids, got {key!r}") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ParamError("logit_bias", f"logit_bias: token id {token} is out of range {bound}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ParamError("logit_bias", f"logit_bias[{token}]: must be a finite number, got {value!r}")
        if not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX:
            raise ParamError("logit_bias", f"logit_bias[{token}]: must be in [-100, 100], got {value}")
        out[token] = float(value)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    """One request's generation settings, checked and normalized on construction (errors name the
    field: `ParamError`, `ParamTypeError`): the one definition of a request's values, which
    `infer.LLM`'s keywords and the server's bodies are turned into, and the one check of them.

    The first four are the sampling values (positional: ``SamplingParams(0.7, 40)`` is temperature
    0.7, top-k 40):
    ``temperature`` finite and >= 0 (0 is greedy), ``top_k`` in [0, 2**63 - 1] (0: off), ``top_p``
    in (0, 1] (1: off), ``seed`` None or in [0, 2**64 - 1]. The rest are what the engine honours
    per request beside them. What depends on the model (a biased token id below the vocabulary, a
    constraint that compiles) is the engine's check.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256  # new tokens at most
    stop: tuple[str, ...] = ()  # stop strings (text is cut before them); None, a string, a list taken too
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS ids
    logprobs: int | None = None  # None: none; 0: the chosen token's; k>0: also the top k alternatives
    ignore_eos: bool = False
    constraint: Any = None  # an `infer.text.structured.Constraint` the text must match, or None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a dict, None taken too
    presence_penalty: float = 0.0  # in [-2, 2], OpenAI's
    frequency_penalty: float = 0.0  # in [-2, 2], OpenAI's
    repetition_penalty: float = 1.0  # > 0, 1 = off (vLLM's and transformers')
    speculative: int | None = None  # tokens proposed per pass at most (None: the model's setting; 0: off)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        temperature = check_float("temperature", self.temperature)
        if temperature < 0:
            raise ParamError(
                "temperature",
                f"temperature must be >= 0 (0, or below {MIN_TEMPERATURE}, is greedy), got {temperature}",
            )
        top_p = check_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {top_p}")
        put("temperature", temperature)
        put("top_k", check_int("top_k", self.top_k, 0, TOP_K_MAX))
        put("top_p", top_p)
        if self.seed is not None:
            put("seed", check_int("seed", self.seed, 0, SEED_MAX))
        put("max_tokens", check_int("max_tokens", self.max_tokens, 1))
        put("stop", check_stop(self.stop))
        ids = self.stop_token_ids
        if not isinstance(ids, list | tuple):
            raise ParamTypeError(
                "stop_token_ids", f"stop_token_ids must be a list of ints, got {type(ids).__name__}"
            )
        put("stop_token_ids", tuple(check_int("stop_token_ids", i, 0) for i in ids))
        if self.logprobs is not None:
            put("logprobs", check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        if not isinstance(self.ignore_eos, bool):
            raise ParamTypeError("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.constraint is not None and type(self.constraint).__name__ != "Constraint":
            # (checked by name: this module sits below it)
            what = f"must be an infer.text.structured.Constraint, got {self.constraint!r}"
            raise ParamTypeError("constraint", f"constraint {what}")
        put("logit_bias", check_logit_bias(self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            value = check_float(name, getattr(self, name))
            if not -PENALTY_MAX <= value <= PENALTY_MAX:
                raise ParamError(name, f"{name} must be in [-2, 2], got {value}")
            put(name, value)
        repetition = check_float("repetition_penalty", self.repetition_penalty)
        if repetition <= 0:
            message = f"repetition_penalty must be > 0 (1 is off), got {repetition}"
            raise ParamError("repetition_penalty", message)
        put("repetition_penalty", repetition)
        if self.speculative is not None:
            check_int("speculative", self.speculative, 0, MAX_SPECULATIVE)

    @property
    def greedy(self) -> bool:
        """Whether rows with these settings take the argmax: temperature 0, or below `MIN_TEMPERATURE`."""
        return self.temperature < MIN_TEMPERATURE

    def row(self, index: int) -> SamplingParams:
        """The settings of the ``index``-th prompt of a batch (or choice of a request) made with these:
        a seeded sampled one draws from `row_seed` ``(seed, index)``, so each row draws its own and
        the first draws as it would alone."""
        if index == 0 or self.seed is None or self.greedy:
            return self
        return replace(self, seed=row_seed(self.seed, index))

    @property
    def processed(self) -> bool:
        """Whether the row's logits are processed (a constraint, a bias or a penalty): see
        `infer.text.structured.RowProcessor`."""
        return (
            self.constraint is not None
            or bool(self.logit_bias)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


__all__ = [
    "LOGIT_BIAS_MAX",
    "MAX_LOGPROBS",
    "MAX_SPECULATIVE",
    "MIN_TEMPERATURE",
    "PENALTY_MAX",
    "SEED_MAX",
    "TOP_K_MAX",
    "NonFiniteLogitsError",
    "ParamError",
    "ParamTypeError",
    "SamplingParams",
    "check_float",
    "check_int",
    "check_logit_bias",
    "check_max_new_tokens",
    "check_stop",
    "check_unicode",
    "row_seed",
]
