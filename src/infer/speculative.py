"""Speculative decoding: propose several tokens cheaply, verify them in one pass of the model.

A decode step reads every weight to produce one token per row. Here proposals come from
**n-gram lookup** (prompt lookup decoding: where the last ``n`` tokens of the text occurred
before, the tokens that followed them then) or from a **draft model** (a small model with
the target's tokenizer, or the target's own weights in a packed copy); the engine feeds a
row's last token and its ``k`` proposals in one forward (`infer.engine.KVSlots.verify_rows`,
a chunk of ``k + 1`` tokens), keeps the proposals the target agrees with and the target's
own token after them, and rolls the row back past the rest (`KVSlots.rollback`).

* **Which tokens are kept.** Greedy: proposals equal to the target's argmax, then the
  target's token at the first disagreement (or after the last proposal): exactly the tokens
  of plain decoding, as far as the verify pass's logits equal the decode steps' (bitwise in
  the deterministic mode: a verify pass is a chunked prefill). Sampling, n-gram: the target
  draws each position's token with the same Gumbel noise the plain step would have used for
  that token (`NoiseQueue`), and proposals are kept while they equal the draws — Leviathan et
  al.'s rejection rule for a proposal of probability 1 (kept with probability ``p(x)``, else a
  token from ``p`` without ``x``), realized by the plain sampler's own draw, so a seeded request
  gives the very tokens it gives without speculation. Sampling, draft model: Leviathan et al.
  (2023) / Chen et al. (2023) rejection sampling (`rejection_sample`): a drafted ``x ~ q`` is kept
  with probability ``min(1, p(x) / q(x))``, else a token is drawn from ``max(0, p - q)``; every
  token is distributed as the target's ``p`` (after temperature, top-k and top-p).
* **How many tokens to propose** (`Speculator.plan`): per row, the acceptance rate of its
  proposals is estimated (`Acceptance`: a decayed count per kind of proposal); a pass of
  ``T`` tokens per row is expected to give ``sum_i alpha^i`` tokens per row; its cost is
  measured (`PassCost`: the seconds of the engine's plain decode steps by rows, and of its
  verify passes by rows and width, as they really ran: packaged, eager or streamed). The
  width with the most tokens per second wins, ``T = 1`` (a plain decode step) included, so
  speculation backs off by itself where it does not pay: proposals that miss, or a batch
  wide enough that a pass of ``T`` tokens per row costs ``T`` decode steps.

The engine (`infer.engine.Engine`) calls `Speculator.decode` for its decode step; the rest
of its loop (admission, prefill, stops, events) is unchanged.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from infer.generate import check_int
from infer.step import Sampling, SamplingValues, StepOutput, gumbel_noise, sample, sampling_inputs

if TYPE_CHECKING:
    from infer.models.base import DecoderLM


class KVSlots(Protocol):
    """What speculation uses of the engine's KV slots (`infer.engine.KVSlots`; named here, not
    imported: the engine imports this module)."""

    model: DecoderLM
    context: int

    @property
    def rows(self) -> int: ...
    def length(self, row: int) -> int: ...
    def tokens(self, row: int) -> list[int]: ...
    def reserve(self, rows: int, capacity: int) -> None: ...
    def rollback(self, row: int, length: int) -> None: ...
    def step(
        self,
        lo: int,
        hi: int,
        feeds: dict[int, list[int]],
        mode: Sampling,
        values: SamplingValues | None,
        noise: torch.Tensor | None,
        pad_to: int = 0,
    ) -> StepOutput: ...
    def verify_rows(
        self, lo: int, hi: int, feeds: dict[int, list[int]], greedy: bool = False
    ) -> dict[int, torch.Tensor]: ...


MAX_TOKENS = 32  # proposed tokens per pass at most (any setting)
DEFAULT_TOKENS = 16  # proposed tokens per pass at most, unless set
KNEE_TOKENS = 8  # cost prior: a forward of N tokens costs ~ (1 + N / KNEE_TOKENS) units
PROBE_EVERY = 64  # passes skipped because they looked too costly before one is tried again
DECAY = 0.9  # per pass: how fast a row's acceptance estimate forgets
MARGIN = 0.05  # a verify pass must promise 5% more tokens per second than a plain decode step


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding settings of a loaded model (`infer.load(..., lookup=, draft=,
    speculative_tokens=)`).

    ``lookup``: n-gram lookup, trying the last ``lookup`` tokens first, then fewer (0: off).
    ``draft``: a draft model (an `infer.api.LLM` whose tokenizer equals the target's), or None.
    ``max_tokens``: tokens proposed per pass at most; each pass proposes what pays (0 to this).
    """

    lookup: int = 0
    draft: Any = None  # infer.api.LLM | None (Any: the API sits above this module)
    max_tokens: int = DEFAULT_TOKENS

    def __post_init__(self) -> None:
        check_int("lookup", self.lookup, 0, 16)
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


# ---- proposals --------------------------------------------------------------------------


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


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a pass of ``k`` proposals gives (the kept ones and the target's own): ``sum_{i<=k} alpha^i``."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class PassCost:
    """What a pass of the model costs here, measured.

    ``observe(rows, width, seconds)`` records one decode step (``width`` 1) or verify pass
    (``width`` tokens per row) of ``rows`` decoding rows: the median of the last 8 of each
    shape is its cost. Verify passes of one row count are a curve in the width: made
    non-decreasing (a wider pass never costs less than a narrower one measured), interpolated
    between measured widths and extended past them along the last two measured (else by the
    prior). With no verify pass of that row count measured, the prior: ``decode(rows) *
    f(rows * width) / f(rows) * g`` with ``f(N) = 1 + N / KNEE_TOKENS`` and ``g`` the median
    ratio of measured verify passes to that model (how much more an eager verify pass costs
    than a packaged decode step on this machine; 1 until measured).
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


def _shape(tokens: int) -> float:
    return 1.0 + tokens / KNEE_TOKENS


# ---- sampling -----------------------------------------------------------------------------


class NoiseQueue:
    """A sampled request's randomness: one Gumbel noise row ``[V]`` per generated token, drawn
    from its own generator in token order (`infer.step.gumbel_noise`, as the plain step draws).

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


def probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution `infer.step.sample` draws from for one row's settings: ``softmax(logits /
    temperature)`` restricted to the ``top_k`` highest and to the smallest set reaching ``top_p``
    (the first always kept), renormalized. ``logits [n, V]`` -> ``[n, V]`` float32."""
    scores = logits.float() / temperature
    V = scores.shape[-1]
    if top_k <= 0 and top_p >= 1.0:
        return torch.softmax(scores, dim=-1)
    ordered, order = torch.sort(scores, dim=-1, descending=True)
    keep = torch.arange(V, device=scores.device) < (top_k if top_k > 0 else V)
    ordered = ordered.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    keep = (probs.cumsum(dim=-1) - probs) < top_p
    ordered = ordered.masked_fill(~keep, float("-inf"))
    out = torch.zeros_like(scores)
    return out.scatter(-1, order, torch.softmax(ordered, dim=-1))


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


# ---- the engine's side ------------------------------------------------------------------


class Request(Protocol):
    """What the speculator reads of an engine request (`infer.engine._Request`)."""

    row: int
    prompt: list[int]
    generated: list[int]
    pending: list[int]
    max_new: int
    noise: NoiseQueue | None
    spec: RowState | None
    processor: Any  # infer.structured.RowProcessor | None: a processed row never speculates

    @property
    def params(self) -> Any: ...  # infer.engine.SamplingParams


# (request, token, nonfinite, logits [n, V], index: the token's row of them) -> whether it runs on
TokenFn = Callable[[Any, int, bool, torch.Tensor, int], bool]


@dataclass
class RowState:
    """One request's speculation state: its n-gram index and acceptance estimates."""

    limit: int  # tokens proposed per pass at most for this request
    index: NgramIndex | None
    acceptance: Acceptance = field(default_factory=Acceptance)


DRAFTED = 0  # `Acceptance` kind of a draft model's proposals (n-gram kinds are n >= 1)


@dataclass
class _Proposal:
    tokens: list[int]
    kind: int  # the n-gram length that matched, or DRAFTED
    alpha: float
    q: torch.Tensor | None = None  # [k, V]: the draft's distributions (a sampled request's drafts)


class Drafter:
    """A draft model's side of the engine: its own KV slots (row ``i`` drafts for the engine's row
    ``i``), fed the text each row holds, then ``k`` one-token steps for all drafting rows together.

    A row's draft KV is kept between passes and cut back to what it shares with the row's text
    (`KVSlots.rollback`), so a pass feeds the draft only the tokens it has not seen: the target's
    token of the last pass (and the last proposal, when every one was kept).
    """

    CATCH_UP = 512  # tokens per row per forward when the draft reads a prompt

    def __init__(self, llm: Any, slots: KVSlots) -> None:
        self.llm = llm
        self.slots = slots
        self.cost = PassCost()  # its one-token steps

    def room(self, r: Request) -> int:
        """Tokens the draft's context leaves for ``r``'s proposals."""
        return self.slots.context - (len(r.prompt) + len(r.generated)) - 1

    def draft(
        self, requests: list[Request], limits: dict[int, int], vocab: int
    ) -> dict[int, tuple[list[int], torch.Tensor | None]]:
        """``limits[r.row]`` tokens per request (one-token steps of every request with tokens to go),
        drawn as each request samples (greedy: the draft's argmax), and for a sampled request the
        distributions they were drawn from ``[k, vocab]``."""
        slots = self.slots
        rows = [r.row for r in requests]
        if rows[-1] + 1 > slots.rows:
            slots.reserve(rows[-1] + 1, 1)
        feeds: dict[int, list[int]] = {}
        for r in requests:
            text = [*r.prompt, *r.generated]
            n = min(common_prefix(slots.tokens(r.row), text), len(text) - 1)
            slots.rollback(r.row, n)
            feeds[r.row] = text[n:]
        while any(len(f) > 1 for f in feeds.values()):  # catch up (a new prompt): all but the last token
            chunk = {i: f[: min(len(f) - 1, self.CATCH_UP)] for i, f in feeds.items() if len(f) > 1}
            ahead = sorted(chunk)
            slots.step(ahead[0], ahead[-1] + 1, chunk, Sampling(), None, None)
            for i, c in chunk.items():
                del feeds[i][: len(c)]
        tokens: dict[int, list[int]] = {i: [] for i in rows}
        dists: dict[int, list[torch.Tensor]] = {r.row: [] for r in requests if not r.params.greedy}
        V = self.llm.model.vocab_size
        device = self.llm.model.device
        for i in range(max(limits.values())):
            t0 = time.perf_counter()
            active = [r for r in requests if limits[r.row] > i]  # (a row near the end of its context stops)
            mode, values = sampling_inputs([r.params for r in active], device)
            noise = None
            if not mode.greedy:
                zeros = torch.zeros(1, V, dtype=torch.float32, device=device)
                noise = torch.cat(
                    [
                        zeros if r.noise is None else gumbel_noise(1, V, r.noise.generator, device)
                        for r in active
                    ]
                )
            step = {r.row: feeds[r.row] for r in active}
            out = self._step(active[0].row, active[-1].row + 1, step, active, mode, values, noise)
            drawn: list[int] = out.tokens.tolist()
            for b, r in enumerate(active):
                t = drawn[b]
                tokens[r.row].append(t)
                feeds[r.row] = [t]
                if r.row in dists:
                    p = r.params
                    q = probabilities(out.logits[b : b + 1], p.temperature, p.top_k, p.top_p)[0]
                    dists[r.row].append(_fit_vocab(q, vocab))
            self.cost.observe(len(active), 1, time.perf_counter() - t0)
        out_rows: dict[int, tuple[list[int], torch.Tensor | None]] = {}
        for r in requests:
            toks = tokens[r.row]
            cut = next((i for i, t in enumerate(toks) if t >= vocab), len(toks))  # past the target's ids
            drawn_from = torch.stack(dists[r.row][:cut]) if r.row in dists and cut else None
            out_rows[r.row] = (toks[:cut], drawn_from)
        return out_rows

    def _step(
        self,
        lo: int,
        hi: int,
        feeds: dict[int, list[int]],
        requests: list[Request],
        mode: Sampling,
        values: SamplingValues | None,
        noise: torch.Tensor | None,
    ) -> StepOutput:
        """One step of the drafting rows, their samples in request order (rows between them idle)."""
        rows = [r.row for r in requests]
        if hi - lo == len(rows):
            return self.slots.step(lo, hi, feeds, mode, values, noise)
        # Rows between the drafting ones take part fed nothing: spread values and noise over [lo, hi).
        index = torch.tensor([i - lo for i in rows], dtype=torch.long)
        full_values = None
        if values is not None:
            full_values = SamplingValues(
                torch.zeros(hi - lo).index_copy(0, index, values.temperature),
                torch.zeros(hi - lo, dtype=torch.long).index_copy(0, index, values.top_k),
                torch.ones(hi - lo).index_copy(0, index, values.top_p),
            )
        full_noise = None
        if noise is not None:
            full_noise = torch.zeros(hi - lo, noise.shape[1]).index_copy(0, index, noise)
        out = self.slots.step(lo, hi, feeds, mode, full_values, full_noise)
        hidden = None if out.hidden is None else out.hidden[index]
        return StepOutput(out.tokens[index], out.logits[index], out.nonfinite[index], hidden)


def _fit_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft distribution over the target's ``vocab`` ids (the draft's logits may be wider or narrower)."""
    if q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        return q[..., :vocab]
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Speculator:
    """The engine's decode step when speculation is on (see the module's docstring).

    ``context``: the engine's bound on a row's tokens; ``per_forward``: tokens one forward may
    take (a streamed model's plan), None for any; ``draft_slots``: the draft model's KV slots
    (made by the engine, as its own) when the settings name a draft model.
    """

    def __init__(
        self,
        config: Speculative,
        slots: KVSlots,
        context: int,
        per_forward: int | None,
        draft_slots: KVSlots | None = None,
    ) -> None:
        self.config = config
        self.slots = slots
        self.context = context
        self.per_forward = per_forward
        self.drafter = None
        if config.draft is not None and draft_slots is not None:
            self.drafter = Drafter(config.draft, draft_slots)
        self.vocab = slots.model.vocab_size
        self.cost = PassCost()  # the target's plain decode steps and verify passes
        self._skipped = 0  # passes skipped as too costly since the last one run
        self.counters: dict[str, float] = {
            "spec_passes": 0, "spec_proposed": 0, "spec_accepted": 0, "spec_tokens": 0, "spec_steps": 0,
        }  # fmt: skip

    # ---- per request ----------------------------------------------------------------------

    def row_state(self, r: Request) -> RowState | None:
        """``r``'s state (made on first use), None when ``r`` does not speculate."""
        if r.spec is None:
            limit = self.config.max_tokens
            if r.params.speculative is not None:
                limit = min(limit, r.params.speculative)
            index = NgramIndex(self.config.lookup) if self.config.lookup else None
            r.spec = RowState(limit, index)
        return r.spec if r.spec.limit > 0 and r.processor is None else None

    def _room(self, r: Request) -> int:
        """Proposals ``r`` can take this pass: its limit, its tokens left and the context."""
        state = r.spec
        assert state is not None
        left = r.max_new - len(r.generated) - 1  # the pass's last token needs no proposal
        room = min(state.limit, left, self.context - self.slots.length(r.row) - len(r.pending))
        if self.drafter is not None:
            room = min(room, self.drafter.room(r))
        return max(0, room)

    def _lookup(self, r: Request, room: int) -> _Proposal | None:
        state = r.spec
        if state is None or state.index is None:
            return None
        state.index.sync(r.prompt, r.generated)
        tokens, n = state.index.propose(room)
        if not tokens:
            return None
        return _Proposal(tokens, n, state.acceptance.alpha(n))

    # ---- the pass -------------------------------------------------------------------------

    def plan(
        self,
        rows: int,
        proposals: dict[int, _Proposal],
        drafting: dict[int, tuple[int, float]],
        span: int | None = None,
    ) -> int:
        """Tokens per row for this pass (1: a plain decode step), the most tokens per second.

        ``proposals``: the rows' n-gram proposals; ``drafting``: the rows the draft model would
        propose for, with the tokens they can take and their acceptance estimate; ``span``: the
        rows the forward covers (idle ones between included; default ``rows``)."""
        if not proposals and not drafting:
            return 1
        longest = max([len(p.tokens) for p in proposals.values()] + [room for room, _ in drafting.values()])
        if self.per_forward is not None:
            longest = min(longest, self.per_forward // (span or rows) - 1)
        # A pass must promise `MARGIN` more tokens per second than a decode step: estimates are
        # noisy, and a pass that only breaks even costs the rows' latency for nothing.
        best, best_rate = 1, rows / self.cost.cost(rows, 1) * (1.0 + MARGIN)
        draft_step = 0.0
        if self.drafter is not None and drafting:
            d, n = self.drafter, len(drafting)
            if d.cost.empty:  # nothing says what its steps cost here (weight bytes do not: a packed
                # draft of a float32 target holds the same bytes): measure a pass of 4 at once
                return min(longest + 1, 5)
            draft_step = d.cost.cost(n, 1)
        runner_up, runner_up_rate = 1, 0.0  # the best pass, paying or not
        for width in range(2, longest + 2):
            k = width - 1
            tokens = float(rows - len(proposals) - len(drafting))
            tokens += sum(expected_tokens(p.alpha, min(len(p.tokens), k)) for p in proposals.values())
            tokens += sum(expected_tokens(alpha, min(room, k)) for room, alpha in drafting.values())
            rate = tokens / (self.cost.cost(rows, width) + k * draft_step)
            if rate > best_rate:
                best, best_rate = width, rate
            if rate > runner_up_rate:
                runner_up, runner_up_rate = width, rate
        if best == 1 and longest >= 1:
            self._skipped += 1
            if self._skipped >= PROBE_EVERY:  # costs and rates change: measure the best pass now and then
                best = runner_up
        if best > 1:
            self._skipped = 0
        return best

    def decode(self, requests: list[Request], token: TokenFn, room: int) -> bool:
        """Run the decode step of ``requests`` (decoding rows, in row order) as a verify pass when
        one pays; False when a plain decode step should run instead (the caller times it with
        `observe_decode`). ``room``: the tokens a pass may feed each row of its span (every row of
        a pass takes its width, padding included, so the running row nearest the end of the
        context, decoding or still reading its prompt, bounds everyone's).

        A step with a row whose logits are processed (a constraint, a logit bias, a penalty:
        `infer.structured.RowProcessor`) is a plain decode step: the pass would have to verify
        proposals against processed logits, position by position."""
        if any(r.processor is not None for r in requests):
            return False
        t0 = time.perf_counter()
        proposals: dict[int, _Proposal] = {}
        drafting: dict[int, tuple[int, float]] = {}
        most = room - 1
        for r in requests:
            state = self.row_state(r)
            room = min(self._room(r), most) if state is not None else 0
            if state is None or room <= 0:
                continue
            p = self._lookup(r, room)
            alpha = state.acceptance.alpha(DRAFTED)
            if self.drafter is not None and (p is None or p.alpha < alpha):
                drafting[r.row] = (room, alpha)
            elif p is not None:
                proposals[r.row] = p
        span = requests[-1].row - requests[0].row + 1
        width = self.plan(len(requests), proposals, drafting, span)
        if width == 1:
            return False
        for p in proposals.values():
            del p.tokens[width - 1 :]
        drafted_s = 0.0
        if drafting:
            assert self.drafter is not None
            t1 = time.perf_counter()
            chosen = [r for r in requests if r.row in drafting]
            limits = {row: min(width - 1, room) for row, (room, _) in drafting.items()}
            for row, (tokens, q) in self.drafter.draft(chosen, limits, self.vocab).items():
                room, alpha = drafting[row]
                if tokens[:room]:
                    proposals[row] = _Proposal(tokens[:room], DRAFTED, alpha, None if q is None else q[:room])
            drafted_s = time.perf_counter() - t1
        self._verify(requests, proposals, token)
        self.cost.observe(len(requests), width, time.perf_counter() - t0 - drafted_s)
        self.counters["spec_steps"] += 1
        return True

    def observe_decode(self, rows: int, seconds: float) -> None:
        self.cost.observe(rows, 1, seconds)

    def _verify(self, requests: list[Request], proposals: dict[int, _Proposal], token: TokenFn) -> None:
        slots = self.slots
        feeds = {r.row: r.pending + (proposals[r.row].tokens if r.row in proposals else []) for r in requests}
        lo, hi = requests[0].row, requests[-1].row + 1
        exact = any(r.params.logprobs is not None for r in requests)
        greedy_head = all(r.params.greedy for r in requests) and not exact
        base = {r.row: slots.length(r.row) for r in requests}  # never inside a shared prefix
        logits = slots.verify_rows(lo, hi, feeds, greedy=greedy_head)
        for r in requests:
            fed = feeds[r.row]
            rows = logits[r.row]  # [len(fed), V]
            proposal = proposals.get(r.row)
            drafts = fed[len(r.pending) :]
            leviathan = proposal is not None and proposal.q is not None
            if leviathan:
                assert proposal is not None and proposal.q is not None and r.noise is not None
                p = r.params
                target = probabilities(rows, p.temperature, p.top_k, p.top_p)
                out = rejection_sample(target, proposal.q, drafts, r.noise.generator)
            else:
                out = keep_matching(self._targets(r, rows), drafts)
            nonfinite: list[bool] = (~rows[: len(out)].amax(dim=-1).isfinite()).tolist()
            emitted = 0
            for i, t in enumerate(out):
                emitted += 1
                if not token(r, t, nonfinite[i], rows, i):
                    break
            if r.noise is not None and not leviathan:
                r.noise.drop(emitted)
            slots.rollback(r.row, base[r.row] + emitted)
            if proposal is not None:
                kept = len(out) - 1
                assert r.spec is not None
                r.spec.acceptance.update(proposal.kind, len(proposal.tokens), kept)
                c = self.counters
                c["spec_passes"] += 1
                c["spec_proposed"] += len(proposal.tokens)
                c["spec_accepted"] += kept
                c["spec_tokens"] += emitted

    def _targets(self, r: Request, logits: torch.Tensor) -> list[int]:
        """The target's token at each fed position, drawn as the plain step draws it."""
        n = logits.shape[0]
        mode, values = sampling_inputs([r.params] * n, logits.device)
        noise = None if r.noise is None or mode.greedy else r.noise.peek(n)
        tokens: list[int] = sample(logits, mode, values, noise).tolist()
        return tokens

    def stats(self) -> dict[str, float]:
        c = self.counters
        out = {k: float(v) for k, v in c.items()}
        out["spec_acceptance"] = c["spec_accepted"] / c["spec_proposed"] if c["spec_proposed"] else 0.0
        out["spec_tokens_per_pass"] = c["spec_tokens"] / c["spec_passes"] if c["spec_passes"] else 0.0
        return out


__all__ = [
    "DEFAULT_TOKENS",
    "MAX_TOKENS",
    "Acceptance",
    "Drafter",
    "NgramIndex",
    "NoiseQueue",
    "PassCost",
    "Speculative",
    "Speculator",
    "check_draft",
    "expected_tokens",
    "keep_matching",
    "probabilities",
    "rejection_sample",
]


def check_draft(target: Any, draft: Any) -> None:
    """`ValueError` unless ``draft`` (an `infer.api.LLM`) can propose tokens for ``target``: the same
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
