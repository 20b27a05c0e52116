"""Reading byte ranges of a safetensors file straight into tensors.

Whole tensors (and row ranges) are read with ``pread`` into the destination's memory:
one copy out of the page cache, no mapping left behind, so the process's resident
set does not grow with every layer it has streamed. A tensor stored in another
dtype is read through a small reusable scratch buffer and converted chunk by chunk.
Embedding lookups read only the rows they need, one ``pread`` per run of consecutive
rows. Nothing is memory-mapped: a checkpoint truncated or replaced under a running
model gives an ``OSError`` naming the file, never a ``SIGBUS``.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import threading
import weakref
from pathlib import Path

import torch

SCRATCH_BYTES = 8 * 2**20  # conversion buffer: the only memory a read allocates


def safetensors_offsets(file: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """Start of the data section and each tensor's ``[begin, end)`` byte offsets within it."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    offsets = {
        k: (int(v["data_offsets"][0]), int(v["data_offsets"][1]))
        for k, v in header.items()
        if k != "__metadata__"
    }
    return 8 + n, offsets


def _writable_bytes(t: torch.Tensor) -> memoryview:
    """The memory of the contiguous CPU tensor ``t`` as a writable byte view."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class SafetensorsFile:
    """One file of a checkpoint: tensor offsets and a descriptor for ``pread``."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.data_start, self.offsets = safetensors_offsets(file)
        self.fd = os.open(file, os.O_RDONLY)
        self._close_fd = weakref.finalize(self, os.close, self.fd)

    def pread(self, out: torch.Tensor, offset: int, what: str = "") -> None:
        """Fill the contiguous CPU tensor ``out`` with the bytes at ``offset`` of the data section.

        ``OSError`` (naming the file and ``what``) if the file ends first: it was
        truncated or replaced after it was opened.
        """
        view = _writable_bytes(out)
        done, total = 0, len(view)
        while done < total:
            got = os.preadv(self.fd, [view[done:]], self.data_start + offset + done)
            if got <= 0:
                start = self.data_start + offset
                raise OSError(
                    f"{self.file}: {what + ' ' if what else ''}needs bytes {start}..{start + total}, but the "
                    f"file now has {os.fstat(self.fd).st_size} bytes: it changed after it was opened"
                )
            done += got

    def read_rows(
        self, key: str, dtype: torch.dtype, shape: tuple[int, ...], index: torch.Tensor
    ) -> torch.Tensor:
        """Rows ``index`` (``[R]``, any integer dtype) of tensor ``key``: ``[R, *shape[1:]]``.

        Each distinct row is read once, with one ``pread`` per run of consecutive rows.
        """
        rows = index.reshape(-1).to("cpu", torch.long)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= shape[0]):
            raise IndexError(
                f"{self.file}: tensor {key!r} has {shape[0]} rows; asked for rows "
                f"{int(rows.min())}..{int(rows.max())}"
            )
        unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
        out = torch.empty(unique.numel(), *shape[1:], dtype=dtype)  # [U, ...]
        row_bytes = out[0].numel() * dtype.itemsize if unique.numel() else 0
        begin = self.offsets[key][0]
        breaks = (torch.nonzero(unique[1:] - unique[:-1] != 1).flatten() + 1).tolist()
        first = unique.tolist()
        for a, b in zip([0, *breaks], [*breaks, unique.numel()], strict=True):
            if a < b:
                self.pread(
                    out[a:b], begin + first[a] * row_bytes, f"rows {first[a]}..{first[b - 1]} of {key!r}"
                )
        return out.index_select(0, inverse)  # [R, ...]

    def mapped(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> RowTable:
        """Tensor ``key`` as a `RowTable` whose ``index_select(0, rows)`` calls `read_rows`.

        Kept for callers written for the former memory-mapped table; use `read_rows`.
        """
        return RowTable(self, key, dtype, shape)

    def close(self) -> None:
        self._close_fd()


class RowTable:
    """A tensor of a `SafetensorsFile` that reads the rows it is asked for (see `SafetensorsFile.mapped`)."""

    def __init__(self, file: SafetensorsFile, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.file, self.key, self.dtype, self.shape = file, key, dtype, shape

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        if dim != 0:
            raise ValueError(
                f"{self.file.file}: {self.key!r}: rows are selected along dimension 0, not {dim}"
            )
        return self.file.read_rows(self.key, self.dtype, self.shape, index)


class ConvertingReader:
    """Reads stored bytes into tensors of another dtype through one shared scratch buffer."""

    def __init__(self) -> None:
        self._scratch: torch.Tensor | None = None
        self._lock = threading.Lock()

    def read(self, file: SafetensorsFile, offset: int, stored: torch.dtype, out: torch.Tensor) -> None:
        flat = out.view(-1)  # [N] in the target dtype
        step = SCRATCH_BYTES // stored.itemsize
        with self._lock:
            if self._scratch is None:
                self._scratch = torch.empty(SCRATCH_BYTES, dtype=torch.uint8)
            for start in range(0, flat.numel(), step):
                stop = min(flat.numel(), start + step)
                chunk = self._scratch[: (stop - start) * stored.itemsize]
                file.pread(chunk, offset + start * stored.itemsize)
                flat[start:stop].copy_(chunk.view(stored))
