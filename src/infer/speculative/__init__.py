"""Speculative decoding: propose several tokens cheaply (n-gram lookup, a draft model), verify them
in one forward of the target, keep the ones it agrees with.

A verify pass is a forward of the engine's plan like any other: the scheduler asks
`Speculator.propose` for the pass that pays (`Speculator.plan`: the width with the most tokens
per second by measured costs, `PassCost`, and estimated acceptance, `Acceptance`; a plain step
included), the runner drafts (`Drafter`), the sampling stage keeps the agreed tokens
(`verified_tokens`: greedy, or Leviathan et al.'s rejection rule) and the output stage rolls back
the rest. docs/speculative.md has the rules, the numerics and the figures.
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
from infer.speculative.speculator import Proposal, Proposed, Speculator
from infer.speculative.state import DRAFTED, Acceptance, NgramIndex, NoiseQueue, SpecState, Speculating

__all__ = [
    "DEFAULT_TOKENS",
    "DRAFTED",
    "MAX_TOKENS",
    "Acceptance",
    "Drafter",
    "NgramIndex",
    "NoiseQueue",
    "PassCost",
    "Proposal",
    "Proposed",
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
