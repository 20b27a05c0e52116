"""A GGUF file as a `WeightSource`: its tensor table, read with ``pread``.

Float tensors (F32, F16, BF16) are plain tensors of that dtype; every other GGML type
is a packed tensor read as ``uint8 [rows, row_bytes]`` (`StoredTensor.qtype`), which the
model builder turns into packed modules without ever expanding the whole matrix.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path

import torch

from infer.gguf.reader import GGUFFile
from infer.host.filemap import MappedFile
from infer.loader.source import StoredTensor, pread_into
from infer.quant.ggml import FLOAT_TYPES, QType

_FLOAT_DTYPES: dict[QType, torch.dtype] = {
    QType.F32: torch.float32,
    QType.F16: torch.float16,
    QType.BF16: torch.bfloat16,
}
assert set(_FLOAT_DTYPES) == FLOAT_TYPES


class GGUFSource:
    """The tensors of ``gguf`` (an open `GGUFFile`), read from its file."""

    naming = "gguf"

    def __init__(self, gguf: GGUFFile) -> None:
        self.gguf = gguf
        self.path = Path(gguf.path)
        self.description = str(self.path)
        self._tensors: dict[str, StoredTensor] = {}
        self._offsets: dict[str, int] = {}
        for info in gguf.tensors.values():
            dtype = _FLOAT_DTYPES.get(info.ggml_type)
            qtype = None if dtype is not None else info.ggml_type
            stored = StoredTensor(info.name, info.shape, dtype or torch.uint8, info.nbytes, qtype)
            self._tensors[info.name] = stored
            self._offsets[info.name] = info.offset
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize[[int], GGUFSource] | None = None
        self._map: MappedFile | None = None  # the whole file, mapped on first `mapped`

    def tensors(self) -> Mapping[str, StoredTensor]:
        return self._tensors

    def _file(self) -> int:
        with self._lock:
            if self._fd is None:
                fd = os.open(self.path, os.O_RDONLY)
                self._fd = fd
                self._finalizer = weakref.finalize(self, _close, fd)
            return self._fd

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        info = self._tensors.get(name)
        if info is None:
            raise KeyError(f"{self.description}: no tensor named {name!r}")
        expected = tuple(info.buffer(rows).shape)
        want = torch.uint8 if info.packed else info.dtype
        if tuple(out.shape) != expected or out.dtype != want:
            raise ValueError(
                f"{self.description}: tensor {name!r}{'' if rows is None else f' rows {rows}'} reads as "
                f"{want} {list(expected)}; the destination is {out.dtype} {list(out.shape)}"
            )
        offset = self._offsets[name] + (rows[0] * info.row_bytes if rows is not None else 0)
        pread_into(self._file(), out, offset, f"{self.description}: tensor {name!r}")

    def mapped(self, name: str) -> torch.Tensor:
        """Packed tensor ``name``'s bytes ``[rows, row_bytes]`` as a view of the file mapped (private,
        read-only use; a storage of its own, `infer.host.filemap`): for matrices kept as they are stored
        (an embedding looked up row by row), only the rows read become resident, and nothing is
        copied onto the heap."""
        info = self._tensors.get(name)
        if info is None or not info.packed:
            raise KeyError(f"{self.description}: no packed tensor named {name!r}")
        with self._lock:
            if self._map is None:
                self._map = MappedFile(self.path)
            whole = self._map
        offset = self._offsets[name]
        if offset + info.nbytes > whole.size:
            raise ValueError(f"{self.description}: tensor {name!r} ends past the end of the file")
        return whole.tensor(offset, info.nbytes).view(tuple(info.buffer(None).shape))

    def prefetch_hint(self, name: str) -> None:
        info = self._tensors[name]
        os.posix_fadvise(self._file(), self._offsets[name], info.nbytes, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()
            self._fd = None


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


__all__ = ["GGUFSource"]
