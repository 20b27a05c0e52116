"""One iteration's plan, the one object that flows through `infer.engine.Engine.step`: the KV
operations made since the last plan (`infer.kv.ops`) and the forwards to run (`Forward`), then
what each stage hands the next (`Ran`, `Sampled`, `Update`). Under torchrun rank 0 sends
`Plan.wire` to the other ranks (`infer.engine.parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from infer.execution import StepOutput
from infer.kv.ops import Done
from infer.sampling import Sampling, SamplingValues

if TYPE_CHECKING:
    from infer.engine.request import Request, TokenLogprob
    from infer.speculative import Proposal


# ---- the forwards ---------------------------------------------------------------------------------

Kind = Literal["decode", "prefill", "verify"]


@dataclass
class Forward:
    """One forward of a plan over rows ``[lo, hi)``: row ``r`` in ``feeds`` is fed ``feeds[r]``, the
    others nothing (they take part with no token: a window of rows, padding their slots).

    ``kind`` "decode" (each running request's last sampled token) and "prefill" (a chunk of each
    prompt) take the head at each row's last fed token; "verify" at every fed token: each row's
    last sampled token and then its ``proposals[r]`` (speculative decoding). ``base[r]``: row
    ``r``'s length before the forward (a row keeps ``base[r]`` plus the tokens its request took).
    ``requests``: the request of each fed row (rank 0's; not sent to the other ranks). For the
    draft model, which the runner runs before the forward: ``drafting[r]``, the tokens row ``r``'s
    draft may propose and their acceptance estimate (the runner adds the proposals to ``feeds``);
    ``draft_reads``, the requests whose prompts this chunk finishes (the draft reads them now).
    ``hooks``: a forward of one request's row alone, whose hooks act on it (`Request.hooks`).
    """

    kind: Kind
    lo: int
    hi: int
    feeds: dict[int, list[int]]
    exact_head: bool = False  # every logit exact (logprobs, processed rows), not only each row's argmax
    requests: dict[int, Request] = field(default_factory=dict)
    base: dict[int, int] = field(default_factory=dict)
    pad_to: int = 0
    proposals: dict[int, Proposal] = field(default_factory=dict)
    drafting: dict[int, tuple[int, float]] = field(default_factory=dict)
    draft_reads: list[Request] = field(default_factory=list)
    hooks: Any = None  # the scope of its one request's hooks (`Request.hooks`), None for none

    def wire(self) -> Wired:
        return Wired(self.lo, self.hi, self.feeds, self.pad_to, self.exact_head, self.kind == "verify")


@dataclass(frozen=True)
class Wired:
    """A forward as the other ranks run it: the same rows, tokens and head; their sampling is greedy
    and discarded (only rank 0 samples)."""

    lo: int
    hi: int
    feeds: dict[int, list[int]]
    pad_to: int
    exact_head: bool
    every_token: bool

    @property
    def mode(self) -> Sampling:
        return Sampling(greedy=True, exact_head=self.exact_head, every_token=self.every_token)


@dataclass
class Plan:
    """What one iteration does: ``ops`` (the KV operations made since the last plan, in order, already
    made on this rank) and ``forwards`` (run in order)."""

    ops: list[Done]
    forwards: list[Forward]

    def wire(self) -> tuple[list[Done], list[Wired]]:
        return self.ops, [f.wire() for f in self.forwards]


# ---- what each stage hands the next ---------------------------------------------------------------


@dataclass
class Draw:
    """A forward's sampling inputs (`infer.execution.StepFeed`): the mode, and the values and noise
    drawn for its rows from their requests' settings and generators (None when greedy)."""

    mode: Sampling
    values: SamplingValues | None = None  # [B] each
    noise: torch.Tensor | None = None  # [B, V]


@dataclass
class Ran:
    """One forward as it ran: the inputs it sampled with, its output or the exception it raised, its
    seconds."""

    draw: Draw
    out: StepOutput | None
    error: Exception | None = None
    seconds: float = 0.0


@dataclass
class Row:
    """What a forward gives one fed row: the tokens its request takes in order (one, or a verify pass's
    accepted proposals and the target's own token), each one's non-finite flag and the logits it was
    drawn from (``logits[index[i]]``). ``leviathan``: drawn by rejection sampling against a draft."""

    tokens: list[int]
    nonfinite: list[bool]
    logits: torch.Tensor
    index: list[int]
    leviathan: bool = False


@dataclass
class Sampled:
    """A forward's sampled rows (row -> `Row`: the rows that take tokens), or the exception that ended
    the forward's requests; its seconds (the forward's, as `Ran` measured them)."""

    rows: dict[int, Row] = field(default_factory=dict)
    error: Exception | None = None
    seconds: float = 0.0


@dataclass
class Ended:
    """A request the output stage ends: its final event's reason, error, last tokens and logprobs."""

    request: Request
    reason: str
    error: BaseException | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    detail: str | None = None


@dataclass
class Pass:
    """What a verify pass did for one row: its proposals' kind, how many were proposed and kept (the
    target agreed with), and the tokens its request took."""

    kind: int
    proposed: int
    kept: int
    taken: int


@dataclass
class Update:
    """The output stage's result, which the scheduler applies: each row's length after the plan where
    its request took fewer tokens than were fed (``keep``: a verify pass's rejected proposals, a
    failed token), the requests that ended, and what the counters count."""

    keep: dict[int, int] = field(default_factory=dict)
    ended: list[Ended] = field(default_factory=list)
    generated: int = 0
    prefilled: int = 0
    steps: int = 0
    batch: int | None = None  # rows of the decode step (or verify pass) when one ran
    passes: list[Pass] = field(default_factory=list)
    verified: bool = False  # the decode step ran as a verify pass
    # (rows, width, seconds, tokens given) of the decode step or verify pass
    costs: list[tuple[int, int, float, int]] = field(default_factory=list)


__all__ = [
    "Draw",
    "Ended",
    "Forward",
    "Kind",
    "Pass",
    "Plan",
    "Ran",
    "Row",
    "Sampled",
    "Update",
    "Wired",
]
