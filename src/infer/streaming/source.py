"""Where streamed weights come from: the `WeightSource` interface and its safetensors implementation.

A source names every tensor the model needs (`TensorRef`: the key in the file, the
shape and dtype the model holds it in) and reads them, one at a time, *into* a tensor
the caller owns (a slot of a group buffer, a pinned staging buffer), converting the
dtype on the way. Nothing is ever loaded whole.

`SafetensorsSource` memory-maps each file and copies straight from the mapping
(file-backed page cache) into the destination, so a read costs no anonymous memory.
A GGUF source implements the same interface: its skeleton holds quantized modules
whose packed buffers are what `layer_tensors` lists, so packed bytes stream and the
modules dequantize on the device.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from infer.loader.build import build_empty
from infer.loader.config import ModelConfig
from infer.loader.weight_map import get_weight_map
from infer.loader.weights import SafetensorsCheckpoint
from infer.models.base import DecoderLM

EMBED = "embed_tokens.weight"
HEAD = "lm_head.weight"
NORM = "norm.weight"


@dataclass(frozen=True)
class TensorRef:
    """One tensor of a source: ``key`` in the file, and the ``shape`` / ``dtype`` the model holds."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def row_bytes(self) -> int:
        """Bytes of one row (first dimension)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0


class WeightSource(Protocol):
    """What the streaming executor needs from a checkpoint.

    Internal names are the model's parameter names (``layers.3.mlp.up_proj.weight``);
    layer tensors are keyed by their name inside the layer (``mlp.up_proj.weight``).
    ``lm_head.weight`` of a tied model refers to the embedding's key.
    """

    description: str
    config: ModelConfig

    def build_skeleton(self, model_cls: Callable[[ModelConfig], nn.Module]) -> DecoderLM:
        """The model with its parameters on the meta device (quantized modules already swapped in)."""
        ...

    def layer_tensors(self, index: int) -> dict[str, TensorRef]:
        """Every tensor layer ``index`` needs, by name inside the layer."""
        ...

    def tensor(self, name: str) -> TensorRef:
        """A non-layer tensor: ``embed_tokens.weight``, ``norm.weight``, ``lm_head.weight``."""
        ...

    def read_into(self, ref: TensorRef, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Copy ``ref`` (or its rows ``[start, stop)``) into the CPU tensor ``out``, converting the dtype."""
        ...

    def read_rows(self, ref: TensorRef, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index [N]`` of ``ref``: a new CPU tensor ``[N, ...]`` in ``ref.dtype`` (embedding rows)."""
        ...

    def close(self) -> None: ...


def _safetensors_offsets(file: Path) -> tuple[int, dict[str, tuple[int, int]]]:
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


class _MappedFile:
    """A read-only memory map of one safetensors file, viewed as bytes."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.data_start, self.offsets = _safetensors_offsets(file)
        with open(file, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():  # the mapping is read-only and never written through
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    def view(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        begin, end = self.offsets[key]
        raw = self.bytes[self.data_start + begin : self.data_start + end]
        if (self.data_start + begin) % dtype.itemsize:
            raw = raw.clone()  # misaligned in the file: an aligned copy of this one tensor
        return raw.view(dtype).view(shape)

    def will_need(self, key: str) -> None:
        """Ask the kernel to read ahead the pages of ``key``."""
        begin, end = self.offsets[key]
        start = (self.data_start + begin) // mmap.PAGESIZE * mmap.PAGESIZE
        self.map.madvise(mmap.MADV_WILLNEED, start, self.data_start + end - start)

    def close(self) -> None:
        del self.bytes
        self.map.close()


class SafetensorsSource:
    """A safetensors checkpoint (single file or sharded), read through memory maps.

    ``dtype`` is the dtype the model computes in (floating tensors are converted to
    it on read); ``None`` keeps each tensor's stored dtype. Every tensor must map to a
    model parameter (and the reverse is checked when the skeleton is bound).
    """

    def __init__(self, path: str | Path, config: ModelConfig, dtype: torch.dtype | None) -> None:
        self.checkpoint = SafetensorsCheckpoint(path)
        self.description = str(self.checkpoint.path)
        self.config = config
        self.dtype = dtype
        weight_map = get_weight_map(config)
        unknown = sorted(k for k in self.checkpoint.tensors if k not in weight_map)
        if unknown:
            raise ValueError(
                f"{self.description}: unexpected tensor(s) for model_type {config.model_type!r}: {unknown}"
            )
        self._key_of = {internal: hf for hf, internal in weight_map.items() if hf in self.checkpoint}
        if HEAD not in self._key_of:
            if not config.tie_word_embeddings:
                raise ValueError(
                    f"{self.description}: no 'lm_head.weight' and tie_word_embeddings is false: "
                    "the output head is missing"
                )
            if EMBED in self._key_of:
                self._key_of[HEAD] = self._key_of[EMBED]  # tied: the head reads the embedding rows
        self._maps: dict[Path, _MappedFile] = {}

    def build_skeleton(self, model_cls: Callable[[ModelConfig], nn.Module]) -> DecoderLM:
        model = build_empty(self.config, model_cls)
        if not isinstance(model, DecoderLM):
            raise TypeError(f"{model_cls!r} does not build a DecoderLM (got {type(model).__name__})")
        return model

    def _ref(self, internal: str) -> TensorRef:
        key = self._key_of.get(internal)
        if key is None:
            raise ValueError(f"{self.description}: missing tensor for parameter {internal!r}")
        info = self.checkpoint.tensors[key]
        dtype = self.dtype if self.dtype is not None and info.dtype.is_floating_point else info.dtype
        return TensorRef(key, info.shape, dtype)

    def layer_tensors(self, index: int) -> dict[str, TensorRef]:
        prefix = f"layers.{index}."
        return {name[len(prefix) :]: self._ref(name) for name in self._key_of if name.startswith(prefix)}

    def tensor(self, name: str) -> TensorRef:
        return self._ref(name)

    def _mapped(self, key: str) -> _MappedFile:
        file = self.checkpoint.tensors[key].file
        mapped = self._maps.get(file)
        if mapped is None:
            mapped = _MappedFile(file)
            self._maps[file] = mapped
        return mapped

    def _stored(self, ref: TensorRef) -> torch.Tensor:
        info = self.checkpoint.tensors[ref.key]
        return self._mapped(ref.key).view(ref.key, info.dtype, info.shape)

    def open_all(self) -> None:
        """Map every file now (so reader threads never race to create a mapping)."""
        for key in self.checkpoint.tensors:
            self._mapped(key)

    def prefetch_hint(self, ref: TensorRef) -> None:
        self._mapped(ref.key).will_need(ref.key)

    def read_into(self, ref: TensorRef, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        src = self._stored(ref)
        if rows is not None:
            src = src[rows[0] : rows[1]]
        if tuple(out.shape) != tuple(src.shape):
            raise ValueError(
                f"{self.description}: tensor {ref.key!r}{'' if rows is None else f' rows {rows}'} has shape "
                f"{list(src.shape)}, destination expects {list(out.shape)}"
            )
        out.copy_(src)

    def read_rows(self, ref: TensorRef, index: torch.Tensor) -> torch.Tensor:
        rows = self._stored(ref).index_select(0, index.to("cpu", torch.long))
        return rows.to(ref.dtype)

    def close(self) -> None:
        for mapped in self._maps.values():
            mapped.close()
        self._maps.clear()
        self.checkpoint.close()
