"""Streaming a safetensors checkpoint quantized at load (``quantize="q4_0"`` or ``"int8"``).

Like a GGUF file (`infer.streaming.gguf_source`), each layer is built once at load:
its tensors are read from the checkpoint, its linear layers quantized with
`infer.quant.quantize_linear`, the packed layer written to a local file and the layer
sent back to the meta device. Each token then streams packed bytes (a Q4_0 layer moves
about 0.28x its bf16 bytes) that the packed modules use on the device. The embedding
stays float and resident (a lookup), the final norm resident, the head quantized and
resident (a tied head gets its own packed copy).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from infer.loader.build import assign_parameter
from infer.loader.config import ModelConfig
from infer.loader.weight_map import map_checkpoint_names
from infer.loader.weights import SafetensorsCheckpoint
from infer.models.base import DecoderLM
from infer.streaming.gguf_source import ConvertedSource


class QuantizedSafetensorsSource(ConvertedSource):
    """A `WeightSource` over a safetensors checkpoint whose linear layers are quantized at load."""

    def __init__(
        self,
        path: str | Path,
        config: ModelConfig,
        dtype: torch.dtype | None,
        scheme: str,
        cache_dir: str | Path | None = None,
    ) -> None:
        from infer.quant.convert import SCHEMES

        if scheme not in SCHEMES:
            raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {SCHEMES}")
        super().__init__(cache_dir)
        self.ckpt = SafetensorsCheckpoint(path)
        self.description = str(self.ckpt.path)
        self.config = config
        self.dtype = dtype
        self.scheme = scheme
        names = map_checkpoint_names(config, self.ckpt.keys(), self.description)
        if not config.tie_word_embeddings and "lm_head.weight" not in names.values():
            raise ValueError(f"{self.description}: no 'lm_head.weight' and tie_word_embeddings is false")
        self._by_layer: dict[int, list[tuple[str, str]]] = {}
        self._others: list[tuple[str, str]] = []
        for ckpt_name, internal in names.items():
            parts = internal.split(".")
            if parts[0] == "layers":
                self._by_layer.setdefault(int(parts[1]), []).append((ckpt_name, internal))
            elif not (config.tie_word_embeddings and internal == "lm_head.weight"):
                self._others.append((ckpt_name, internal))

    def _assign(self, model: DecoderLM, ckpt_name: str, internal: str) -> None:
        tensor = self.ckpt.get(ckpt_name)
        expected = tuple(model.get_parameter(internal).shape)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{self.description}: tensor {ckpt_name!r} has shape {list(tensor.shape)}, "
                f"expected {list(expected)}"
            )
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        assign_parameter(model, internal, tensor)

    def fill_layer(self, model: DecoderLM, index: int) -> None:
        from infer.quant import quantize_linear

        for ckpt_name, internal in self._by_layer.get(index, []):
            self._assign(model, ckpt_name, internal)
        layer = model.layers[index]
        for name, module in list(layer.named_modules()):
            if isinstance(module, nn.Linear) and not any(p.is_meta for p in module.parameters()):
                parent_name, _, attr = name.rpartition(".")
                parent = layer.get_submodule(parent_name) if parent_name else layer
                setattr(parent, attr, quantize_linear(module, self.scheme))

    def fill_nonlayer(self, model: DecoderLM) -> None:
        from infer.quant import quantize_linear

        for ckpt_name, internal in self._others:
            self._assign(model, ckpt_name, internal)
        head: nn.Module = model.lm_head
        if self.config.tie_word_embeddings:
            tied = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False, device="meta")
            tied.weight = model.embed_tokens.weight
            head = tied
        if not isinstance(head, nn.Linear):
            raise TypeError(f"{self.description}: lm_head is {type(head).__name__}, expected nn.Linear")
        setattr(model, "lm_head", quantize_linear(head, self.scheme, head=True))  # noqa: B010 (nn.Module typing)

    def close(self) -> None:
        super().close()
        self.ckpt.close()
