"""Streaming a GGUF file: packed layers stream in the form the packed modules hold.

At load, the GGUF loader (`infer.gguf.loader.GGUFModelLoader`) places one layer at a
time exactly as it does for a resident model (validation, llama.cpp's changes undone,
quantized matrices converted to `infer.quant.QuantizedLinear` storage); the layer's
tensors are written to a local file and the layer goes back to the meta device. The
skeleton thus holds the packed modules, their buffers are what `layer_tensors` lists,
and each token streams packed bytes (a Q4 layer moves about a quarter of its bf16
bytes), dequantized on the device by the modules themselves. The conversion is paid
once, not per token; the local file (about the size of the GGUF) is removed when the
source goes away.

The embedding, ``lm_head`` and final norm stay resident (placed by the loader, packed
when the file stores them packed); `nonlayer_bytes` tells the memory plan their size.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from infer.loader.build import build_empty
from infer.loader.config import ModelConfig
from infer.models.base import DecoderLM
from infer.streaming.files import SafetensorsFile
from infer.streaming.source import TensorRef

NONLAYER = ("embed_tokens", "lm_head", "norm")


def _module_bytes(modules: list[nn.Module]) -> int:
    """Bytes of the tensors of ``modules``, counting shared storage once."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for t in module.state_dict(keep_vars=True).values():
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


class ConvertedSource:
    """A `WeightSource` whose layers are converted once at load and streamed from a local file.

    Subclasses fill one layer (`fill_layer`) or the embedding / head / final norm
    (`fill_nonlayer`) of the meta skeleton in their final, possibly packed, form.
    """

    config: ModelConfig
    description: str

    def __init__(self, cache_dir: str | Path | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="infer-stream-", dir=cache_dir))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self._refs: list[dict[str, TensorRef]] = []
        self._files: list[SafetensorsFile] = []
        self.nonlayer_bytes = 0
        self.workspace_extra = 32 * 2**20  # packed modules dequantize tile by tile (prefill, non-CPU devices)
        self.model: DecoderLM | None = None

    def fill_layer(self, model: DecoderLM, index: int) -> None:
        raise NotImplementedError

    def fill_nonlayer(self, model: DecoderLM) -> None:
        raise NotImplementedError

    def build_skeleton(self, model_cls: Callable[[ModelConfig], nn.Module]) -> DecoderLM:
        model = build_empty(self.config, model_cls)
        if not isinstance(model, DecoderLM):
            raise TypeError(f"{model_cls!r} does not build a DecoderLM (got {type(model).__name__})")
        for i in range(len(model.layers)):
            self.fill_layer(model, i)
            layer = model.layers[i]  # the fill swapped packed modules in
            state = layer.state_dict()
            missing = [name for name, t in state.items() if t.is_meta]
            if missing:
                raise ValueError(f"{self.description}: missing tensor(s) for layer {i}: {missing}")
            file = self.dir / f"layer-{i:05d}.safetensors"
            save_file({k: v.contiguous() for k, v in state.items()}, str(file))
            self._files.append(SafetensorsFile(file))
            self._refs.append({k: TensorRef(f"{i}:{k}", tuple(v.shape), v.dtype) for k, v in state.items()})
            layer.to("meta")
        self.fill_nonlayer(model)
        modules = [model.get_submodule(name) for name in NONLAYER]
        for name, module in zip(NONLAYER, modules, strict=True):
            meta = [k for k, t in module.state_dict(keep_vars=True).items() if t.is_meta]
            if meta:
                raise ValueError(f"{self.description}: missing tensor(s) for {name}: {meta}")
        self.nonlayer_bytes = _module_bytes(modules)
        self.model = model
        return model

    def place_nonlayer(self, model: DecoderLM, device: torch.device) -> None:
        """Move the embedding, ``lm_head`` and final norm (already loaded) to ``device``."""
        for name in NONLAYER:
            model.get_submodule(name).to(device)

    def layer_tensors(self, index: int) -> dict[str, TensorRef]:
        return self._refs[index]

    def tensor(self, name: str) -> TensorRef:
        raise KeyError(f"{self.description}: {name!r} is placed at load, not streamed")

    def read_into(self, ref: TensorRef, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        if rows is not None or out.dtype != ref.dtype or tuple(out.shape) != ref.shape:
            raise ValueError(
                f"{self.description}: cannot read {ref.key!r} into {out.dtype} {list(out.shape)}"
            )
        index, _, name = ref.key.partition(":")
        handle = self._files[int(index)]
        handle.pread(out, handle.offsets[name][0])

    def read_rows(self, ref: TensorRef, index: torch.Tensor) -> torch.Tensor:
        raise KeyError(f"{self.description}: the embedding of a converted model stays resident")

    def close(self) -> None:
        for handle in self._files:
            handle.close()
        self._files = []
        self._cleanup()


class GGUFSource(ConvertedSource):
    """A `WeightSource` over a GGUF file (see the module docstring)."""

    def __init__(
        self, path: str | Path, *, dtype: torch.dtype | None, cache_dir: str | Path | None = None
    ) -> None:
        from infer.gguf.config import config_from_gguf
        from infer.gguf.loader import DEFAULT_COMPUTE_DTYPE, GGUFModelLoader
        from infer.gguf.reader import GGUFFile

        super().__init__(cache_dir)
        self.path = Path(path)
        self.description = str(self.path)
        self.gguf = GGUFFile(self.path)
        self.config = config_from_gguf(self.gguf)
        run_dtype = dtype if dtype is not None else torch.float32  # as `load_gguf` decides
        compute_dtype = dtype if dtype is not None else DEFAULT_COMPUTE_DTYPE
        self.config.torch_dtype = str(run_dtype).removeprefix("torch.")
        self.loader = GGUFModelLoader(self.gguf, self.config, dtype=run_dtype, compute_dtype=compute_dtype)
        self._groups: dict[int, list[Any]] = {}
        self._others: list[Any] = []
        for group in self.loader.modules():  # one entry per module to fill: path + GGUF tensors
            parts = group.path.split(".")
            if parts[0] == "layers":
                self._groups.setdefault(int(parts[1]), []).append(group)
            else:
                self._others.append(group)

    def build_skeleton(self, model_cls: Callable[[ModelConfig], nn.Module]) -> DecoderLM:
        if "token_embd.weight" not in self.gguf.tensors:
            raise ValueError(f"{self.description}: missing required tensor 'token_embd.weight'")
        return super().build_skeleton(model_cls)

    def fill_layer(self, model: DecoderLM, index: int) -> None:
        for group in self._groups.get(index, []):
            self.loader.place(model, group)

    def fill_nonlayer(self, model: DecoderLM) -> None:
        for group in self._others:
            self.loader.place(model, group)
        if self.config.tie_word_embeddings and isinstance(model.embed_tokens, nn.Embedding):
            model.lm_head.weight = model.embed_tokens.weight  # a float embedding: one Parameter
