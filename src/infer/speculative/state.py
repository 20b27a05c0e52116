"""A request's speculation state: its n-gram index, its acceptance estimates and its noise, and
what speculation reads of a request (`Speculating`).

Kept on the engine's request (`infer.engine.request.Request`); nothing here runs the model."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from infer.params import SamplingParams
from infer.sampling import gumbel_noise
from infer.speculative.settings import DECAY


class NgramIndex:
    """Where each n-gram (``n <= max_n``) of a growing token sequence last ended.

    `propose` finds the latest earlier occurrence of the sequence's last ``n`` tokens (``n``
    from ``max_n`` down to 1) and returns the tokens that followed it. Appending a token
    costs ``max_n`` dictionary updates; a proposal ``max_n`` lookups.
    """

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        self._before: dict[tuple[int, ...], int] = {}  # the occurrence before the last

    def sync(self, prompt: Sequence[int], generated: Sequence[int]) -> None:
        """Append what ``prompt + generated`` has past the tokens indexed (it only grows)."""
        n = len(self.tokens)
        if n < len(prompt):
            self.extend(prompt[n:])
            n = len(prompt)
        if n - len(prompt) < len(generated):
            self.extend(generated[n - len(prompt) :])

    def extend(self, tokens: Sequence[int]) -> None:
        seq = self.tokens
        for t in tokens:
            seq.append(t)
            end = len(seq) - 1
            for n in range(1, min(self.max_n, end + 1) + 1):
                key = tuple(seq[end - n + 1 :])
                last = self._last.get(key)
                if last is not None:
                    self._before[key] = last
                self._last[key] = end

    def propose(self, k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the latest earlier match of the last ``n`` tokens,
        and ``n`` (``([], 0)`` when nothing matched)."""
        seq = self.tokens
        end = len(seq) - 1
        for n in range(min(self.max_n, end), 0, -1):
            key = tuple(seq[end - n + 1 :])
            at = self._last.get(key)
            if at == end:
                at = self._before.get(key)
            if at is not None:
                out = seq[at + 1 : at + 1 + k]
                if out:
                    return out, n
        return [], 0


class Acceptance:
    """A row's acceptance estimate per kind of proposal (n-gram length, or the draft model).

    A pass that proposed ``k`` tokens and kept ``a`` adds ``a`` kept tokens and one miss when
    ``a < k``; ``alpha = kept / (kept + misses)`` is the geometric model's rate (the chance the
    next proposal is kept). Counts decay by `DECAY` a pass, from a prior worth two proposals of
    rate `prior`: longer n-gram matches predict better (``n / (n + 1)``), a draft model 0.7.
    """

    def __init__(self) -> None:
        self.kept: dict[int, float] = {}
        self.missed: dict[int, float] = {}

    @staticmethod
    def prior(kind: int) -> float:
        return 0.7 if kind == DRAFTED else kind / (kind + 1)

    def _counts(self, kind: int) -> tuple[float, float]:
        if kind not in self.kept:
            a = self.prior(kind)
            self.kept[kind], self.missed[kind] = 2 * a, 2 * (1 - a)
        return self.kept[kind], self.missed[kind]

    def alpha(self, kind: int) -> float:
        kept, missed = self._counts(kind)
        return kept / (kept + missed)

    def update(self, kind: int, proposed: int, kept: int) -> None:
        k, m = self._counts(kind)
        self.kept[kind] = k * DECAY + kept
        self.missed[kind] = m * DECAY + (1.0 if kept < proposed else 0.0)


DRAFTED = 0  # `Acceptance` kind of a draft model's proposals (n-gram kinds are n >= 1)


@dataclass
class SpecState:
    """One request's speculation state: its n-gram index and acceptance estimates."""

    limit: int  # tokens proposed per pass at most for this request
    index: NgramIndex | None
    acceptance: Acceptance = field(default_factory=Acceptance)


class NoiseQueue:
    """A sampled request's randomness: one Gumbel noise row ``[V]`` per generated token, drawn
    from its own generator in token order (`infer.sampling.gumbel_noise`, as the plain step draws).

    A plain step `take`s the next row; a verify pass `peek`s the rows of the positions it
    samples and `drop`s those of the tokens it kept: the rows of rejected positions stay for
    the tokens that take those positions next, so token ``i`` always gets row ``i``.
    """

    def __init__(self, generator: torch.Generator, vocab: int, device: torch.device) -> None:
        self.generator = generator
        self.vocab = vocab
        self.device = device
        self._rows: deque[torch.Tensor] = deque()

    def _fill(self, n: int) -> None:
        while len(self._rows) < n:
            self._rows.append(gumbel_noise(1, self.vocab, self.generator, self.device))

    def take(self) -> torch.Tensor:
        """The next token's noise ``[1, V]``."""
        self._fill(1)
        return self._rows.popleft()

    def peek(self, n: int) -> torch.Tensor:
        """The next ``n`` tokens' noise ``[n, V]`` (kept until dropped)."""
        self._fill(n)
        return torch.cat([self._rows[i] for i in range(n)])

    def drop(self, n: int) -> None:
        for _ in range(n):
            self._rows.popleft()


class Speculating(Protocol):
    """What speculation reads and keeps of a running request (`infer.engine.request.Request`)."""

    prompt: list[int]
    generated: list[int]
    pending: list[int]  # the tokens to feed next: the last sampled one
    params: SamplingParams
    row: int
    max_new: int
    noise: NoiseQueue | None
    spec: SpecState | None
    processor: Any  # a `RowProcessor` (constraint, bias, penalty), or None
