"""`infer.host.filemap`: a mapped file's tensors each own a storage; `span` joins adjacent ones.

A nested compile region refuses inputs that share a storage, so a mapped tensor must never be a
view of one storage covering the whole file (the repack cache's matrices were, and every GGUF
model from the cache failed ``compile=True``).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from infer.host.filemap import MappedFile, span


@pytest.fixture
def file(tmp_path: Path) -> Path:
    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(range(256)) * 16)  # 4,096 bytes: byte i is i % 256
    return path


def test_tensors_own_their_storages_and_read_the_file(file: Path) -> None:
    mapped = MappedFile(file)
    a, b = mapped.tensor(64, 128), mapped.tensor(192, 64)
    assert a.untyped_storage().nbytes() == 128 and b.untyped_storage().nbytes() == 64
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert b.data_ptr() == a.data_ptr() + 128  # one mapping: adjacent bytes are adjacent in memory
    assert a.tolist() == list(range(64, 192)) and b.tolist() == list(range(192, 256))
    with pytest.raises(ValueError, match=r"bytes \[4000, 4200\) lie outside a file of 4096 bytes"):
        mapped.tensor(4000, 200)


def test_span_joins_adjacent_parts_without_a_copy(file: Path) -> None:
    mapped = MappedFile(file)
    parts = [mapped.tensor(0, 64).view(torch.int32), mapped.tensor(64, 128).view(torch.int32)]
    joined = span(parts)
    assert joined is not None and joined.dtype == torch.uint8 and joined.numel() == 192
    assert joined.data_ptr() == parts[0].data_ptr()  # the mapped bytes themselves
    assert joined.untyped_storage().nbytes() == 192  # ... under a storage of its own
    assert joined.tolist() == list(range(192))
    assert span([mapped.tensor(0, 64), mapped.tensor(128, 64)]) is None  # a gap
    assert span([mapped.tensor(64, 64), mapped.tensor(0, 64)]) is None  # out of order
    heap = torch.zeros(128, dtype=torch.uint8)
    assert span([heap[:64], heap[64:]]) is None  # not a mapped file


def test_tensors_keep_the_mapping_alive(file: Path) -> None:
    mapped = MappedFile(file)
    a, b = mapped.tensor(0, 64), mapped.tensor(64, 64)
    del mapped
    gc.collect()
    joined = span([a, b])  # the mapping outlives its MappedFile while a tensor reads it
    assert joined is not None and joined.tolist() == list(range(128))
