"""Where streamed weights live between forwards: the checkpoint itself, or a local stream file.

A float tensor that needs only a dtype conversion points into the checkpoint (`TensorRef`) and is
converted as it is read; what the placement changed (packed, quantized, permuted) is written once
to a local stream file. Reads go into caller-owned tensors; with ``validate`` each tensor is
checked for NaN / inf on first read. See docs/streaming.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from infer.assembly.place import check_finite
from infer.loader.source import StoredTensor, WeightSource, pread_into

SCRATCH_BYTES = 8 * 2**20  # conversion buffer: the only memory a read allocates
_FILE_ALIGN = 64


@dataclass(frozen=True)
class TensorRef:
    """One streamed tensor: the ``shape`` / ``dtype`` the model holds, and where its bytes are.

    ``offset`` is None for a tensor read from the checkpoint (``key`` is its stored name,
    ``stored_dtype`` the dtype it is stored in); otherwise it is the tensor's byte offset
    in the local stream file, stored as ``dtype``.
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stored_dtype: torch.dtype
    offset: int | None = None

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    def row_bytes(self) -> int:
        """Bytes of one row (first dimension) in the model's dtype."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0


class WeightStore(Protocol):
    """What the streaming executor reads weights from (`StreamStore`, or a test's wrapper)."""

    description: str

    def read_into(self, ref: TensorRef, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Copy ``ref`` (or its rows ``[start, stop)``) into the contiguous CPU tensor ``out``."""
        ...

    def read_rows(self, ref: TensorRef, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index [N]`` of ``ref``: a new CPU tensor ``[N, ...]`` in ``ref.dtype`` (embeddings)."""
        ...

    def prefetch_hint(self, ref: TensorRef) -> None:
        """``ref`` will be read soon (OS readahead)."""
        ...

    @property
    def scratch_bytes(self) -> int:
        """Host memory a read may allocate (the conversion buffer), for the memory plan."""
        ...

    def close(self) -> None: ...


class StreamStore:
    """The `WeightStore` of a streamed model: refs into ``source`` and into a local stream file."""

    def __init__(
        self, source: WeightSource, *, validate: bool = True, directory: str | Path | None = None
    ) -> None:
        self.source = source
        self.description = source.description
        self.validate = validate
        self._dir: Path | None = None
        self._parent = directory
        self._fd: int | None = None
        self._size = 0
        self._scratch: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._checked: set[tuple[str, int | None, tuple[int, int] | None]] = set()
        self._converts = False
        self._cleanup: weakref.finalize[[int, Path], StreamStore] | None = None

    # ---- building -----------------------------------------------------------------

    def source_ref(self, stored: StoredTensor, dtype: torch.dtype) -> TensorRef:
        """A tensor read from the checkpoint as it is stored, converted to ``dtype`` on read."""
        if stored.packed:
            raise ValueError(
                f"{self.description}: {stored.name!r} is packed; it must be converted, not referenced"
            )
        if not stored.dtype.is_floating_point:
            raise ValueError(
                f"{self.description}: tensor {stored.name!r} has dtype {stored.dtype}, "
                "expected a floating-point tensor"
            )
        self._converts |= dtype != stored.dtype
        return TensorRef(stored.name, stored.shape, dtype, stored.dtype)

    def write(self, label: str, tensors: dict[str, torch.Tensor]) -> dict[str, TensorRef]:
        """Append ``tensors`` (converted at load) to the stream file; their refs by name."""
        if self._fd is None:
            self._dir = Path(tempfile.mkdtemp(prefix="infer-stream-", dir=self._parent))
            self._fd = os.open(self._dir / "weights.bin", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self._cleanup = weakref.finalize(self, _remove, self._fd, self._dir)
        refs: dict[str, TensorRef] = {}
        for name, t in tensors.items():
            data = t.detach().contiguous().cpu()
            offset = -(-self._size // _FILE_ALIGN) * _FILE_ALIGN
            raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
            written = os.pwrite(self._fd, raw, offset)
            if written != len(raw):
                raise OSError(f"stream file {self._dir}: short write ({written} of {len(raw)} bytes)")
            self._size = offset + len(raw)
            refs[name] = TensorRef(f"{label}.{name}", tuple(data.shape), data.dtype, data.dtype, offset)
        return refs

    # ---- reading ------------------------------------------------------------------

    @property
    def scratch_bytes(self) -> int:
        return SCRATCH_BYTES if self._converts else 0

    def _check(self, ref: TensorRef, rows: tuple[int, int] | None, values: torch.Tensor) -> None:
        key = (ref.key, ref.offset, rows)
        if self.validate and key not in self._checked and values.is_floating_point():
            check_finite(values, f"{self.description}: tensor {ref.key!r}")
            self._checked.add(key)

    def read_into(self, ref: TensorRef, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        shape = ref.shape if rows is None else (rows[1] - rows[0], *ref.shape[1:])
        if tuple(out.shape) != tuple(shape) or out.dtype != ref.dtype or not out.is_contiguous():
            raise ValueError(
                f"{self.description}: tensor {ref.key!r}{'' if rows is None else f' rows {rows}'} is "
                f"{ref.dtype} {list(shape)}; the destination is {out.dtype} {list(out.shape)}"
            )
        if ref.offset is not None:
            assert self._fd is not None
            start = ref.offset + (rows[0] * ref.row_bytes() if rows is not None else 0)
            pread_into(self._fd, out, start, f"stream file {self._dir}: {ref.key!r}")
        elif ref.stored_dtype == ref.dtype:
            self.source.read_into(ref.key, out, rows)
        else:
            self._convert_into(ref, out, rows)
        self._check(ref, rows, out)

    def _convert_into(self, ref: TensorRef, out: torch.Tensor, rows: tuple[int, int] | None) -> None:
        """Read ``ref`` stored as ``stored_dtype`` into ``out`` (``dtype``), a chunk of rows at a time."""
        first, last = rows if rows is not None else (0, ref.shape[0])
        per_row = math.prod(ref.shape[1:])  # values per row
        step = max(1, SCRATCH_BYTES // (per_row * ref.stored_dtype.itemsize))
        flat = out.reshape(out.shape[0], -1)  # [rows, values per row]
        with self._lock:
            if self._scratch is None:
                self._scratch = torch.empty(SCRATCH_BYTES, dtype=torch.uint8)
            for start in range(first, last, step):
                stop = min(last, start + step)
                n = (stop - start) * per_row
                chunk = self._scratch[: n * ref.stored_dtype.itemsize].view(ref.stored_dtype)
                self.source.read_into(ref.key, chunk.view(stop - start, *ref.shape[1:]), (start, stop))
                flat[start - first : stop - first].copy_(chunk.view(stop - start, -1))

    def read_rows(self, ref: TensorRef, index: torch.Tensor) -> torch.Tensor:
        ids = index.to("cpu", torch.long).reshape(-1)
        unique, inverse = torch.unique(ids, return_inverse=True)  # sorted
        rows = torch.empty(unique.numel(), *ref.shape[1:], dtype=ref.dtype)
        wanted = unique.tolist()
        k = 0
        while k < len(wanted):  # one read per run of consecutive rows
            end = k + 1
            while end < len(wanted) and wanted[end] == wanted[end - 1] + 1:
                end += 1
            self.read_into(ref, rows[k:end], (wanted[k], wanted[end - 1] + 1))
            k = end
        return rows[inverse]

    def prefetch_hint(self, ref: TensorRef) -> None:
        if ref.offset is None:
            self.source.prefetch_hint(ref.key)
        elif self._fd is not None:
            os.posix_fadvise(self._fd, ref.offset, ref.nbytes, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup()
        self._fd = None
        self.source.close()


def _remove(fd: int, directory: Path) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    shutil.rmtree(directory, ignore_errors=True)


__all__ = ["SCRATCH_BYTES", "StreamStore", "TensorRef", "WeightStore"]
