"""Interventions: add to, replace or zero a block's output or one attention head's output.

`Intervention` says what; `intervene(model, ...)` installs it as torch forward hooks and returns an
`Interventions` handle (a context manager; ``remove()``); `infer.LLM.intervene` is the same. They
run wherever the modules run: in a forward (recorded hidden states are the edited ones) and in
generation (eager while any hook is on; K/V computed under other hooks are never reused). A head's
edit applies to its slice ``[B, T, hd]`` before the output projection. See docs/notebooks.md.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

Positions = int | slice | Sequence[int] | None


@dataclass(frozen=True)
class Intervention:
    """One edit: exactly one of ``add`` (a tensor added), ``replace`` (a tensor put instead) or
    ``zero=True``, on block ``layer``'s output (negative counts from the end), or on attention head
    ``head`` of that block. A value broadcasts against the edited slice: ``[D]`` (``[hd]`` for a
    head) for every token, ``[T, D]`` or ``[B, T, D]`` for a whole-sequence forward; it is cast to
    the activations' dtype and device. ``positions``: only these token positions (an int, a slice or
    a non-empty list of ints; a negative position counts from the end, as Python indexes), in
    whole-sequence forwards; a position past the input is a `ValueError` when the forward runs."""

    layer: int
    add: torch.Tensor | None = None
    replace: torch.Tensor | None = None
    zero: bool = False
    head: int | None = None
    positions: Positions = None

    def __post_init__(self) -> None:
        given = [name for name, on in (("add", self.add is not None), ("replace", self.replace is not None),
                                       ("zero", self.zero)) if on]  # fmt: skip
        if len(given) != 1:
            raise ValueError(
                f"an intervention takes exactly one of add=, replace=, zero=True; got {given or 'none'}"
            )
        value = self.add if self.add is not None else self.replace
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"{given[0]}= must be a tensor, got {type(value).__name__}")
        if not isinstance(self.layer, int) or isinstance(self.layer, bool):
            raise TypeError(f"layer must be an int, got {self.layer!r}")
        if self.head is not None and (not isinstance(self.head, int) or isinstance(self.head, bool)):
            raise TypeError(f"head must be an int or None, got {self.head!r}")
        _check_positions(self.positions)

    @property
    def value(self) -> torch.Tensor | None:
        return self.add if self.add is not None else self.replace

    def describe(self) -> str:
        what = "add" if self.add is not None else "replace" if self.replace is not None else "zero"
        where = f"layer {self.layer}" + (f" head {self.head}" if self.head is not None else "")
        return f"{what} at {where}" + (
            f", positions {self.positions!r}" if self.positions is not None else ""
        )


class Interventions:
    """Installed interventions (`intervene`): a context manager; `remove` takes the hooks off."""

    def __init__(self, items: list[Intervention], handles: list[RemovableHandle]) -> None:
        self.items = items
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    @property
    def active(self) -> bool:
        return bool(self.handles)

    def __enter__(self) -> Interventions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.handles else "removed"
        return f"Interventions({'; '.join(i.describe() for i in self.items)}; {state})"


def _is_int(value: Any) -> bool:
    """An int, or an int-like (numpy's, a 0-d integer tensor: ``__index__``), but not a bool."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        return False
    try:
        operator.index(value)
    except TypeError:  # a 0-d float tensor has __index__, which refuses
        return False
    return True


def _check_positions(positions: object) -> None:
    """`TypeError` / `ValueError` naming ``positions`` unless it is None, an int, a slice of ints
    (step not 0) or a non-empty sequence of ints (a list, a tuple, a range, a 1-d integer tensor)."""
    expected = "an int, a slice or a non-empty list of ints (or None)"
    if positions is None or _is_int(positions):
        return
    if isinstance(positions, slice):
        parts = (positions.start, positions.stop, positions.step)
        if not all(p is None or _is_int(p) for p in parts):
            raise TypeError(f"positions: expected a slice of ints, got {positions!r}")
        if positions.step is not None and operator.index(positions.step) == 0:
            raise ValueError(f"positions: a slice's step cannot be zero, got {positions!r}")
        return
    if isinstance(positions, torch.Tensor):
        if positions.ndim != 1 or positions.dtype.is_floating_point or positions.dtype.is_complex:
            shape = tuple(positions.shape)
            raise TypeError(
                f"positions: expected {expected}, got a tensor of shape {shape}, {positions.dtype}"
            )
        items: list[object] = positions.tolist()
    elif isinstance(positions, Sequence) and not isinstance(positions, str | bytes):
        items = list(positions)
    else:
        raise TypeError(f"positions: expected {expected}, got {positions!r} ({type(positions).__name__})")
    bad = [p for p in items if not _is_int(p)]
    if bad:
        what = f"{bad[0]!r}, a {type(bad[0]).__name__}"
        raise TypeError(f"positions: expected {expected}, got {positions!r} (holding {what})")
    if not items:
        raise ValueError(f"positions: expected {expected}, got an empty {type(positions).__name__}")


def _index(item: Intervention, length: int) -> Any:
    """``item.positions`` as an index of a token axis of ``length`` tokens; `ValueError` naming
    them and the input's length when a position is past it (or a slice selects none of it)."""
    positions: Any = item.positions
    if positions is None:
        return None
    if isinstance(positions, slice):
        if not range(length)[positions]:
            raise ValueError(
                f"intervention ({item.describe()}): positions {positions!r} selects none of the "
                f"input's {length} tokens"
            )
        return positions
    single = _is_int(positions)
    index = [operator.index(p) for p in ([positions] if single else positions)]
    outside = [p for p in index if not -length <= p < length]
    if outside:
        raise ValueError(
            f"intervention ({item.describe()}): positions {outside[0]} is past the input's {length} "
            f"tokens (positions must be in [{-length}, {length}))"
        )
    return index[0] if single else index


def _edit(x: torch.Tensor, item: Intervention, head_dims: tuple[int, int] | None) -> torch.Tensor:
    """``x [B, T, D]`` (a block's output) or ``[B, T, H*hd]`` (attention heads: ``head_dims = (H,
    hd)``) with ``item`` applied (a new tensor)."""
    B, T, _ = x.shape
    y = x.clone()
    view = y if head_dims is None else y.view(B, T, *head_dims)[:, :, item.head]  # [B, T, D | hd]
    pos = _index(item, T)
    target = view if pos is None else view[:, pos]  # a list of positions: a copy, written back below
    value = item.value
    try:
        if item.zero:
            target.zero_()
        elif value is not None:
            v = value.to(dtype=x.dtype, device=x.device)
            if item.add is not None:
                target.add_(v)
            else:
                target.copy_(v.expand_as(target))
        if pos is not None:
            view[:, pos] = target
    except RuntimeError as e:
        shape = None if value is None else tuple(value.shape)
        raise ValueError(
            f"intervention ({item.describe()}): a value of shape {shape} does not fit the edited "
            f"activations {tuple(target.shape)}: {e}"
        ) from None
    return y


def _attention(block: nn.Module) -> tuple[nn.Module, int, int]:
    """``block``'s output projection, its heads and head size (the attention module declares
    ``output_projection``)."""
    for m in block.modules():
        name = getattr(m, "output_projection", None)
        if isinstance(name, str):
            return getattr(m, name), int(getattr(m, "num_heads")), int(getattr(m, "head_dim"))  # noqa: B009
    raise ValueError(f"{type(block).__name__} has no attention module with an output_projection")


def _in_generation(args: tuple[Any, ...]) -> bool:
    """Whether a block was called with a KV cache (a generation step): ``args = (x, cos, sin, mask,
    kv)`` (`infer.models.base.DecoderLM.run_layer`)."""
    return len(args) > 4 and args[4] is not None


def intervene(model: nn.Module, items: Sequence[Intervention]) -> Interventions:
    """Install ``items`` on ``model`` (a `infer.models.base.DecoderLM`) as forward hooks, checked
    first (layer and head in range, a value's last dimension). Several may edit one block: they
    apply in order."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no .layers to intervene on")
    n = len(layers)
    handles: list[RemovableHandle] = []
    checked: list[Intervention] = []
    try:
        for item in items:
            if not isinstance(item, Intervention):
                raise TypeError(f"expected infer.interventions.Intervention, got {type(item).__name__}")
            if not -n <= item.layer < n:
                raise ValueError(
                    f"intervention ({item.describe()}): layer must be in [{-n}, {n}), the model has {n}"
                )
            block = layers[item.layer]
            width = int(getattr(model, "config").hidden_size)  # noqa: B009
            head_dims, proj, what = None, None, "hidden_size"
            if item.head is not None:
                proj, heads, hd = _attention(block)
                if not 0 <= item.head < heads:
                    raise ValueError(f"intervention ({item.describe()}): head must be in [0, {heads})")
                head_dims, width, what = (heads, hd), hd, "the head size"
            value = item.value
            if value is not None and (value.ndim == 0 or value.shape[-1] != width):
                raise ValueError(
                    f"intervention ({item.describe()}): the value's last dimension must be {width} "
                    f"({what}), got shape {tuple(value.shape)}"
                )
            handles += _install(block, item, head_dims, proj)
            checked.append(item)
    except BaseException:
        for h in handles:
            h.remove()
        raise
    return Interventions(checked, handles)


def _install(
    block: nn.Module, item: Intervention, head_dims: tuple[int, int] | None, proj: nn.Module | None
) -> list[RemovableHandle]:
    """The hooks of one intervention: on the block's output, or (a head) before its output projection."""

    def refuse_cached(module: nn.Module, args: tuple[Any, ...]) -> None:
        if _in_generation(args):
            raise ValueError(
                f"intervention ({item.describe()}): positions= applies to whole-sequence forwards "
                "(llm.model(ids), no cache); a step with a KV cache (generation) sees only its new "
                "tokens: leave positions out to edit every token"
            )

    def on_block(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return _edit(out, item, None)

    def on_heads(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (_edit(args[0], item, head_dims), *args[1:])

    handles = [] if item.positions is None else [block.register_forward_pre_hook(refuse_cached)]
    if proj is None:
        handles.append(block.register_forward_hook(on_block))
    else:
        handles.append(proj.register_forward_pre_hook(on_heads))
    return handles


__all__ = ["Intervention", "Interventions", "intervene"]
