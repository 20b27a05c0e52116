"""An on-disk cache of GGUF matrices converted for the packed kernels (the "repack").

Converting GGML blocks into int4 planes and scales (`QuantizedLinear.from_gguf`) is most of a
load; a `RepackCache` keeps one GGUF file's converted matrices in one safetensors file under
``cache_root() / "repack"``, which a later process maps instead of converting. An entry is used
only when its key (the file's path, size, mtime and sampled fingerprint, the conversion's dtype and
device, the format, torch and layout versions) and every tensor's name, shape, dtype and checksum
match; anything else is a miss, converted and written again atomically. docs/gguf.md, *Repack
cache*, has the key, the eviction and the disk use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.host.filemap import MappedFile
from infer.quant import int4
from infer.quant.ggml import FLOAT_TYPES, QType
from infer.quant.linear import QuantizedLinear
from infer.quant.planes import GROUP, has_int4_form, is_paired, num_planes

FORMAT_VERSION = 4  # 4: packed bytes in module order; 3: word sums; 2: Q2_K/Q3_K/Q6_K paired; 1: dense
_ALIGN = 64  # every tensor's data starts on a 64-byte boundary of the file (the kernels' loads)
_SAMPLES = 16  # blocks of the tensor data hashed into the fingerprint
_SAMPLE_BYTES = 1 << 16
_PAD = "__pad__."  # filler tensors that keep the next tensor aligned (safetensors has no gaps)
DEFAULT_MAX_BYTES = 4 << 30  # the whole repack directory, oldest entries out first

_DTYPE_NAMES = {
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
}


@dataclass(frozen=True)
class Layout:
    """What `QuantizedLinear.from_gguf` builds: format, planes and tensor name -> (shape, dtype)."""

    fmt: str
    planes: int
    paired: bool
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]


def gguf_layout(qtype: QType, n: int, k: int, compute_dtype: torch.dtype, exact_rescoring: bool) -> Layout:
    """The layout `QuantizedLinear.from_gguf` gives a ``[n, k]`` matrix of ``qtype`` (kept in step)."""
    if qtype in FLOAT_TYPES or not has_int4_form(qtype):
        return Layout("dense", 1, False, {"weight": ((n, k), compute_dtype)})
    p = num_planes(qtype)
    n_pad = (n + int4.ROW_MULTIPLE - 1) // int4.ROW_MULTIPLE * int4.ROW_MULTIPLE
    kp = p * k
    exact = exact_rescoring and compute_dtype != torch.float32
    split = exact and qtype == QType.Q8_0
    width = k // 2 if split else kp // 2
    tensors = {
        "packed": ((n_pad, width), torch.uint8),
        "scale_zero": ((kp // GROUP, n_pad, 2), compute_dtype),
    }
    if exact:
        tensors["scale_zero_residual"] = ((kp // GROUP, n_pad, 2), torch.bfloat16)
    if split:
        tensors["packed_hi"] = ((n_pad, width), torch.uint8)
        tensors["scale_zero_fast"] = ((k // GROUP, n_pad, 2), compute_dtype)
    return Layout("int4", p, is_paired(qtype), tensors)


def _checksum(tensor: torch.Tensor) -> int:
    """The tensor's bytes summed as little-endian 64-bit words, mod 2^64 (the tail bytes as one more
    word). Any damage within one word changes it (every flipped bit or byte); truncation and bad
    headers are safetensors' errors. A word-wise sum in torch runs at the memory's speed (against
    CRC-32: docs/gguf.md), and addition mod 2^64 does not depend on the order torch sums in."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel() // 8 * 8
    total = int(flat[:n].view(torch.int64).sum()) if n else 0
    total += int.from_bytes(bytes(flat[n:].tolist()), "little")
    return total % (1 << 64)


def _fingerprint(path: Path, size: int, data_start: int) -> str:
    """sha256 of the bytes before the tensor data and of `_SAMPLES` blocks spread over the rest."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(data_start))
        span = max(0, size - data_start - _SAMPLE_BYTES)
        for i in range(_SAMPLES):
            f.seek(data_start + span * i // max(1, _SAMPLES - 1))
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


@dataclass
class _Entry:
    qtype: QType
    shape: tuple[int, int]
    exact: bool
    module: QuantizedLinear


class RepackCache:
    """The converted matrices of GGUF file ``path`` for one ``compute_dtype`` and ``device``.

    `linear` returns a matrix's `QuantizedLinear`, from the cache or converted; `save`,
    called once every matrix is loaded, writes the file if anything was converted.
    ``data_start``: the offset of the file's tensor data (the header is hashed whole).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        data_start: int,
        compute_dtype: torch.dtype,
        device: torch.device | str = "cpu",
        root: Path | None = None,
    ) -> None:
        from infer.gguf.tokenizer import cache_root

        gguf = Path(path).resolve()
        stat = gguf.stat()
        dtype_name = str(compute_dtype).removeprefix("torch.")
        device_name = str(torch.device(device))
        self.key = json.dumps(
            {
                "format": FORMAT_VERSION,
                "int4_block": int4.BLOCK_N,  # the packed bytes' layout differs by CPU (int4.py)
                "torch": torch.__version__,
                "path": str(gguf),
                "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns,
                "fingerprint": _fingerprint(gguf, stat.st_size, data_start),
                "compute_dtype": dtype_name,
                "device": device_name,
            },
            sort_keys=True,
        )
        name = hashlib.sha256(f"{gguf}\0{dtype_name}\0{device_name}".encode()).hexdigest()[:20]
        directory = root if root is not None else cache_root() / "repack"
        self.file = directory / f"{gguf.stem[:80]}-{name}.safetensors"
        self.compute_dtype = compute_dtype
        self.hits = 0
        self.misses = 0
        self._entries: dict[str, _Entry] = {}
        self._stored: dict[str, dict[str, object]] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._finite: set[str] = set()  # matrices whose float tensors are known finite
        self._changed = False  # something to write: a matrix converted, or newly checked
        self._open()

    # ---- reading ------------------------------------------------------------------

    def _open(self) -> None:
        """Map the cache file, if there is one whose key is ours; otherwise start empty.

        The file is mapped once, whole (`infer.host.filemap.MappedFile`, private: nothing is written
        back), so matrices written side by side are one run of memory that
        `QuantizedLinear.concat` fuses without a copy; but every tensor has a storage of its
        own, not a view of one storage for the whole file: a compiled block's weights must not
        share a storage (`infer.host.filemap`). The header is safetensors' (8-byte length, JSON); a
        header that does not parse, or an entry outside the file, is a miss.
        """
        if not self.file.is_file():
            return
        try:
            size = self.file.stat().st_size
            with self.file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > min(size - 8, 1 << 28):
                    return  # truncated, or not a header
                header = json.loads(f.read(length))
            meta = header.pop("__metadata__", None) or {}
            if meta.get("key") != self.key:
                return  # stale: another file, torch or format
            stored = json.loads(meta["linears"])
            mapped = MappedFile(self.file)
            data_start = 8 + length
            dtypes = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
            tensors = {}
            for name, info in header.items():
                if name.startswith(_PAD):
                    continue
                lo, hi = (int(x) for x in info["data_offsets"])
                dtype, shape = dtypes[info["dtype"]], [int(d) for d in info["shape"]]
                nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
                if not 0 <= lo <= hi <= mapped.size - data_start or hi - lo != nbytes:
                    return
                tensors[name] = mapped.tensor(data_start + lo, hi - lo).view(dtype).view(shape)
        except Exception:  # truncated or garbage header, bad JSON, an unknown dtype, OSError
            return
        if isinstance(stored, dict):
            self._stored, self._tensors = stored, tensors
            with contextlib.suppress(OSError):  # the modification time orders the entries for pruning
                os.utime(self.file)

    def _cached(
        self, name: str, qtype: QType, shape: tuple[int, int], bias: torch.Tensor | None, exact: bool
    ) -> QuantizedLinear | None:
        info = self._stored.get(name)
        if not isinstance(info, dict):
            return None
        n, k = shape
        if info.get("qtype") != qtype.name or info.get("shape") != [n, k] or info.get("exact") != exact:
            return None
        layout = gguf_layout(qtype, n, k, self.compute_dtype, exact)
        sums = info.get("sum")
        if not isinstance(sums, dict) or set(sums) != set(layout.tensors):
            return None
        tensors: dict[str, torch.Tensor] = {}
        for attr, (want_shape, want_dtype) in layout.tensors.items():
            t = self._tensors.get(f"{name}:{attr}")
            if t is None or tuple(t.shape) != want_shape or t.dtype != want_dtype:
                return None
            if _checksum(t) != sums[attr]:
                return None
            tensors[attr] = t
        if info.get("finite") is True:
            self._finite.add(name)
        return QuantizedLinear(
            k, n, layout.fmt, tensors, bias=bias, planes=layout.planes, paired=layout.paired,
            source=qtype.name, compute_dtype=self.compute_dtype,
        )  # fmt: skip

    def linear(
        self,
        name: str,
        read: Callable[[], torch.Tensor],
        qtype: QType,
        shape: tuple[int, int],
        bias: torch.Tensor | None,
        *,
        what: str,
        exact_rescoring: bool,
    ) -> QuantizedLinear:
        """GGUF tensor ``name`` as `QuantizedLinear.from_gguf` builds it from its bytes, bit for bit.

        ``read()`` returns the bytes; it is called only when the cache has no valid entry.
        """
        module = self._cached(name, qtype, shape, bias, exact_rescoring)
        if module is None:
            self.misses += 1
            self._changed = True
            module = QuantizedLinear.from_gguf(
                read(), qtype, shape, bias, name=what, compute_dtype=self.compute_dtype,
                exact_rescoring=exact_rescoring,
            )  # fmt: skip
        else:
            self.hits += 1
        self._entries[name] = _Entry(qtype, shape, exact_rescoring, module)
        return module

    def known_finite(self, name: str) -> bool:
        """Whether matrix ``name`` came from an entry a validating load checked for NaN / inf.

        Its bytes are those checked (their checksums matched), so checking them again is redundant.
        """
        return name in self._finite

    def mark_finite(self, name: str) -> None:
        """Matrix ``name``'s float tensors were checked: record it in the file."""
        if name not in self._finite:
            self._finite.add(name)
            self._changed = True

    # ---- writing ------------------------------------------------------------------

    def save(self, order: Sequence[object] = ()) -> None:
        """Write the file if a matrix was converted or newly checked (a read-only cache directory
        only costs speed). ``order``: the model's modules in order (``model.modules()``); the
        matrices' packed bytes are written in it, one after another, so sibling projections
        (q, k, v; gate, up) lie side by side in the file and fuse without a copy
        (`QuantizedLinear.concat`)."""
        if not self._changed or not self._entries:
            return
        with contextlib.suppress(OSError):
            self._write(order)

    def _write(self, order: Sequence[object]) -> None:
        # The modules' buffers, in order; the cache's own mapped tensors keep the old file alive.
        # Every matrix's packed bytes first, in the model's module order; then the rest.
        rank = {id(m): i for i, m in enumerate(order)}
        entries = sorted(self._entries.items(), key=lambda e: rank.get(id(e[1].module), len(rank)))
        items: list[tuple[str, torch.Tensor]] = []
        later: list[tuple[str, torch.Tensor]] = []
        linears: dict[str, dict[str, object]] = {}
        for name, entry in entries:
            n, k = entry.shape
            layout = gguf_layout(entry.qtype, n, k, self.compute_dtype, entry.exact)
            crcs: dict[str, int] = {}
            for attr in layout.tensors:
                t = entry.module.get_buffer(attr)
                crcs[attr] = _checksum(t.cpu())
                (items if attr == "packed" else later).append((f"{name}:{attr}", t))
            linears[name] = {
                "qtype": entry.qtype.name,
                "shape": [n, k],
                "exact": entry.exact,
                "sum": crcs,
                "finite": name in self._finite,
            }
        items += later
        header: dict[str, object] = {"__metadata__": {"key": self.key, "linears": json.dumps(linears)}}
        offset = 0
        chunks: list[torch.Tensor | int] = []  # the data: tensors, and zero bytes before the next one
        for i, (tname, t) in enumerate(items):
            pad = -offset % _ALIGN
            if pad:
                header[f"{_PAD}{i}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [offset, offset + pad]}
                offset += pad
                chunks.append(pad)
            nbytes = t.numel() * t.element_size()
            header[tname] = {
                "dtype": _DTYPE_NAMES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            chunks.append(t)
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % _ALIGN)  # the data starts aligned (padding is allowed)
        self.file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=self.file.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(struct.pack("<Q", len(text)))
                f.write(text)
                for chunk in chunks:
                    if isinstance(chunk, int):
                        f.write(b"\0" * chunk)
                        continue
                    flat = chunk.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                    f.write(flat.numpy().data)
            os.replace(tmp, self.file)  # atomic: readers see the old file or the new one
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _remove_orphans(self.file.parent)
        prune(self.file.parent, max_bytes(), keep=self.file)


def _stored_path(file: Path) -> str | None:
    """The GGUF path recorded in cache file ``file``'s key (None when unreadable)."""
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 1 << 26:
                return None
            header = json.loads(f.read(length))
        path = json.loads(header["__metadata__"]["key"])["path"]
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return path if isinstance(path, str) else None


def _remove_orphans(directory: Path) -> None:
    """Delete the entries of GGUF files that no longer exist (each entry is named by its path)."""
    for file in directory.glob("*.safetensors"):
        path = _stored_path(file)
        if path is not None and not os.path.exists(path):
            with contextlib.suppress(OSError):
                file.unlink()


def max_bytes() -> int:
    """The cap on the repack directory: ``INFER_REPACK_CACHE_MAX`` (e.g. ``2G``, ``500M``, bytes)."""
    text = os.environ.get("INFER_REPACK_CACHE_MAX", "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = units.get(text[-1].upper(), 1)
    digits = text[:-1] if text[-1].upper() in units else text
    try:
        value = float(digits) * scale
    except ValueError:
        raise ValueError(
            f"INFER_REPACK_CACHE_MAX={text!r}: expected a size in bytes, optionally with K, M, G or T"
        ) from None
    if value < 0:
        raise ValueError(f"INFER_REPACK_CACHE_MAX={text!r}: a size cannot be negative")
    return int(value)


def prune(directory: Path, cap: int, *, keep: Path | None = None) -> list[Path]:
    """Delete the least recently used entries of ``directory`` until the rest hold at most ``cap``
    bytes (``keep`` is never deleted); returns the deleted files."""
    entries = []
    for file in directory.glob("*.safetensors"):
        with contextlib.suppress(OSError):
            st = file.stat()
            entries.append((st.st_mtime_ns, st.st_size, file))
    total = sum(size for _, size, _ in entries)
    removed = []
    for _, size, file in sorted(entries, key=lambda e: e[0]):
        if total <= cap:
            break
        if keep is not None and file == keep:
            continue
        with contextlib.suppress(OSError):
            file.unlink()
            total -= size
            removed.append(file)
    return removed


__all__ = [
    "DEFAULT_MAX_BYTES",
    "FORMAT_VERSION",
    "Layout",
    "RepackCache",
    "gguf_layout",
    "max_bytes",
    "prune",
]
