"""Speculative decoding: propose several tokens cheaply, verify them in one pass of the model.

A decode step reads every weight to produce one token per row. Here proposals come from
**n-gram lookup** (prompt lookup decoding: where the last ``n`` tokens of the text occurred
before, the tokens that followed them then) or from a **draft model** (a small model with
the target's tokenizer, or the target's own weights in a packed copy); the engine feeds a
row's last token and its ``k`` proposals in one forward (`infer.engine.runner.Runner.verify_rows`,
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
of its loop (admission, prefill, stops, events) is the same with speculation on or off.

The rooms: `settings` (`Speculative`, `check_draft`), `state` (a request's `NgramIndex`,
`Acceptance`, `NoiseQueue`: kept on the engine's request), `acceptance` (which proposals a pass
keeps, what a pass costs), `draft` (`Drafter`), `speculator` (`Speculator`: plan, verify, and the
tokens given back to the engine, `Verified`, which the engine takes through its output stage and
then hands back how many it took: `Speculator.settle`).
"""

from infer.speculative.acceptance import (
    PassCost,
    expected_tokens,
    keep_matching,
    probabilities,
    rejection_sample,
)
from infer.speculative.draft import Drafter
from infer.speculative.settings import DEFAULT_TOKENS, MAX_TOKENS, Speculative, check_draft
from infer.speculative.speculator import Speculator, Verified
from infer.speculative.state import Acceptance, NgramIndex, NoiseQueue, SpecState, common_prefix

__all__ = [
    "DEFAULT_TOKENS",
    "MAX_TOKENS",
    "Acceptance",
    "Drafter",
    "NgramIndex",
    "NoiseQueue",
    "PassCost",
    "SpecState",
    "Speculative",
    "Speculator",
    "Verified",
    "check_draft",
    "common_prefix",
    "expected_tokens",
    "keep_matching",
    "probabilities",
    "rejection_sample",
]
