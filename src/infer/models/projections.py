"""The products of every model: `Linear` (the deterministic mode's fixed row tiles), fusing
sibling projections into one product (`Fusable`, `fuse_projections`), and the switch into
the deterministic mode (`set_deterministic`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from infer.host import rows
from infer.quant.linear import QuantizedLinear


class Linear(nn.Linear):
    """``nn.Linear`` with the deterministic mode's fixed row tiles (`infer.host.rows`) when
    ``tile_rows`` is set (`set_deterministic`). Same parameters and names."""

    tile_rows: int = 0
    column_tile: int = 0  # the output head's column tiles in the deterministic mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows.linear(x, self.weight, self.bias, self.tile_rows, self.column_tile)


def fuse_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One module computing ``parts`` (same input) side by side, their outputs concatenated;
    the parts keep views of its weights. None when they cannot be fused."""
    if all(isinstance(p, QuantizedLinear) for p in parts):
        return QuantizedLinear.concat(parts)  # type: ignore[arg-type]
    if not all(type(p) is Linear for p in parts):
        return None
    linears: list[Linear] = parts  # type: ignore[assignment]
    first = linears[0]
    if any(p.in_features != first.in_features or (p.bias is None) != (first.bias is None) for p in linears):
        return None
    if any(p.weight.dtype != first.weight.dtype or p.weight.device != first.weight.device for p in linears):
        return None
    n = sum(p.out_features for p in linears)
    fused = Linear(first.in_features, n, bias=first.bias is not None, device="meta")
    fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in linears]), requires_grad=False)
    if first.bias is not None:
        biases = [p.bias.detach() for p in linears if p.bias is not None]
        fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    start = 0
    for p in linears:
        stop = start + p.out_features
        p.weight = nn.Parameter(fused.weight[start:stop], requires_grad=False)
        if p.bias is not None:
            p.bias = nn.Parameter(fused.bias[start:stop], requires_grad=False)
        start = stop
    return fused


class Fusable(nn.Module):
    """A module whose sibling projections can run as one product (`fuse`). The fused module is
    held outside the module tree (no second copy in ``state_dict``/``parameters``) and dropped
    when the module is moved or cast, which falls back to the separate projections."""

    def __init__(self) -> None:
        super().__init__()
        self._fused: list[nn.Module] = []

    def fuse(self) -> bool:
        parts = self.fusable()
        if len(parts) < 2:
            return False
        fused = fuse_linears(parts)
        self._fused = [fused] if fused is not None else []
        return fused is not None

    def fusable(self) -> list[nn.Module]:
        raise NotImplementedError

    @property
    def fused(self) -> bool:
        """Whether the parts run as one product (their own modules, and their hooks, are not called)."""
        return bool(self._fused)

    def unfuse(self) -> None:
        """Run the parts as their own modules again (the fused product is dropped)."""
        self._fused = []

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        self._fused = []
        return super()._apply(fn, recurse)  # type: ignore[no-untyped-call]


def unfuse_projections(model: nn.Module) -> None:
    """Drop the fused products: each projection runs on its own again (after its weights were
    replaced, say; the fused copy would not see new Parameters)."""
    for m in model.modules():
        if isinstance(m, Fusable):
            m._fused = []


def set_deterministic(model: nn.Module, on: bool = True) -> None:
    """Switch every product and attention of ``model`` to the deterministic mode's fixed
    tiles (``on``; `infer.host.rows`, `attend_tiled`) or back to free shapes.

    Modules opt in with a ``tile_rows`` attribute (products) or a ``deterministic`` one
    (attention). Fused projections are dropped when ``on``: a fused q/k/v product has
    another shape than the separate products a streamed layer runs.
    """
    for m in model.modules():
        if hasattr(m, "tile_rows"):
            setattr(m, "tile_rows", rows.TILE_ROWS if on else 0)  # noqa: B010
        if hasattr(m, "deterministic"):
            setattr(m, "deterministic", on)  # noqa: B010
        if on and isinstance(m, Fusable):
            m._fused = []
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "column_tile"):  # a streamed head's chunks use its tiles too
        setattr(head, "column_tile", rows.COLUMN_TILE if on else 0)  # noqa: B010


def is_deterministic(model: nn.Module) -> bool:
    """Whether `set_deterministic` switched ``model`` on."""
    return any(getattr(m, "tile_rows", 0) for m in model.modules())


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up of every block of a resident model (fewer, larger kernel calls).

    Not for layer streaming, which swaps each projection's weights on its own, nor in the
    deterministic mode (`set_deterministic`). Returns how many groups were fused.
    """
    if is_deterministic(model):
        return 0
    return sum(m.fuse() for m in model.modules() if isinstance(m, Fusable))
