"""Which proposed tokens a verify pass keeps (`verified_tokens`: `keep_matching`, `rejection_sample`),
how many a pass is expected to give (`expected_tokens`), what a pass costs (`PassCost`) and how
passes delivered against what was expected of them (`Realized`)."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

import torch

from infer.sampling import probabilities, sample, sampling_inputs
from infer.speculative.settings import DECAY, KNEE_TOKENS
from infer.speculative.state import Speculating


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a pass of ``k`` proposals gives (the kept ones and the target's own): ``sum_{i<=k} alpha^i``."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class PassCost:
    """What a pass of the model costs here, measured (docs/speculative.md, *How many tokens to propose*).

    ``observe(rows, width, seconds)`` records a decode step (``width`` 1) or verify pass; the median
    of the last 8 of a shape is its cost. Verify passes of one row count are a non-decreasing curve
    in the width, interpolated and extended along its last two points. Unmeasured: ``decode(rows) *
    f(rows * width) / f(rows) * g``, ``f(N) = 1 + N / KNEE_TOKENS``, ``g`` the median ratio of measured
    verify passes to that prior (1 until measured).
    """

    def __init__(self) -> None:
        self._seconds: dict[tuple[int, int], deque[float]] = {}
        self._ratio: deque[float] = deque(maxlen=16)

    def observe(self, rows: int, width: int, seconds: float) -> None:
        key = (rows, width)
        seen = self._seconds.setdefault(key, deque(maxlen=8))
        seen.append(seconds)
        if width > 1:
            decode = self._measured(rows, 1)
            if decode is not None:
                self._ratio.append(seconds / (decode * _shape(rows * width) / _shape(rows)))

    def _measured(self, rows: int, width: int) -> float | None:
        seen = self._seconds.get((rows, width))
        return statistics.median(seen) if seen else None

    def measured(self, rows: int, width: int) -> bool:
        return (rows, width) in self._seconds

    @property
    def empty(self) -> bool:
        return not self._seconds

    @property
    def decoded(self) -> bool:
        """Whether a plain decode step was measured (any row count): what the rest is priced against."""
        return any(w == 1 for _, w in self._seconds)

    def cost(self, rows: int, width: int) -> float:
        """Seconds (or, before any measurement, relative units) of a pass of ``rows x width``."""
        known = self._measured(rows, width)
        if known is not None:
            return known
        decode = self._measured(rows, 1)
        if decode is None:  # the nearest measured decode step, scaled; else units
            near = [r for r, w in self._seconds if w == 1]
            if near:
                r0 = min(near, key=lambda r: abs(r - rows))
                decode = self._measured(r0, 1)
                assert decode is not None
                decode *= _shape(rows) / _shape(r0)
            else:
                decode = _shape(rows)
        if width == 1:
            return decode
        points = sorted((w, self._measured(r, w)) for r, w in self._seconds if r == rows and w > 1)
        if not points:
            g = statistics.median(self._ratio) if self._ratio else 1.0
            return decode * _shape(rows * width) / _shape(rows) * g
        ws = [w for w, _ in points]
        cs = [c for _, c in points if c is not None]
        for i in range(len(cs) - 2, -1, -1):  # non-decreasing in the width
            cs[i] = min(cs[i], cs[i + 1])
        if width <= ws[0]:  # never priced below a decode step: it does the same and more
            return max(decode, cs[0] * _shape(rows * width) / _shape(rows * ws[0]))
        if width >= ws[-1]:
            if len(ws) >= 2:
                slope = max(0.0, (cs[-1] - cs[-2]) / (ws[-1] - ws[-2]))
                return cs[-1] + slope * (width - ws[-1])
            return cs[-1] * _shape(rows * width) / _shape(rows * ws[-1])
        i = next(i for i, w in enumerate(ws) if w > width)
        return cs[i - 1] + (cs[i] - cs[i - 1]) * (width - ws[i - 1]) / (ws[i] - ws[i - 1])


class Realized:
    """How verify passes delivered against the planner's expectation of them (docs/speculative.md).

    ``factor``: ``(given / expected) * (predicted / took)`` over the settled passes' tokens and
    seconds (proposing included), decayed by `DECAY` a pass from a prior of one pass that went as
    planned, clamped to [`LOW`, `HIGH`]; the planner scales every pass's expected rate by it.
    """

    LOW, HIGH = 0.05, 2.0

    def __init__(self) -> None:
        self.given = self.expected = self.took = self.predicted = 0.0

    def settle(self, given: float, expected: float, took: float, predicted: float) -> None:
        if self.expected == 0.0:  # the prior: a pass that went as planned
            self.given, self.expected, self.took, self.predicted = expected, expected, predicted, predicted
        d = DECAY
        self.given = self.given * d + given
        self.expected = self.expected * d + expected
        self.took = self.took * d + took
        self.predicted = self.predicted * d + predicted

    @property
    def factor(self) -> float:
        if self.expected == 0.0 or self.took == 0.0:
            return 1.0
        f = (self.given / self.expected) * (self.predicted / self.took)
        return min(self.HIGH, max(self.LOW, f))


def _shape(tokens: int) -> float:
    return 1.0 + tokens / KNEE_TOKENS


def keep_matching(targets: Sequence[int], proposals: Sequence[int]) -> list[int]:
    """The tokens a pass gives: ``targets[i]`` (the target's token after proposal ``i - 1``) as
    long as the proposal before it equals it; ends with the first target that differs from its
    proposal, or the one after the last proposal."""
    out: list[int] = []
    for target, proposal in zip(targets, proposals, strict=False):
        out.append(target)
        if target != proposal:
            return out
    out.append(targets[len(proposals)])
    return out


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int], generator: torch.Generator
) -> list[int]:
    """Leviathan et al. (2023) speculative sampling: the tokens one pass gives.

    ``p [k+1, V]``: the target's distributions after each fed token; ``q [k, V]``: the draft's
    distributions its ``drafts`` (k tokens) were drawn from. Draft ``i`` is kept with
    probability ``min(1, p_i(x) / q_i(x))``; the first one rejected is replaced by a draw from
    ``max(0, p_i - q_i)`` (normalized) and the pass ends; if all are kept, a last token is drawn
    from ``p_k``. Each token so drawn is distributed as ``p`` given the tokens before it.
    """
    k = len(drafts)
    u = torch.rand(k, generator=generator, device=p.device).tolist() if k else []
    out: list[int] = []
    for i, x in enumerate(drafts):
        px, qx = float(p[i, x]), float(q[i, x])
        if u[i] * qx < px:  # u < p/q without dividing by a q of 0 (then px > 0 keeps it)
            out.append(x)
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0.0 else p[i]
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out


def verified_tokens(
    r: Speculating, logits: torch.Tensor, drafts: Sequence[int], q: torch.Tensor | None
) -> tuple[list[int], bool]:
    """The tokens a verify pass gives ``r``, from the target's ``logits [len(drafts) + 1, V]`` after
    each fed token (its last sampled one, then its proposals ``drafts``), and whether they were
    drawn by rejection sampling. A sampled request's draft-model proposals (``q [k, V]``: the draft's
    distributions) are kept by `rejection_sample`; any other proposals while they equal the target's
    own token at their position, drawn as the plain step draws it (the greedy argmax, or the
    request's noise for that token: `NoiseQueue.peek`), then that token (`keep_matching`)."""
    if q is not None and r.noise is not None:
        p = r.params
        target = probabilities(logits, p.temperature, p.top_k, p.top_p)
        return rejection_sample(target, q, drafts, r.noise.generator), True
    n = logits.shape[0]
    mode, values = sampling_inputs([r.params] * n, logits.device)
    noise = None if r.noise is None or mode.greedy else r.noise.peek(n)
    targets: list[int] = sample(logits, mode, values, noise).tolist()
    return keep_matching(targets, drafts), False
