"""`RMSNorm`, plain and Gemma's ``(1 + weight)`` variant."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in float32 (as transformers does).

    ``unit_offset=True`` is Gemma's variant: the stored weight is a delta and the
    scale is ``(1 + weight)``, applied before casting back (transformers does the
    same: Llama casts then multiplies, Gemma multiplies then casts).
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, unit_offset={self.unit_offset}"
