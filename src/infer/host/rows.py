"""Matrix products: free shapes by default, fixed row tiles in the deterministic mode.

By default a product is one call of the step's shape (a row's rounding may depend on ``M``). In
the deterministic mode every product runs on zero-padded tiles of exactly `TILE_ROWS` rows, so a
row's product is always the same call whatever else is in the batch (docs/numerics.md, "Why the
deterministic mode holds by construction").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TILE_ROWS = 16  # rows per product in the deterministic mode (an AMX tile; 4 x torch's int4 row block)
# The output head's columns (vocabulary rows) per product in the deterministic mode, from column 0:
# a head streamed in chunks of a multiple of this computes every logit as the resident head does.
COLUMN_TILE = 256


def matmul(x: torch.Tensor, w_t: torch.Tensor, tile: int = 0) -> torch.Tensor:
    """``x [M, K] @ w_t [K, N] -> [M, N]``; ``tile > 0``: as products of exactly ``tile`` rows."""
    if not tile:
        return x @ w_t
    return tiled(x, lambda t: t @ w_t, tile)


def tiled(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], tile: int) -> torch.Tensor:
    """``fn`` applied to ``x [M, K]`` in tiles of exactly ``tile`` rows (the last zero-padded),
    the results concatenated: ``[M, N]``."""
    m = x.shape[0]
    padded = -(-m // tile) * tile
    if padded != m:
        x = torch.cat((x, x.new_zeros(padded - m, x.shape[1])))  # [padded, K]
    if padded == tile:
        return fn(x)[:m]
    return torch.cat([fn(x[i : i + tile]) for i in range(0, padded, tile)])[:m]


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: int = 0,
    columns: int = 0,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]``, ``weight [N, K]``; ``tile`` as in `matmul`;
    ``columns > 0``: the output columns in products of ``columns`` weight rows each, from row 0."""
    if not tile:
        return torch.nn.functional.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    n = weight.shape[0]
    if columns and n > columns:
        y = torch.cat([matmul(x2, weight[j : j + columns].t(), tile) for j in range(0, n, columns)], dim=1)
    else:
        y = matmul(x2, weight.t(), tile)  # [M, N]
    if bias is not None:
        y = y + bias
    return y.view(*lead, n)


__all__ = ["COLUMN_TILE", "TILE_ROWS", "linear", "matmul", "tiled"]
