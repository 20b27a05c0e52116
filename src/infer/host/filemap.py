"""Files mapped into memory, handed out as tensors that each own a storage.

Floor 0 (no infer imports): the repack cache (`infer.assembly.repack_cache`), the GGUF reader's
embedding rows (`infer.gguf.source`) and the fused products (`infer.quant.linear`) use it.

A `MappedFile` is one private mapping of a file (``mmap`` with ``MAP_PRIVATE``: nothing is
written back, and pages become resident as they are read). `MappedFile.tensor` returns bytes of
it as a uint8 tensor whose storage is its own (``torch.frombuffer``: no copy; the tensor keeps
the mapping alive), never a view of one storage covering the whole file. That matters to
``torch.compile``: the blocks of a model compiled as a nested region
(`infer.models.base`) take their weights as inputs, and a region refuses inputs that share a
storage ("Encountered aliasing during higher order op tracing"), whatever bytes each covers.
`span` joins tensors that lie one after another in one mapping into one tensor over their
bytes, again with a storage of its own (fused q/k/v and gate/up without a copy).
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Sequence

import torch

# Live mappings by the address of their first byte; an entry goes when its mapping is freed
# (when the last tensor over it is), so an address here is always that mapping's.
_LIVE: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()


class MappedFile:
    """A private mapping of the whole (non-empty) file at ``path``, ``size`` bytes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        with open(path, "rb") as f:
            # ACCESS_COPY: MAP_PRIVATE, readable and writable (copy on write, never written back),
            # as torch.from_file(shared=False) maps: frombuffer wants a writable buffer.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.size = len(self._map)
        self.address = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        _LIVE[self.address] = self._map

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of the file: uint8 ``[nbytes]``, a storage of its own."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) lie outside a file of {self.size} bytes")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)


def span(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One uint8 tensor ``[total bytes]`` over the bytes of ``parts``, with a storage of its own, when
    they are contiguous CPU tensors lying one after another (no gap) in one live `MappedFile`; else
    None. Its bytes are the parts' bytes (a view of the mapping, not a copy)."""
    if not parts or not all(p.is_cpu and p.is_contiguous() and p.numel() > 0 for p in parts):
        return None
    start = at = parts[0].data_ptr()
    for p in parts:
        if p.data_ptr() != at:
            return None
        at += p.numel() * p.element_size()
    for base, mapping in list(_LIVE.items()):
        if base <= start and at <= base + len(mapping):
            return torch.frombuffer(mapping, dtype=torch.uint8, count=at - start, offset=start - base)
    return None


__all__ = ["MappedFile", "span"]
