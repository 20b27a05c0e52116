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

import dataclasses
import math

import numpy as np
import pytest
import torch

from infer.params import NonFiniteLogitsError, ParamError, SamplingParams
from infer.sampling import gumbel_noise, narrow, probabilities, sample, sample_row, sampling_inputs
from infer.testing import reference_sampling_probs as reference_probs

DRAWS = 200_000


def draw(
    logits: torch.Tensor, params: SamplingParams | list[SamplingParams], generator: torch.Generator | None
) -> torch.Tensor:
    """`infer.sampling.sample` of ``logits [B, V]`` with ``params`` for every row (or one per row),
    the noise from one ``generator``."""
    rows = params if isinstance(params, list) else [params] * logits.shape[0]
    mode, values = sampling_inputs(rows, logits.device)
    noise = None
    if not mode.greedy:
        assert generator is not None
        noise = gumbel_noise(logits.shape[0], logits.shape[1], generator, logits.device)
    return sample(logits, mode, values, noise)


def shuffled_logits(n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    values = torch.linspace(-2.0, 3.0, n)[torch.randperm(n, generator=g)]
    return (values + 0.01 * torch.rand(n, generator=g)).tolist()  # distinct values: no ties at a cut


def observed_frequencies(logits: list[float], params: SamplingParams, seed: int) -> np.ndarray:
    rows = torch.tensor([logits]).repeat(DRAWS, 1)  # [N, V]: one draw per row
    tokens = draw(rows, params, torch.Generator().manual_seed(seed))
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
    assert torch.equal(draw(logits, SamplingParams(), None), expected)
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(draw(logits, SamplingParams(temperature=5.0, top_k=1), gen), expected)


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 9e-6])
def test_a_temperature_below_the_floor_is_greedy(temperature: float) -> None:
    """A tiny temperature is the argmax, alone and beside a sampled row: ``logits / 1e-40`` made
    every positive logit +inf, and the draw took the first of them."""
    logits = torch.tensor([shuffled_logits(9, 7), shuffled_logits(9, 8)]) * 10  # [2, 9], some > 0
    tiny = SamplingParams(temperature=temperature, seed=1)
    assert tiny.greedy
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(draw(logits, tiny, gen), logits.argmax(-1))
    mixed = draw(logits, [tiny, SamplingParams(temperature=1.0)], gen)
    assert int(mixed[0]) == int(logits[0].argmax())
    assert not SamplingParams(temperature=2e-5).greedy


def test_same_seed_same_draws() -> None:
    rows = torch.tensor([shuffled_logits(10, 9)]).repeat(1000, 1)
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.9)
    a = draw(rows, params, torch.Generator().manual_seed(3))
    b = draw(rows, params, torch.Generator().manual_seed(3))
    c = draw(rows, params, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_rows_still_sample_valid_ids(temperature: float) -> None:
    """Rows with NaN, +inf or only -inf are flagged by the step (`head_and_sample`); `sample` still
    returns a valid id for them (what the model is fed until the row is ended)."""
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
    tokens = draw(logits, SamplingParams(temperature=temperature), torch.Generator().manual_seed(0))
    nonfinite = ~logits.amax(dim=-1).isfinite()  # the step's flag (infer.execution.head_and_sample)
    assert nonfinite.tolist() == [False, True, True, True, False]
    assert tokens[0].item() in (0, 1, 2) and tokens[4].item() == 1
    assert ((tokens >= 0) & (tokens < 3)).all()
    assert issubclass(NonFiniteLogitsError, RuntimeError)


def test_a_rows_token_does_not_depend_on_its_neighbours_settings() -> None:
    """Per-row values: row 0's draws (its own noise) are the same whatever rows 1-2 ask for."""
    logits = torch.tensor([shuffled_logits(10, 11), shuffled_logits(10, 12), shuffled_logits(10, 13)])
    mine = SamplingParams(temperature=0.9, top_p=0.95)
    neighbours = [
        [SamplingParams(), SamplingParams()],
        [SamplingParams(temperature=2.0, top_k=3), SamplingParams(temperature=0.1)],
        [SamplingParams(temperature=1.0, top_p=0.3), SamplingParams()],
    ]
    g = torch.Generator().manual_seed(5)
    noises = [gumbel_noise(3, 10, g, logits.device) for _ in range(200)]
    alone = []
    for noise in noises:
        mode, values = sampling_inputs([mine], logits.device)
        alone.append(int(sample(logits[:1], mode, values, noise[:1])[0]))
    for others in neighbours:
        mode, values = sampling_inputs([mine, *others], logits.device)
        got = [int(sample(logits, mode, values, noise)[0]) for noise in noises]
        assert got == alone, others
    greedy_row = [SamplingParams(), SamplingParams(temperature=3.0, top_k=2), SamplingParams(temperature=0.5)]
    mode, values = sampling_inputs(greedy_row, logits.device)
    assert int(sample(logits, mode, values, noises[0])[0]) == int(logits[0].argmax())


@pytest.mark.parametrize(("logits", "temperature", "top_k", "top_p"), CASES)
def test_probabilities_are_the_distribution(
    logits: list[float], temperature: float, top_k: int, top_p: float
) -> None:
    """`probabilities` (what rejection sampling compares) is the reference distribution: the same
    tokens filtered out (exactly 0), the kept ones within float32 rounding."""
    expected = reference_probs(logits, temperature, top_k, top_p)
    got = probabilities(torch.tensor([logits, logits[::-1]]), temperature, top_k, top_p).double().numpy()
    err = max(np.abs(got[0] - expected).max(), np.abs(got[1] - expected[::-1]).max())
    print(f"\nT={temperature} top_k={top_k} top_p={top_p}: max |p - reference| {err:.2e}")
    assert np.array_equal(got[0] > 0, expected > 0) and np.array_equal(got[1] > 0, expected[::-1] > 0)
    assert err < 1e-6


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (40, 1.0), (40, 0.8), (0, 1.0)])
def test_narrowed_draws_equal_the_full_row_draws(top_k: int, top_p: float) -> None:
    """`narrow` lets a top-k / top-p draw sort its candidates, not the vocabulary: the same tokens;
    the host sampler (`sample_row`, which narrows) draws what `sample` draws from the whole row."""
    gen = torch.Generator().manual_seed(0)
    V, temperature = 20_000, 0.7
    same = narrowed_count = host_same = 0
    for _ in range(50):
        row = torch.randn(V, generator=gen) * 4.0  # peaked: the nucleus is a few hundred tokens at most
        noise = gumbel_noise(1, V, gen, torch.device("cpu"))[0]
        params = SamplingParams(temperature, top_k, top_p)
        mode, values = sampling_inputs([params], row.device)
        full = int(sample(row[None], mode, values, noise[None])[0])
        host_same += sample_row(row, params, noise) == full
        got = narrow(row, temperature, top_k, top_p)
        if got is None:
            continue
        narrowed_count += 1
        positions, adjusted = got
        assert positions.numel() < V and (top_k or adjusted > top_p)
        mode, values = sampling_inputs([SamplingParams(temperature, top_k, min(adjusted, 1.0))], row.device)
        pick = int(sample(row[positions][None], mode, values, noise[positions][None])[0])
        same += int(positions[pick]) == full
    assert narrowed_count == (0 if (top_k, top_p) == (0, 1.0) else 50)
    assert same == narrowed_count
    assert host_same == 50


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
    ({"stop": 3}, TypeError, "stop must be a string or a list of strings, got int"),
    ({"stop": ["ok", 3]}, TypeError, r"stop must be a string or a list of strings, found 3 \(int\)"),
    ({"stop": ["ok", ""]}, ValueError, r"stop strings must be non-empty: stop\[1\] is ''"),
    ({"stop": ["ok", "\ud800"]}, ValueError, r"stop\[1\]: holds '\\ud800' at index 0, a lone surrogate"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_PARAMS)
def test_sampling_params_refuse_bad_values(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_stop_errors_name_the_string() -> None:
    """The server answers 400 naming ``stop[1]``: `ParamError.param` carries the index."""
    with pytest.raises(ParamError) as info:
        SamplingParams(stop=["ok", ""])  # type: ignore[arg-type]
    assert info.value.param == "stop[1]"
    # A string, a list or None, as the Python keyword and the server's body give them:
    assert SamplingParams(stop="ok").stop == SamplingParams(stop=["ok"]).stop == ("ok",)  # type: ignore[arg-type]
    assert SamplingParams(stop=None).stop == ()  # type: ignore[arg-type]


def test_each_row_of_a_seeded_batch_draws_its_own_seed() -> None:
    """Row 0 keeps the request's seed (a prompt alone and first in a batch draw the same), the
    others get distinct ones; greedy or unseeded rows are the request's settings as they are."""
    seeded = SamplingParams(0.8, seed=7, max_tokens=5)
    rows = [seeded.row(i) for i in range(64)]
    assert rows[0] is seeded
    assert len({r.seed for r in rows}) == 64
    assert all(dataclasses.replace(r, seed=7) == seeded for r in rows)
    for params in (SamplingParams(seed=7), SamplingParams(0.8)):
        assert params.row(3) is params


def test_sampling_params_accept_and_normalize_numpy_and_edges() -> None:
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=1, seed=2**64 - 1)  # type: ignore[arg-type]
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (0.5, 3, 1.0, 2**64 - 1)
    assert type(p.top_k) is int and type(p.temperature) is float
    assert p.seed is not None
    torch.Generator().manual_seed(p.seed)  # the largest seed is one torch accepts
