"""Units of streaming and their layout in a flat buffer.

A *unit* (a layer group, or a chunk of rows of a streamed ``lm_head``) moves as one piece; its
tensors (*slots*) sit at aligned offsets of one flat byte buffer, so every slot is a view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.streaming.store import TensorRef

ALIGN = 256  # bytes: keeps every view as aligned as a fresh allocation (CUDA and SIMD kernels)


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Slot:
    """One tensor of a unit: ``layer`` (None for a head chunk), its ``name`` inside the layer."""

    layer: int | None
    name: str
    ref: TensorRef
    rows: tuple[int, int] | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This slot inside the flat ``uint8`` buffer ``flat``."""
        return flat[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class Unit:
    """A layer group (``group`` is its index) or a head chunk (``group`` is None, ``rows`` set)."""

    index: int
    group: int | None
    layers: tuple[int, ...]
    slots: tuple[Slot, ...]
    nbytes: int
    rows: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        if self.group is None:
            assert self.rows is not None
            return f"lm_head[{self.rows[0]}:{self.rows[1]}]"
        first, last = self.layers[0], self.layers[-1]
        return (
            f"group {self.group} (layer {first})"
            if first == last
            else f"group {self.group} (layers {first}-{last})"
        )


def layer_unit(index: int, group: int, layers: list[tuple[int, dict[str, TensorRef]]]) -> Unit:
    """A unit holding every tensor of ``layers`` (``(layer index, {name: ref})``), laid out in order."""
    slots: list[Slot] = []
    offset = 0
    for layer, refs in layers:
        for name, ref in refs.items():
            slots.append(Slot(layer, name, ref, None, ref.shape, ref.dtype, offset, ref.nbytes))
            offset += align_up(ref.nbytes)
    return Unit(index, group, tuple(i for i, _ in layers), tuple(slots), offset)


def head_units(first_index: int, ref: TensorRef, rows_per_chunk: int) -> list[Unit]:
    """``lm_head`` ``[V, D]`` cut into chunks of ``rows_per_chunk`` vocabulary rows."""
    vocab = ref.shape[0]
    units = []
    for k, start in enumerate(range(0, vocab, rows_per_chunk)):
        stop = min(vocab, start + rows_per_chunk)
        shape = (stop - start, *ref.shape[1:])
        nbytes = (stop - start) * ref.row_bytes()
        slot = Slot(None, "weight", ref, (start, stop), shape, ref.dtype, 0, nbytes)
        units.append(Unit(first_index + k, None, (), (slot,), align_up(nbytes), (start, stop)))
    return units


def layer_bytes(refs: dict[str, TensorRef]) -> int:
    """Bytes of one layer as laid out in a buffer."""
    return sum(align_up(r.nbytes) for r in refs.values())
