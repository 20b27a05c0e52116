"""`WeightSource`: a checkpoint's stored tensors, listed up front and read on demand.

Everything that builds a model reads weights through this interface, whatever the
format: `infer.loader.weights.SafetensorsSource` (a directory, one file or shards),
`infer.gguf.source.GGUFSource` (a GGUF file). A new source (a checkpoint behind HTTP
range requests, say) implements these members and nothing else; the model builder
(`infer.assembly.build`) maps its names to modules, places the values, quantizes them
and streams them exactly as it does for the built-in ones.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from infer.quant.ggml import QType


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as stored: ``name`` in the checkpoint, ``shape`` in torch order.

    ``dtype`` is the element type of a plain tensor (float, int); a tensor in a GGML
    block format has ``qtype`` set and is read as ``uint8 [rows, row_bytes]`` (``dtype``
    is then ``torch.uint8``). ``nbytes`` is its size in the file.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    qtype: QType | None = None

    @property
    def packed(self) -> bool:
        return self.qtype is not None

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (first dimension); rows are the unit of partial reads."""
        return self.nbytes // self.rows if self.rows else 0

    def buffer(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """An empty CPU tensor that `WeightSource.read_into` fills with this tensor (or ``rows`` of it)."""
        n = self.rows if rows is None else rows[1] - rows[0]
        if self.packed:
            return torch.empty(n, self.row_bytes, dtype=torch.uint8)
        return (
            torch.empty(n, *self.shape[1:], dtype=self.dtype)
            if self.shape
            else torch.empty((), dtype=self.dtype)
        )


@dataclass(frozen=True)
class Slice:
    """The part of a tensor one tensor-parallel rank holds: ``ranges`` along ``dim`` (model orientation).

    ``dim`` 0 is rows (output features, vocabulary), 1 columns (input features); several
    ranges (one per segment of a fused module) are concatenated in order. ``full`` is the
    tensor's whole size along ``dim``.
    """

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full: int

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)


class WeightSource(Protocol):
    """The stored tensors of a checkpoint.

    ``description`` names the checkpoint in errors (a path). ``naming`` says whose tensor
    names it uses: ``"hf"`` (transformers' ``model.layers.0.self_attn.q_proj.weight``) or
    ``"gguf"`` (llama.cpp's ``blk.0.attn_q.weight``).
    """

    description: str
    naming: str

    def tensors(self) -> Mapping[str, StoredTensor]:
        """Every stored tensor by name, without reading data."""
        ...

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Copy tensor ``name`` (or its rows ``[start, stop)``) into ``out``.

        ``out`` is a contiguous CPU tensor shaped like `StoredTensor.buffer` (the stored
        dtype, or ``uint8 [rows, row_bytes]`` for a packed tensor). A file that is shorter
        than its header says, or changes under the reader, raises `OSError`.
        """
        ...

    def prefetch_hint(self, name: str) -> None:
        """``name`` will be read soon (start the OS readahead); a source may do nothing."""
        ...

    def close(self) -> None:
        """Release files; the source is not used afterwards."""
        ...


def read_tensor(source: WeightSource, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Tensor ``name`` of ``source`` (or ``rows`` of it) in a new CPU tensor."""
    out = source.tensors()[name].buffer(rows)
    source.read_into(name, out, rows)
    return out


def pread_into(fd: int, out: torch.Tensor, offset: int, what: str) -> None:
    """Fill the contiguous CPU tensor ``out`` with the bytes at ``offset`` of file ``fd``.

    Reads with ``preadv`` into ``out``'s memory (one copy out of the page cache, no
    mapping left behind: a file truncated under us is an `OSError`, never a SIGBUS).
    """
    if not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"{what}: the destination must be a contiguous CPU tensor")
    total = out.numel() * out.element_size()
    if total == 0:
        return
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    done = 0
    while done < total:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"{what}: unexpected end of file at byte {offset + done} (the file shrank?)")
        done += got


__all__ = ["Slice", "StoredTensor", "WeightSource", "pread_into", "read_tensor"]
