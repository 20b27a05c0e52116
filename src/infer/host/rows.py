"""Matrix products: free shapes by default, fixed row tiles in the deterministic mode.

By default a product is one call of whatever shape the step has (``x [M, K] @ w_t``):
the library picks its fastest kernel for ``M``, and a row's float32 rounding may depend
on ``M`` (measured on CPU: MKL and oneDNN change kernels, and with them the order of
summation, with the row count, differently on an AMD EPYC and an Intel Xeon with AMX).

In the deterministic mode (``infer.load(..., deterministic=True)``, docs/numerics.md;
`infer.models.projections.set_deterministic`)
every product runs on tiles of exactly `TILE_ROWS` rows, zero-padded: a row's product
is then always the same call — the same shape, hence the same kernel, blocking and
order of summation — whatever else is in the batch, however its prompt was chunked,
and whether its layers are resident or streamed. What this rests on is that a product
of a fixed shape computes each output row from its own input row, the same way at every
row of the tile (`tests/unit/test_rows.py` checks it for every kernel we call). A
batch of up to `TILE_ROWS` rows reads each weight once per step.
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
