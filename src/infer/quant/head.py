"""An output head's exact re-scoring (`QuantizedLinear.rescore` and `.greedy`): how many
candidates a row re-scores and which (`top_indices`); a processed row's exact logits
(`fixed_order_dots`, for `infer.models.base.DecoderLM.exact_logits`)."""

from __future__ import annotations

import torch

# Outputs re-scored exactly per row by an output head that kept float32 scales (`QuantizedLinear.rescore`).
RESCORE_TOP_K = 16
# Candidates a greedy step re-scores after a Q8_0 head's high-plane scan (`QuantizedLinear.greedy`);
# the exact winner's worst rank on real text: docs/quantization.md.
GREEDY_CANDIDATES = 128
# Rows up to which an output head's greedy step scans its high plane and re-scores
# `GREEDY_CANDIDATES` per row (the re-scoring gathers rows x candidates weight rows).
GREEDY_MAX_ROWS = 16


def top_indices(y: torch.Tensor, k: int) -> torch.Tensor:
    """The indices ``[M, k]`` of each row's ``k`` largest entries of ``y [M, N]`` (in no set order).

    The ``k`` largest lie in the ``k`` blocks with the largest maxima: those are ranked first,
    then only their entries (faster than ``topk`` on CPU: docs/performance.md). Ties may pick
    other indices of equal value than ``topk`` would.
    """
    M, N = y.shape
    block = 32 if N <= 1 << 16 else 64
    if N % block or N // block < 4 * k:
        return y.topk(k, dim=-1).indices
    blocks = y.reshape(M, N // block, block)
    top_blocks = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [M, k]
    entries = blocks.gather(1, top_blocks[..., None].expand(M, k, block)).view(M, k * block)
    pos = entries.topk(k, dim=-1).indices  # [M, k] within the chosen blocks
    return top_blocks.gather(1, pos // block) * block + pos % block


def fixed_order_dots(rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each row's dot product with ``x``: ``rows [R, K] @ x [K] -> [R]`` (float32), every entry by
    the same float32 operations whatever the other rows.

    The products are summed in a fixed pairwise tree of element-wise adds (``K`` zero-padded to a
    power of two), so a few candidates' logits equal the same tokens' in the whole vocabulary's,
    bit for bit (docs/numerics.md, *Greedy processed rows*).
    """
    p = rows.float() * x.float()  # [R, K]
    k = p.shape[-1]
    n = 1 << max(k - 1, 0).bit_length()
    if n != k:
        p = torch.nn.functional.pad(p, (0, n - k))  # [R, n]: + 0 is exact
    while n > 1:
        n //= 2
        p = p[:, :n] + p[:, n:]
    return p[:, 0]
