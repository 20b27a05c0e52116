"""Additive causal masks for tests that call blocks and attention directly (the models build
their own boolean masks from the cache's slots, `infer.kv.cache.slot_mask`)."""

from __future__ import annotations

import torch


def causal_mask(
    seq_len: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """Additive causal mask ``[1, 1, T, T]``: 0 where key <= query, -inf above the diagonal."""
    return sliding_window_causal_mask(seq_len, None, dtype=dtype, device=device)


def sliding_window_causal_mask(
    seq_len: int,
    window_size: int | None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Additive ``[1, 1, T, T]`` mask: query i sees key j iff ``j <= i`` and ``i - j < window_size``."""
    q = torch.arange(seq_len, device=device)[:, None]
    k = torch.arange(seq_len, device=device)[None, :]
    visible = k <= q
    if window_size is not None:
        visible &= (q - k) < window_size
    mask = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
    mask.masked_fill_(~visible, float("-inf"))
    return mask[None, None]
