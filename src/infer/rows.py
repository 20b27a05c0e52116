"""Matrix products whose per-row arithmetic does not depend on how many rows there are.

A prompt's tokens must not depend on what else is in its batch. CPU BLAS picks a
different kernel (and so a different summation order) by row count: measured with
torch 2.15 (MKL / oneDNN), a float32 ``x @ W.T`` gives one result for 1 row, another
for 2-3 rows and a third for 4 rows or more (float32 differences ~1e-5, bfloat16 at
vocabulary size 2^-10 relative), while the rows-of-4-or-more results agree for every
row count tried (4 to 2048). torch's packed int4/int8 CPU kernels compute every row
the same way whatever the row count.

So the rule, keyed on the shape of the step, never on the batch:

* one token per sequence (``x [..., 1, K]``, a decode step): each row is its own
  1-row product (`per_row`);
* several tokens per sequence (prefill): one product over all rows, padded with zero
  rows to at least `MIN_GEMM_ROWS`.
"""

from __future__ import annotations

import torch

MIN_GEMM_ROWS = 4  # from 4 rows on, the float GEMMs measured give every row the same result


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
    if m < MIN_GEMM_ROWS:
        padded = torch.cat((x, x.new_zeros(MIN_GEMM_ROWS - m, x.shape[1])))
        return (padded @ w_t)[:m]
    return x @ w_t


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]``, ``weight [N, K]``, row-invariant."""
    lead = x.shape[:-1]
    y = matmul_rows(x.reshape(-1, x.shape[-1]), weight.t(), one_token_per_row(x))
    if bias is not None:
        y = y + bias
    return y.view(*lead, weight.shape[0])


__all__ = ["MIN_GEMM_ROWS", "linear", "matmul_rows", "one_token_per_row"]
