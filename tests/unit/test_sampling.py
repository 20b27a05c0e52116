"""Sampling: the observed token frequencies match the distribution temperature / top-k / top-p define.

The reference distribution is computed in float64 numpy from the definitions
(logits / T, keep the k largest, then keep the most likely tokens until their
probability reaches top_p, the first always: `infer.testing.reference_sampling_probs`),
not by the code under test. Logits are
shuffled so that no filter can pass by relying on sorted input, and temperatures
differ from 1 so that dividing and multiplying by T differ. Each case draws N tokens
with one seeded generator; every observed frequency must lie within 5 standard
deviations sqrt(p (1 - p) / N) of its probability, and filtered tokens must never
appear.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from infer.generate import NonFiniteLogitsError, SamplingParams, sample, sample_checked
from infer.testing import reference_sampling_probs as reference_probs

DRAWS = 200_000


def shuffled_logits(n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    values = torch.linspace(-2.0, 3.0, n)[torch.randperm(n, generator=g)]
    return (values + 0.01 * torch.rand(n, generator=g)).tolist()  # distinct values: no ties at a cut


def observed_frequencies(logits: list[float], params: SamplingParams, seed: int) -> np.ndarray:
    rows = torch.tensor([logits]).repeat(DRAWS, 1)  # [N, V]: one draw per row
    tokens = sample(rows, params, torch.Generator().manual_seed(seed))
    return np.bincount(tokens.numpy(), minlength=len(logits)) / DRAWS


CASES = [
    # (logits, temperature, top_k, top_p)
    ([1.0, 3.0, 2.0, 0.0], 1.0, 0, 0.7),  # the issue's example: keeps tokens {1, 2}
    (shuffled_logits(8, 0), 0.5, 0, 1.0),
    (shuffled_logits(8, 1), 2.0, 0, 1.0),
    (shuffled_logits(10, 2), 0.7, 3, 1.0),
    (shuffled_logits(10, 3), 1.5, 0, 0.8),
    (shuffled_logits(12, 4), 0.8, 6, 0.9),
    (shuffled_logits(12, 5), 3.0, 0, 0.5),
]


@pytest.mark.parametrize(("logits", "temperature", "top_k", "top_p"), CASES)
def test_sampled_frequencies_match_the_distribution(
    logits: list[float], temperature: float, top_k: int, top_p: float
) -> None:
    expected = reference_probs(logits, temperature, top_k, top_p)
    observed = observed_frequencies(logits, SamplingParams(temperature, top_k, top_p, seed=0), seed=11)
    sigma = np.sqrt(expected * (1 - expected) / DRAWS)
    kept = expected > 0
    z = np.abs(observed - expected)[kept] / sigma[kept]
    print(
        f"\nT={temperature} top_k={top_k} top_p={top_p}: kept {kept.sum()}/{len(logits)} tokens, "
        f"max |observed - expected| {np.abs(observed - expected).max():.2e} = {z.max():.2f} sigma "
        f"over {DRAWS} draws"
    )
    assert np.all(observed[~kept] == 0.0), "a filtered token was sampled"
    assert z.max() <= 5.0


def test_reference_of_the_issue_example() -> None:
    """softmax([1, 3, 2, 0]) = [.087, .644, .237, .032]: top_p=0.7 keeps tokens 1 and 2, renormalized."""
    p = reference_probs([1.0, 3.0, 2.0, 0.0], 1.0, 0, 0.7)
    e = np.exp([1.0, 3.0, 2.0, 0.0])
    np.testing.assert_allclose(p, [0.0, e[1] / (e[1] + e[2]), e[2] / (e[1] + e[2]), 0.0])


def test_greedy_and_top_k_1_pick_the_argmax() -> None:
    logits = torch.tensor([shuffled_logits(9, 7), shuffled_logits(9, 8)])
    expected = logits.argmax(-1)
    assert torch.equal(sample(logits, SamplingParams(), None), expected)
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits, SamplingParams(temperature=5.0, top_k=1), gen), expected)


def test_same_seed_same_draws() -> None:
    rows = torch.tensor([shuffled_logits(10, 9)]).repeat(1000, 1)
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.9)
    a = sample(rows, params, torch.Generator().manual_seed(3))
    b = sample(rows, params, torch.Generator().manual_seed(3))
    c = sample(rows, params, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sample_checked_flags_non_finite_rows(temperature: float) -> None:
    """Rows with NaN, +inf or only -inf come back as -1 in the checked copy; the fed tokens stay valid ids."""
    inf = math.inf
    logits = torch.tensor(
        [
            [0.0, 1.0, 2.0],
            [0.0, math.nan, 1.0],
            [0.0, inf, 1.0],
            [-inf, -inf, -inf],
            [-inf, 3.0, -inf],  # -inf entries are a valid filter
        ]
    )
    params = SamplingParams(temperature=temperature)
    tokens, checked = sample_checked(logits, params, torch.Generator().manual_seed(0))
    assert checked[1:4].tolist() == [-1, -1, -1]
    assert checked[0].item() in (0, 1, 2) and checked[4].item() == 1
    assert ((tokens >= 0) & (tokens < 3)).all()
    assert issubclass(NonFiniteLogitsError, RuntimeError)


# ---- argument checks ----------------------------------------------------------------

BAD_PARAMS = [
    ({"temperature": math.nan}, ValueError, "temperature must be finite"),
    ({"temperature": math.inf}, ValueError, "temperature must be finite"),
    ({"temperature": -0.5}, ValueError, "temperature must be >= 0"),
    ({"temperature": "0.7"}, TypeError, "temperature must be a number"),
    ({"temperature": True}, TypeError, "temperature must be a number"),
    ({"top_k": 1.5}, TypeError, "top_k must be an int"),
    ({"top_k": 2.0}, TypeError, "top_k must be an int"),
    ({"top_k": True}, TypeError, "top_k must be an int"),
    ({"top_k": -1}, ValueError, r"top_k must be an int in \[0, 9223372036854775807\], got -1"),
    ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
    ({"top_p": math.nan}, ValueError, "top_p must be finite"),
    ({"top_p": None}, TypeError, "top_p must be a number"),
    ({"seed": 2**70}, ValueError, r"seed must be an int in \[0, 18446744073709551615\]"),
    ({"seed": -1}, ValueError, "seed must be an int in"),
    ({"seed": 1.0}, TypeError, "seed must be an int"),
    ({"seed": "7"}, TypeError, "seed must be an int"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_PARAMS)
def test_sampling_params_refuse_bad_values(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_params_accept_and_normalize_numpy_and_edges() -> None:
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=1, seed=2**64 - 1)  # type: ignore[arg-type]
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (0.5, 3, 1.0, 2**64 - 1)
    assert type(p.top_k) is int and type(p.temperature) is float
    assert p.seed is not None
    torch.Generator().manual_seed(p.seed)  # the largest seed is one torch accepts
