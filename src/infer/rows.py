"""Matrix products whose per-row arithmetic does not depend on how many rows there are.

A prompt's tokens must not depend on what else is in its batch. CPU BLAS picks its
kernels by row count, and with them the summation order. Measured with torch 2.15
(MKL sgemm, 2 threads; float32 differences ~1e-6 relative): a product of 1 row, one of
2-3 rows and one of 4 or more rows round differently, and with fewer than 12 rows the
rows of a last, partial group of 4 round differently again; products whose row count is
a multiple of 4 give every row the value it has in a 2048-row product. torch's packed
int4/int8 CPU kernels compute every row the same way whatever the row count.

So the rule, keyed on the shape of the step, never on the batch:

* one token per sequence (``x [..., 1, K]``, a decode step): each row is its own
  1-row product (`matmul_rows` with ``per_row``);
* several tokens per sequence (prefill): one product over all rows, padded with zero
  rows to a multiple of `ROW_GROUP`.
"""

from __future__ import annotations

import torch

ROW_GROUP = 16  # prefill products run on a multiple of this many rows (a multiple of 4 suffices here)


def one_token_per_row(x: torch.Tensor) -> bool:
    """Whether ``x [..., T, K]`` is a decode step (``T == 1``): rows are then computed one by one."""
    return x.dim() < 2 or x.shape[-2] == 1


def matmul_rows(x: torch.Tensor, w_t: torch.Tensor, per_row: bool) -> torch.Tensor:
    """``x [M, K] @ w_t [K, N] -> [M, N]`` with row results independent of ``M`` (see the module doc)."""
    m = x.shape[0]
    if per_row:
        if m == 1:
            return x @ w_t
        return torch.cat([x[i : i + 1] @ w_t for i in range(m)])
    if m % ROW_GROUP:
        padded = torch.cat((x, x.new_zeros(ROW_GROUP - m % ROW_GROUP, x.shape[1])))
        return (padded @ w_t)[:m]
    return x @ w_t


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]``, ``weight [N, K]``, row-invariant."""
    lead = x.shape[:-1]
    y = matmul_rows(x.reshape(-1, x.shape[-1]), weight.t(), one_token_per_row(x))
    if bias is not None:
        y = y + bias
    return y.view(*lead, weight.shape[0])


__all__ = ["ROW_GROUP", "linear", "matmul_rows", "one_token_per_row"]
