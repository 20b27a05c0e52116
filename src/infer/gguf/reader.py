"""A GGUF reader that opens a file in milliseconds: header, metadata and tensor table.

The header is read with ordinary reads and parsed with ``struct``; string arrays are decoded only
when asked for, and nothing stays memory-mapped (a file changed under a process gives ``OSError``,
never ``SIGBUS``). Every length, count and offset is checked against the file size, and tensors
must lie in table order without overlap, as llama.cpp requires. See docs/gguf.md, "Reading".

Layout (little-endian, versions 2 and 3)::

    "GGUF" u32 version, u64 tensor_count, u64 kv_count
    kv_count x   (string key, u32 value_type, value)
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32), then the tensor data;
    a string is u64 length + UTF-8 bytes; an array is u32 item type, u64 count, items.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
INITIAL_READ = 1 << 20  # header bytes read at open; the read doubles while parsing needs more

# GGUF value types -> (struct format, numpy dtype); 8 = string, 9 = array.
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<u1"),  # bool, one byte
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
VALUE_TYPE_NAMES = {
    0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32",
    7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64",
}  # fmt: skip


class StringArray(Sequence[str]):
    """A metadata array of strings, decoded on access (``tolist()`` decodes all of them)."""

    def __init__(self, buf: bytearray, starts: array[int], lengths: array[int]) -> None:
        self._buf = buf
        self._starts = starts
        self._lengths = lengths

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        s = self._starts[index]
        return self._buf[s : s + self._lengths[index]].decode("utf-8", errors="replace")

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self[i]

    def tolist(self) -> list[str]:
        return list(self)


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table.

    ``shape`` is in torch order (GGUF lists dimensions fastest-first, so ``[in, out]``
    in the file is ``(out, in)`` here); ``offset`` is absolute in the file.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class GGUFFile:
    """A parsed GGUF header: ``metadata`` (key -> value), ``tensors`` (name -> `TensorInfo`).

    Scalars are Python ``int``/``float``/``bool``/``str``; numeric arrays are numpy
    arrays; string arrays are `StringArray`. Tensor bytes are read from the file on
    request (`read`); nothing of the file stays mapped.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        self.size = self.path.stat().st_size
        if self.size < 24:
            raise ValueError(f"{self.path}: not a GGUF file: {self.size} bytes, less than the 24-byte header")
        self._buf = bytearray()  # the file's first bytes, as many as parsing has needed
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, tuple[int, ...]] = {}  # key -> (type,) or (ARRAY, item type)
        self.tensors: dict[str, TensorInfo] = {}
        with self.path.open("rb") as self._file:
            self._parse()
            self._load(min(self.data_offset, self.size))
        del self._buf[self.data_offset :]  # keep the header only

    # ---- public helpers ---------------------------------------------------------

    def describe(self, key: str) -> str:
        """What the file holds at metadata ``key``, for error messages: its type and value (or length)."""
        types = self.value_types[key]
        value = self.metadata[key]
        if types[0] == _ARRAY:
            return f"an array of {len(value)} {VALUE_TYPE_NAMES.get(types[1], '?')}"
        return f"{VALUE_TYPE_NAMES.get(types[0], '?')} {value!r}"[:200]

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor ``name`` (``uint8``), read from the file: `read`."""
        return self.read(name)

    def read(self, name: str) -> np.ndarray:
        """A fresh copy of tensor ``name``'s bytes (``uint8``), read from the file.

        Raises ``OSError`` naming the file and the tensor if the file is shorter than
        when it was opened (it was truncated or replaced meanwhile).
        """
        info = self.tensors[name]
        out = np.empty(info.nbytes, dtype=np.uint8)
        with self.path.open("rb") as f:
            f.seek(info.offset)
            got = f.readinto(out.data)
            if got != info.nbytes:
                raise OSError(
                    f"{self.path}: tensor {name!r} needs bytes {info.offset}..{info.offset + info.nbytes}, "
                    f"but the file now has {os.fstat(f.fileno()).st_size} bytes: it changed after it was "
                    "opened"
                )
        return out

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path}: metadata key 'general.architecture' is missing or not a string")
        return arch

    def header_digest(self) -> str:
        """sha256 of everything before the tensor data (metadata + tensor table): the file's identity."""
        return hashlib.sha256(self._buf).hexdigest()

    def close(self) -> None:
        """Drop the parsed header (the file is not held open)."""
        self.metadata = {}
        self.tensors = {}
        self._buf = bytearray()

    # ---- parsing --------------------------------------------------------------

    def _fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: corrupt or truncated GGUF file: {what}")

    def _load(self, end: int) -> None:
        """Read the file up to byte ``end`` (<= its size) into the header buffer, at least doubling it."""
        have = len(self._buf)
        if end <= have:
            return
        target = min(self.size, max(end, 2 * have, INITIAL_READ))
        chunk = self._file.read(target - have)
        if have + len(chunk) < end:
            raise OSError(
                f"{self.path}: the file ends at byte {have + len(chunk)} while its header was read "
                f"({self.size} bytes when opened): it changed meanwhile"
            )
        self._buf += chunk

    def _need(self, pos: int, n: int, what: str) -> None:
        if n < 0 or pos + n > self.size:
            raise self._fail(f"{what} needs bytes {pos}..{pos + n}, but the file has {self.size} bytes")
        self._load(pos + n)

    def _unpack(self, fmt: str, pos: int, what: str) -> tuple[Any, int]:
        n = struct.calcsize(fmt)
        self._need(pos, n, what)
        return struct.unpack_from(fmt, self._buf, pos)[0], pos + n

    def _string(self, pos: int, what: str) -> tuple[str, int]:
        length, pos = self._unpack("<Q", pos, f"length of {what}")
        self._need(pos, length, what)
        raw = bytes(self._buf[pos : pos + length])
        try:
            return raw.decode("utf-8"), pos + length
        except UnicodeDecodeError as e:
            raise self._fail(f"{what} is not valid UTF-8 ({e})") from None

    def _parse(self) -> None:
        self._load(24)
        magic = bytes(self._buf[:4])
        if magic != MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file: magic {magic!r}, expected {MAGIC!r}")
        version, pos = self._unpack("<I", 4, "version")
        if version not in SUPPORTED_VERSIONS:
            swapped = struct.unpack("<I", struct.pack(">I", version))[0]
            hint = " (a big-endian file?)" if swapped in SUPPORTED_VERSIONS else ""
            raise ValueError(
                f"{self.path}: unsupported GGUF version {version}{hint}; "
                f"supported: {list(SUPPORTED_VERSIONS)}"
            )
        self.version = int(version)
        n_tensors, pos = self._unpack("<Q", pos, "tensor count")
        n_kv, pos = self._unpack("<Q", pos, "metadata count")
        # Each metadata entry takes >= 12 bytes and each tensor entry >= 24: bound the loops.
        if n_kv * 12 > self.size or n_tensors * 24 > self.size:
            raise self._fail(f"{n_kv} metadata entries and {n_tensors} tensors cannot fit in the file")
        for i in range(n_kv):
            key, pos = self._string(pos, f"metadata key #{i}")
            if key in self.metadata:
                raise self._fail(f"metadata key {key!r} appears twice")
            vtype, pos = self._unpack("<I", pos, f"type of metadata {key!r}")
            value, types, pos = self._value(vtype, pos, key)
            self.metadata[key] = value
            self.value_types[key] = types
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment % 8:
            raise self._fail(f"general.alignment = {alignment!r}, expected a positive multiple of 8")
        self.alignment = alignment
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for i in range(n_tensors):
            name, pos = self._string(pos, f"name of tensor #{i}")
            n_dims, pos = self._unpack("<I", pos, f"dimension count of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self._fail(f"tensor {name!r} has {n_dims} dimensions, expected 1..{MAX_DIMS}")
            self._need(pos, 8 * n_dims, f"dimensions of tensor {name!r}")
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, pos)
            pos += 8 * n_dims
            ggml_type, pos = self._unpack("<I", pos, f"type of tensor {name!r}")
            offset, pos = self._unpack("<Q", pos, f"offset of tensor {name!r}")
            infos.append((name, tuple(int(d) for d in reversed(dims)), int(ggml_type), int(offset)))
        self.data_offset = -(-pos // self.alignment) * self.alignment
        expected, previous = 0, None  # where the next tensor's data must start (relative), and who ends there
        for name, shape, type_id, offset in infos:
            if name in self.tensors:
                raise self._fail(f"tensor {name!r} is listed twice")
            info = self._tensor_info(name, shape, type_id, offset)
            if offset != expected:
                after = (
                    f"tensor {previous!r} ends at {expected}" if previous else "the first tensor starts at 0"
                )
                raise self._fail(
                    f"tensor {name!r} has data offset {offset}, expected {expected} ({after}): tensor data "
                    f"must follow the table's order, each tensor padded to {self.alignment} bytes, "
                    "with no overlap or gap (as llama.cpp requires)"
                )
            self.tensors[name] = info
            expected += -(-info.nbytes // self.alignment) * self.alignment
            previous = name

    def _tensor_info(self, name: str, shape: tuple[int, ...], type_id: int, offset: int) -> TensorInfo:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise self._fail(f"tensor {name!r} has unknown ggml type {type_id}") from None
        if qtype not in GGML_QUANT_SIZES:
            raise self._fail(f"tensor {name!r} has ggml type {qtype.name}, which has no block size")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if any(d <= 0 for d in shape):
            raise self._fail(f"tensor {name!r} has shape {list(shape)} with an empty dimension")
        if shape[-1] % block:
            raise self._fail(
                f"tensor {name!r} ({qtype.name}) has rows of {shape[-1]} values, not a multiple of the "
                f"block size {block}"
            )
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel // block * type_size
        start = self.data_offset + offset
        if offset % self.alignment:
            raise self._fail(f"tensor {name!r} has offset {offset}, not a multiple of {self.alignment}")
        if start + nbytes > self.size:
            raise self._fail(
                f"tensor {name!r} ({qtype.name} {list(shape)}) spans bytes {start}..{start + nbytes}, "
                f"past the end of the file ({self.size} bytes)"
            )
        return TensorInfo(name, shape, qtype, start, nbytes)

    def _value(self, vtype: int, pos: int, key: str) -> tuple[Any, tuple[int, ...], int]:
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype][0]
            value, pos = self._unpack(fmt, pos, f"value of {key!r}")
            return (bool(value) if vtype == 7 else value), (vtype,), pos
        if vtype == _STRING:
            text, pos = self._string(pos, f"value of {key!r}")
            return text, (vtype,), pos
        if vtype != _ARRAY:
            raise self._fail(f"metadata {key!r} has unknown value type {vtype}")
        item, pos = self._unpack("<I", pos, f"item type of array {key!r}")
        count, pos = self._unpack("<Q", pos, f"length of array {key!r}")
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item][1])
            nbytes = count * dtype.itemsize
            self._need(pos, nbytes, f"array {key!r} ({count} x {VALUE_TYPE_NAMES[item]})")
            arr = np.frombuffer(self._buf, dtype=dtype, count=count, offset=pos).copy()  # no view kept
            arr = arr.astype(bool) if item == 7 else arr
            return arr, (vtype, item), pos + nbytes
        if item == _STRING:
            return self._string_array(key, count, pos)
        name = VALUE_TYPE_NAMES.get(item, "?")
        raise self._fail(f"array {key!r} has unsupported item type {item} ({name})")

    def _string_array(self, key: str, count: int, pos: int) -> tuple[StringArray, tuple[int, ...], int]:
        if count * 8 > self.size - pos:
            raise self._fail(f"array {key!r} claims {count} strings, more than the file can hold")
        starts: array[int] = array("q")
        lengths: array[int] = array("q")
        unpack = struct.Struct("<Q").unpack_from
        size = self.size
        buf = self._buf
        loaded = len(buf)
        for _ in range(count):
            if pos + 8 > size:
                raise self._fail(f"array {key!r} ends after {len(starts)} of {count} strings")
            if pos + 8 > loaded:
                self._load(pos + 8)
                loaded = len(buf)
            (length,) = unpack(buf, pos)
            pos += 8
            if pos + length > size:
                raise self._fail(f"string #{len(starts)} of array {key!r} runs past the end of the file")
            starts.append(pos)
            lengths.append(length)
            pos += length
        self._load(pos)  # the strings' bytes, decoded on access
        return StringArray(buf, starts, lengths), (_ARRAY, _STRING), pos
