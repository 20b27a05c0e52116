"""`RowParallel`: the module swap that makes a tensor-parallel layer compute the whole layer.

A row-parallel linear (attention's output projection, the MLP's down projection) holds its rank's
input columns; `RowParallel` all-reduces its partial sums and adds the bias once. The model files
know nothing of it: `infer.distributed.parallelize` wraps the modules `tp_roles` names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's input columns, partial sums all-reduced, bias added once."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group
        bias = getattr(inner, "bias", None)
        self.bias: nn.Parameter | None = None
        if isinstance(bias, torch.Tensor):
            self.bias = nn.Parameter(bias.detach(), requires_grad=False)
            inner.bias = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.inner(x)
        dist.all_reduce(y, group=self.group)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


__all__ = ["RowParallel"]
