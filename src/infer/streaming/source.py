"""Where streamed weights come from: the `WeightSource` interface and its safetensors implementation.

A source names every tensor the model needs (`TensorRef`: the key in the file, the
shape and dtype the model holds it in) and reads them, one at a time, *into* a tensor
the caller owns (a slot of a group buffer, a pinned staging buffer), converting the
dtype on the way. Nothing is ever loaded whole.

`SafetensorsSource` reads each tensor with ``pread`` straight into the destination
(`infer.streaming.files`), so a read costs no memory beyond a small conversion buffer.
A GGUF source implements the same interface: its skeleton holds quantized modules
whose packed buffers are what `layer_tensors` lists, so packed bytes stream and the
modules dequantize on the device.
"""

from __future__ import annotations

import os
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
from infer.streaming.files import SCRATCH_BYTES, ConvertingReader, SafetensorsFile

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
        self._files: dict[Path, SafetensorsFile] = {}
        self._converter = ConvertingReader()

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

    def _file(self, key: str) -> SafetensorsFile:
        path = self.checkpoint.tensors[key].file
        handle = self._files.get(path)
        if handle is None:
            handle = SafetensorsFile(path)
            self._files[path] = handle
        return handle

    def open_all(self) -> None:
        """Open every file now (so reader threads never race to open one)."""
        for key in self.checkpoint.tensors:
            self._file(key)

    @property
    def scratch_bytes(self) -> int:
        """Host memory a read may allocate: the conversion buffer, when some tensor changes dtype."""
        converts = any(
            self._ref(name).dtype != self.checkpoint.tensors[key].dtype for name, key in self._key_of.items()
        )
        return SCRATCH_BYTES if converts else 0

    def prefetch_hint(self, ref: TensorRef) -> None:
        """Start the kernel's readahead of ``ref`` (a unit hints all its tensors before reading them)."""
        handle = self._file(ref.key)
        begin, end = handle.offsets[ref.key]
        os.posix_fadvise(handle.fd, handle.data_start + begin, end - begin, os.POSIX_FADV_WILLNEED)

    def read_into(self, ref: TensorRef, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        info = self.checkpoint.tensors[ref.key]
        shape = info.shape if rows is None else (rows[1] - rows[0], *info.shape[1:])
        if tuple(out.shape) != tuple(shape) or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(
                f"{self.description}: tensor {ref.key!r}{'' if rows is None else f' rows {rows}'} has shape "
                f"{list(shape)}; the destination is {list(out.shape)} on {out.device}"
                f"{'' if out.is_contiguous() else ' (not contiguous)'}"
            )
        handle = self._file(ref.key)
        offset = handle.offsets[ref.key][0]
        if rows is not None:
            offset += rows[0] * (TensorRef(ref.key, info.shape, info.dtype).row_bytes())
        if out.dtype == info.dtype:
            handle.pread(out, offset)
        else:
            self._converter.read(handle, offset, info.dtype, out)

    def read_rows(self, ref: TensorRef, index: torch.Tensor) -> torch.Tensor:
        info = self.checkpoint.tensors[ref.key]
        table = self._file(ref.key).mapped(ref.key, info.dtype, info.shape)
        return table.index_select(0, index.to("cpu", torch.long)).to(ref.dtype)

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()
        self.checkpoint.close()
