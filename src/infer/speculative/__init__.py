"""Speculative decoding: propose several tokens cheaply, verify them in one pass of the model.

A decode step reads every weight to produce one token per row. Here proposals come from
**n-gram lookup** (prompt lookup decoding: where the last ``n`` tokens of the text occurred
before, the tokens that followed them then) or from a **draft model** (a small model with
the target's tokenizer, or the target's own weights in a packed copy); the engine feeds a
row's last token and its ``k`` proposals in one forward (a "verify" forward of the plan,
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

A verify pass is a forward of the engine's plan like any other (docs/engine.md, *The flow of one
step*): when the scheduler plans the decode step it asks `Speculator.propose` for proposals, and
the step becomes a forward of kind "verify" (each row fed its last token and its proposals, every
fed token through the head); the sampling stage reads each row's tokens (`verified_tokens`), and
the output stage takes them as it takes a plain step's, the scheduler rolling each row back past
the tokens its request did not take. Under tensor/pipeline parallelism the pass goes to every rank
with the plan. The rest of the engine's loop (admission, prefill, stops, events) is the same with
speculation on or off.

The rooms: `settings` (`Speculative`, `check_draft`), `state` (a request's `NgramIndex`,
`Acceptance`, `NoiseQueue`: kept on the engine's request; `Speculating`, what speculation reads of
a request), `acceptance` (which proposals a pass keeps, what a pass costs), `draft` (`Drafter`),
`speculator` (`Speculator`: proposals and the pass width that pays).
"""

from infer.speculative.acceptance import (
    PassCost,
    expected_tokens,
    keep_matching,
    rejection_sample,
    verified_tokens,
)
from infer.speculative.draft import Drafter
from infer.speculative.settings import DEFAULT_TOKENS, MAX_TOKENS, Speculative, check_draft
from infer.speculative.speculator import Proposal, Speculator
from infer.speculative.state import Acceptance, NgramIndex, NoiseQueue, SpecState, Speculating

__all__ = [
    "DEFAULT_TOKENS",
    "MAX_TOKENS",
    "Acceptance",
    "Drafter",
    "NgramIndex",
    "NoiseQueue",
    "PassCost",
    "Proposal",
    "SpecState",
    "Speculating",
    "Speculative",
    "Speculator",
    "check_draft",
    "expected_tokens",
    "keep_matching",
    "rejection_sample",
    "verified_tokens",
]
