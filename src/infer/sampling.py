"""Sampling, in one place: what a row draws its next token from, in the step and on the host.

`sample` is the one sampling function: the step calls it inside its graph (plain tensor code,
per-row values as tensors, no host read), the host for a processed row (`sample_row`) and for a
verify pass's positions. Randomness comes in as Gumbel noise drawn outside any graph from each
row's own ``torch.Generator`` (`gumbel_noise`, assembled per step by `step_sampling`), so a seeded
row draws the same tokens alone or in any batch. `top_k_top_p` is the one top-k / top-p filter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from infer.params import SamplingParams

GREEDY = SamplingParams()  # an idle row of a step
CANDIDATES = 512  # a filtered row drawn on the host is sorted among its best this many tokens (`narrow`)


@dataclass(frozen=True)
class Sampling:
    """The static part of a step's sampling (it selects the compiled graph); values are `SamplingValues`."""

    greedy: bool = True  # every row is greedy: argmax only
    filtered: bool = False  # some row uses top-k and/or top-p
    exact_head: bool = False  # every logit must be exact (logprobs), not only each row's argmax
    every_token: bool = False  # a verify pass: every fed token goes through the head, not each row's last


@dataclass
class SamplingValues:
    """Per-row sampling values, ``[B]`` each."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy row (`SamplingParams.greedy`)
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off


def sampling_inputs(
    rows: Sequence[SamplingParams], device: torch.device, exact_head: bool = False
) -> tuple[Sampling, SamplingValues | None]:
    """The static mode and the per-row values of ``rows`` (None when every row is greedy)."""
    if all(r.greedy for r in rows):
        return Sampling(greedy=True, exact_head=exact_head), None
    filtered = any(not r.greedy and (r.top_k > 0 or r.top_p < 1.0) for r in rows)
    values = (
        SamplingValues(  # a greedy row's temperature is 0 (`SamplingParams.greedy`: below MIN_TEMPERATURE)
            temperature=torch.tensor(
                [0.0 if r.greedy else r.temperature for r in rows], dtype=torch.float32, device=device
            ),
            top_k=torch.tensor([r.top_k for r in rows], dtype=torch.long, device=device),
            top_p=torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device),
        )
    )
    return Sampling(greedy=False, filtered=filtered, exact_head=exact_head), values


def top_k_top_p(
    scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k / top-p filter: ``scores [B, V]`` sorted descending, with ``-inf`` past each row's
    ``top_k`` highest (``[B]`` or ``[1]`` int64, 0 = off) and past the smallest prefix whose
    probabilities reach its ``top_p`` (``[B]`` or ``[1]`` float32, 1 = off; the first always
    kept); and the order, ``[B, V]`` (``sorted[b, i] = scores[b, order[b, i]]``). Tensor code
    with no host read: it runs inside the compiled step."""
    V = scores.shape[-1]
    ordered, order = torch.sort(scores, dim=-1, descending=True)  # [B, V]
    rank = torch.arange(V, device=scores.device)
    k = top_k[:, None]  # [B, 1]
    keep = rank < torch.where(k > 0, k, V)
    ordered = ordered.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
    keep = (probs.cumsum(dim=-1) - probs) < top_p[:, None]
    ordered = ordered.masked_fill(~keep, float("-inf"))
    return ordered, order


def sample(
    logits: torch.Tensor, mode: Sampling, values: SamplingValues | None, noise: torch.Tensor | None
) -> torch.Tensor:
    """One token per row of ``logits [B, V]`` (float32) -> ``[B]``, each row by its own values.

    A row with temperature 0 is greedy (``argmax``). Otherwise the Gumbel-max trick:
    ``argmax(logits / temperature + noise)`` with ``noise = -log(Exp(1))`` samples from
    ``softmax(logits / temperature)``, restricted by `top_k_top_p` when the row filters. A
    row's token depends on its own logits, values and noise only: the other rows'
    settings select which of the per-row results are computed, never change one.
    """
    greedy = logits.argmax(dim=-1)  # [B]
    if mode.greedy:
        return greedy
    assert values is not None and noise is not None
    t = values.temperature[:, None]  # [B, 1]
    scores = logits / torch.where(t > 0, t, 1.0)
    drawn = (scores + noise).argmax(dim=-1)  # [B]
    if mode.filtered:
        ordered, order = top_k_top_p(scores, values.top_k, values.top_p)  # [B, V] each
        pick = (ordered + noise.gather(-1, order)).argmax(dim=-1, keepdim=True)  # [B, 1]
        filters = (values.top_k > 0) | (values.top_p < 1.0)  # [B]
        drawn = torch.where(filters, order.gather(-1, pick)[:, 0], drawn)
    return torch.where(values.temperature > 0, drawn, greedy)


def probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution `sample` draws from for one row's settings: ``softmax(logits / temperature)``
    restricted by `top_k_top_p` and renormalized. ``logits [n, V]`` -> ``[n, V]`` float32."""
    scores = logits.float() / temperature
    if top_k <= 0 and top_p >= 1.0:
        return torch.softmax(scores, dim=-1)
    k = torch.tensor([top_k], dtype=torch.long, device=scores.device)
    p = torch.tensor([top_p], dtype=torch.float32, device=scores.device)
    ordered, order = top_k_top_p(scores, k, p)
    return torch.zeros_like(scores).scatter(-1, order, torch.softmax(ordered, dim=-1))


def narrow(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, float] | None:
    """The few tokens a top-k / top-p draw from ``row [n]`` can pick, so `sample` sorts
    `CANDIDATES` tokens instead of the vocabulary: ``(positions [K] in row, the top_p to use on them)``,
    or None when the whole row is needed (or is small).

    With ``top_k`` the draw is among the top k (normalized over them), which the candidates hold.
    Without it, the nucleus is the smallest prefix reaching ``top_p`` of the mass over the *whole*
    row: when the candidates hold that much (share ``S_K / S >= top_p``), it lies inside them, and
    over the candidates the same prefix reaches ``top_p * S / S_K`` — the same tokens, kept with the
    same Gumbel noise (the same draw up to float32 rounding of the sums)."""
    n = row.numel()
    k = top_k if 0 < top_k < n else 0
    size = max(CANDIDATES, k)
    if n <= 2 * size or (k == 0 and top_p >= 1.0):
        return None
    positions = torch.topk(row, size).indices
    if k:
        return positions, top_p
    scores = row / temperature
    share = float(torch.exp(torch.logsumexp(scores[positions], 0) - torch.logsumexp(scores, 0)))
    adjusted = top_p / share if share > 0 else 2.0
    return (positions, adjusted) if adjusted <= 1.0 else None


def sample_row(row: torch.Tensor, params: SamplingParams, noise: torch.Tensor | None) -> int:
    """The host sampler: the position in ``row [n]`` (one row's float32 logits, of the tokens it may
    pick) that `sample` draws with ``params``' temperature, top-k and top-p and the row's Gumbel
    ``noise [n]`` (None when greedy); a top-k / top-p draw sorts its `narrow` candidates only."""
    top_p = params.top_p
    narrowed = None if params.greedy else narrow(row, params.temperature, params.top_k, params.top_p)
    positions = None
    if narrowed is not None:
        positions, top_p = narrowed
        row = row[positions]
        noise = None if noise is None else noise[positions]
    values = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=top_p)
    mode, sampled = sampling_inputs([values], row.device)
    pick = int(sample(row[None], mode, sampled, None if noise is None else noise[None])[0])
    return pick if positions is None else int(positions[pick])


def global_seed() -> int:
    """A seed for a request that gave none, drawn from torch's global generator: after
    ``torch.manual_seed(s)`` the same calls draw the same seeds (`torch.seed()` would reseed the
    global generator instead, undoing the caller's seed)."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


def gumbel_noise(batch: int, vocab: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``-log(E)``, ``E ~ Exp(1)``, ``[batch, vocab]`` float32 from ``generator`` (outside any graph)."""
    e = torch.empty(batch, vocab, dtype=torch.float32, device=device).exponential_(generator=generator)
    return -torch.log(e.clamp_min(torch.finfo(torch.float32).tiny))


def step_sampling(
    params: Sequence[SamplingParams | None],
    noise: Callable[[int], torch.Tensor | None],
    vocab: int,
    device: torch.device,
    exact_head: bool = False,
) -> tuple[Sampling, SamplingValues | None, torch.Tensor | None]:
    """A step's sampling inputs: its mode, values and Gumbel noise ``[B, vocab]`` (None when no row
    samples). ``params[i]``: row i's settings (None: an idle row, greedy); ``noise(i)``: row i's
    noise ``[1, vocab]`` (None: zeros), asked in row order only when some row samples."""
    mode, values = sampling_inputs([GREEDY if p is None else p for p in params], device, exact_head)
    if mode.greedy:
        return mode, values, None
    rows = [None if p is None else noise(i) for i, p in enumerate(params)]
    if all(r is None for r in rows):
        return mode, values, None
    zeros = torch.zeros(1, vocab, dtype=torch.float32, device=device)
    return mode, values, torch.cat([zeros if r is None else r for r in rows])


__all__ = [
    "CANDIDATES",
    "Sampling",
    "SamplingValues",
    "global_seed",
    "gumbel_noise",
    "narrow",
    "probabilities",
    "sample",
    "sample_row",
    "sampling_inputs",
    "step_sampling",
    "top_k_top_p",
]
