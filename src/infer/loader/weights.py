"""Safetensors loading: single file or sharded with an index, validated.

Two ways in:

* `load_weights` returns the whole raw HF-named state dict (the original loader API, kept for compatibility);
* `SafetensorsSource` lists every tensor (name, shape, dtype, file) without reading
  data and reads tensors (or rows of them) one at a time with ``pread``: the
  `infer.loader.source.WeightSource` of a safetensors checkpoint, so the model
  builder and the layer-streaming executor never hold more than the piece they are
  working on.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from infer.loader.source import StoredTensor, pread_into, read_tensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        index = json.loads(index_path.read_bytes())
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested too deeply to parse
        raise ValueError(f"{index_path}: not valid JSON ({type(e).__name__}: {e})"[:1000]) from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: no 'weight_map' object")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not _is_file_name(shard):
            raise ValueError(
                f"{index_path}: weight_map[{name!r}] = {shard!r}: expected the name of a shard file "
                f"in {index_path.parent} (no directory part)"[:1000]
            )
    return dict(weight_map)


def _is_file_name(name: str) -> bool:
    """A plain file name: shards live beside the index, never elsewhere (no '/', '..', NUL)."""
    return bool(name) and "\x00" not in name and Path(name).name == name and name not in (".", "..")


def _shard_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint and, when sharded, the index's weight_map."""
    if path.is_file():
        return [path], None
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    index_path = path / INDEX_FILE
    if index_path.is_file():  # the index wins when both layouts exist
        weight_map = _read_index(index_path)
        files = []
        for shard in sorted(set(weight_map.values())):
            shard_path = path / shard
            if not shard_path.is_file():
                raise FileNotFoundError(f"shard {shard!r} listed in {index_path} is missing from {path}")
            files.append(shard_path)
        return files, weight_map
    single = path / SINGLE_FILE
    if single.is_file():
        return [single], None
    found = sorted(p.name for p in path.glob("*.safetensors"))
    if len(found) == 1:
        return [path / found[0]], None
    hint = f" (found {found} but no {INDEX_FILE})" if found else ""
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}{hint}")


def _validate_against_index(weight_map: dict[str, str], found: dict[str, Path], source: Path) -> None:
    missing = sorted(set(weight_map) - set(found))
    unexpected = sorted(set(found) - set(weight_map))
    if missing:
        raise ValueError(f"{source}: tensors listed in {INDEX_FILE} but not in any shard: {missing}")
    if unexpected:
        raise ValueError(f"{source}: tensors in shards but not listed in {INDEX_FILE}: {unexpected}")
    for name, file in found.items():
        if weight_map[name] != file.name:
            raise ValueError(
                f"{source}: tensor {name!r} is in shard {file.name!r} "
                f"but {INDEX_FILE} says {weight_map[name]!r}"
            )


class SafetensorsSource:
    """A safetensors checkpoint (single file or sharded) as a `WeightSource`.

    Every tensor (name, shape, dtype, file, byte range) is listed from the headers up
    front, checked by the safetensors library and against the shard index; reads use
    ``pread`` into the caller's tensor, so nothing stays mapped and a file that shrinks
    under us is an `OSError`.
    """

    naming = "hf"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        files, weight_map = _shard_files(self.path)
        self.files = files
        self.description = str(files[0] if len(files) == 1 else self.path / INDEX_FILE)
        self._tensors: dict[str, StoredTensor] = {}
        self._where: dict[str, tuple[Path, int]] = {}  # name -> (file, absolute byte offset)
        where: dict[str, Path] = {}
        for file in files:
            for info, offset in _read_header(file):
                if info.name in where:
                    raise ValueError(
                        f"tensor {info.name!r} is stored twice: in {where[info.name]} and {file}"
                    )
                where[info.name] = file
                self._tensors[info.name] = info
                self._where[info.name] = (file, offset)
        if weight_map is not None:
            _validate_against_index(weight_map, where, self.path)
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)

    def tensors(self) -> Mapping[str, StoredTensor]:
        return self._tensors

    def _fd(self, file: Path) -> int:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                fd = os.open(file, os.O_RDONLY)
                self._fds[file] = fd
            return fd

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        info = self._tensors.get(name)
        if info is None:
            raise KeyError(f"{self.description}: no tensor named {name!r}")
        file, offset = self._where[name]
        expected = tuple(info.buffer(rows).shape)
        if tuple(out.shape) != expected or out.dtype != info.dtype:
            raise ValueError(
                f"{file}: tensor {name!r}{'' if rows is None else f' rows {rows}'} is {info.dtype} "
                f"{list(expected)}; the destination is {out.dtype} {list(out.shape)}"
            )
        if rows is not None:
            offset += rows[0] * info.row_bytes
        pread_into(self._fd(file), out, offset, f"{file}: tensor {name!r}")

    def prefetch_hint(self, name: str) -> None:
        info = self._tensors[name]
        file, offset = self._where[name]
        os.posix_fadvise(self._fd(file), offset, info.nbytes, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        with self._lock:
            self._finalizer()

    # The original API's reading helpers----------------------------------------------

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` in a new (aligned) CPU tensor."""
        if name not in self._tensors:
            raise KeyError(f"{self.description}: no tensor named {name!r}")
        return read_tensor(self, name)


def _close_fds(fds: dict[Path, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _read_header(file: Path) -> list[tuple[StoredTensor, int]]:
    """Every tensor of one safetensors file with its absolute byte offset.

    The safetensors library validates the header (JSON, dtypes, shapes, byte ranges that
    tile the data section); we then read the offsets from the same header.
    """
    try:
        with safe_open(str(file), framework="pt") as f:
            names: list[str] = f.keys()  # the handle itself is not iterable
            kinds = {name: f.get_slice(name).get_dtype() for name in names}
        with open(file, "rb") as raw:
            (n,) = struct.unpack("<Q", raw.read(8))
            header = json.loads(raw.read(n))
    except (OSError, RuntimeError, SafetensorError, ValueError, struct.error) as e:  # bad header, truncated
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
    out: list[tuple[StoredTensor, int]] = []
    for name in names:
        dtype = _ST_DTYPES.get(kinds[name])
        if dtype is None:
            raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {kinds[name]}")
        entry = header[name]
        begin, end = (int(x) for x in entry["data_offsets"])
        info = StoredTensor(name, tuple(int(d) for d in entry["shape"]), dtype, end - begin)
        out.append((info, 8 + n + begin))
    return out


def realign(tensor: torch.Tensor, alignment: int = 64) -> torch.Tensor:
    """``tensor``, copied if its data is not ``alignment``-byte aligned.

    Tensors read from a safetensors file start wherever the header put them, and CPU matmul
    kernels are far slower on a misaligned weight (docs/performance.md), so weights are
    realigned once at load.
    """
    if tensor.device.type == "cpu" and tensor.data_ptr() % alignment:
        return tensor.clone()
    return tensor


def load_weights(
    model_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Load every tensor of a checkpoint into a flat HF-named dict.

    ``model_path`` is a directory holding ``model.safetensors`` or
    ``model.safetensors.index.json`` + shards (the index wins when both exist), or a
    ``.safetensors`` file. Sharded checkpoints are validated against the index:
    a tensor listed but absent, or present but unlisted, is a `ValueError`; a shard
    named in the index but missing is a `FileNotFoundError` naming it. ``dtype``
    converts floating-point tensors after loading.
    """
    path = Path(model_path)
    files, weight_map = _shard_files(path)
    device_str = str(device)
    state: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for file in files:
        try:
            shard = load_file(str(file), device=device_str)
        except SafetensorError as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
        for name, tensor in shard.items():
            if name in state:
                raise ValueError(f"tensor {name!r} is stored twice: in {where[name]} and {file}")
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            state[name] = realign(tensor)
            where[name] = file
    if weight_map is not None:
        _validate_against_index(weight_map, where, path)
    return state
