"""Reading byte ranges of a safetensors file straight into tensors.

Whole tensors (and row ranges) are read with ``pread`` into the destination's memory:
one copy out of the page cache, no mapping left behind, so the process's resident
set does not grow with every layer it has streamed. A tensor stored in another
dtype is read through a small reusable scratch buffer and converted chunk by chunk.
Embedding lookups touch a few rows only; they go through a read-only memory map.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import struct
import threading
import warnings
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
    """One file of a checkpoint: tensor offsets, a descriptor for ``pread``, a lazy memory map."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.data_start, self.offsets = safetensors_offsets(file)
        self.fd = os.open(file, os.O_RDONLY)
        self._close_fd = weakref.finalize(self, os.close, self.fd)
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self._lock = threading.Lock()

    def pread(self, out: torch.Tensor, offset: int) -> None:
        """Fill the contiguous CPU tensor ``out`` with the bytes at ``offset`` of the data section."""
        view = _writable_bytes(out)
        done, total = 0, len(view)
        while done < total:
            got = os.preadv(self.fd, [view[done:]], self.data_start + offset + done)
            if got <= 0:
                raise OSError(
                    f"{self.file}: unexpected end of file at byte {self.data_start + offset + done}"
                )
            done += got

    def mapped(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """``key`` as a tensor viewing the memory map (for gathering a few rows)."""
        with self._lock:
            if self._bytes is None:
                self._map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
                with warnings.catch_warnings():  # read-only mapping, never written through
                    warnings.simplefilter("ignore", UserWarning)
                    self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        begin, end = self.offsets[key]
        raw = self._bytes[self.data_start + begin : self.data_start + end]
        if (self.data_start + begin) % dtype.itemsize:
            raw = raw.clone()  # misaligned in the file: an aligned copy of this one tensor
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        self._bytes = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a row view still alive keeps the map
                self._map.close()
            self._map = None
        self._close_fd()


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
