"""Build a `DecoderLM` from a GGUF file: packed weights stay packed, everything is checked.

The model skeleton is created on the meta device; then, module by module, each GGUF
tensor is validated (known name, supported type, expected shape), undone where
llama.cpp's converter changed it (`infer.gguf.names.Fix`) and placed:

* a quantized weight matrix becomes a packed linear module (`infer.quant.QuantizedLinear`)
  in place of the float one;
* a quantized embedding becomes a `QuantizedEmbedding` (rows dequantized on lookup); when
  tied, the head is packed once and the lookup reads the head's rows;
* float tensors (norms, biases, F16/F32 matrices) are converted to ``dtype``.

Each tensor's bytes are read from the file one at a time (not through the memory map),
so the file's pages do not pile up in the process while the model is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType
from torch import nn

from infer.gguf.config import architecture_of, config_from_gguf
from infer.gguf.names import UNSUPPORTED_TENSORS, Fix, fix_for, gguf_weight_map, unpermute_rows
from infer.gguf.packed import (
    FLOAT_TYPES,
    QuantizedEmbedding,
    dequantize,
    packed_embedding,
    packed_linear,
    row_bytes,
)
from infer.gguf.reader import GGUFFile, TensorInfo
from infer.gguf.tokenizer import gguf_tokenizer
from infer.loader.build import assign_parameter, build_empty
from infer.loader.config import ModelConfig
from infer.loader.tokenizer import Tokenizer
from infer.models import model_class
from infer.models.base import DecoderLM
from infer.models.gpt2 import Conv1D

ProgressFn = Callable[[int, int], None]

# Packed matrix products by default run in bfloat16: torch's CPU int4/int8 kernels take
# bfloat16 activations and are 10-30x slower with float32 (docs/gguf.md has the numbers).
DEFAULT_COMPUTE_DTYPE = torch.bfloat16

T = GGMLQuantizationType
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4,
)  # fmt: skip


@dataclass
class _Module:
    """The GGUF tensors that fill one of our modules (``weight`` and maybe ``bias``)."""

    path: str  # our module path, e.g. "layers.0.self_attn.q_proj"
    tensors: dict[str, TensorInfo]  # "weight" / "bias" -> GGUF tensor


class GGUFModelLoader:
    """Validates a GGUF file against the model its metadata describes and fills that model."""

    def __init__(
        self,
        gguf: GGUFFile,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.gguf = gguf
        self.config = config
        self.dtype = dtype  # activations, norms, biases, float matrices
        self.compute_dtype = compute_dtype if compute_dtype is not None else dtype  # packed matmuls
        self.arch = architecture_of(gguf)
        self.source = str(gguf.path)
        biases = config.attention_bias or config.mlp_bias
        self.weight_map = gguf_weight_map(self.arch, config.num_hidden_layers, biases=biases)
        self._check_names_and_types()

    # ---- validation -----------------------------------------------------------

    def _check_names_and_types(self) -> None:
        for name, reason in UNSUPPORTED_TENSORS.items():
            if name in self.gguf.tensors:
                raise ValueError(f"{self.source}: tensor {name!r}: {reason}")
        unknown = sorted(n for n in self.gguf.tensors if n not in self.weight_map)
        if unknown:
            raise ValueError(
                f"{self.source}: unknown tensor name(s) for architecture {self.arch!r}: {unknown[:10]}"
                + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
            )
        for info in self.gguf.tensors.values():
            if info.ggml_type not in SUPPORTED_TYPES:
                raise ValueError(
                    f"{self.source}: tensor {info.name!r} has unsupported quant type {info.type_name}; "
                    f"supported: {[t.name for t in SUPPORTED_TYPES]}"
                )

    def modules(self) -> list[_Module]:
        modules: dict[str, _Module] = {}
        for name, info in self.gguf.tensors.items():
            target = self.weight_map[name]
            path, _, kind = target.rpartition(".")
            modules.setdefault(path, _Module(path, {})).tensors[kind] = info
        return list(modules.values())

    def _expect(self, info: TensorInfo, target: str, expected: tuple[int, ...]) -> None:
        if info.shape != expected:
            raise ValueError(
                f"{self.source}: tensor {info.name!r} has shape {list(info.shape)}, expected "
                f"{list(expected)} (for {target!r} of {self.arch} with this metadata)"
            )

    # ---- tensors --------------------------------------------------------------

    def raw(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's stored bytes as ``uint8 [rows, row_bytes]`` (read from the file: our own copy)."""
        flat = torch.from_numpy(self.gguf.read(info.name))
        rows = info.numel // info.shape[-1]
        return flat.view(rows, row_bytes(info.ggml_type, info.shape[-1]))

    def _rows_fixed(self, info: TensorInfo, rows: torch.Tensor) -> torch.Tensor:
        """Undo the llama Q/K row permutation on anything indexed by output row."""
        fix = fix_for(self.arch, info.name)
        if fix is Fix.PERMUTE_Q:
            return rows[unpermute_rows(info.shape[0], self.config.num_attention_heads)]
        if fix is Fix.PERMUTE_K:
            return rows[unpermute_rows(info.shape[0], self.config.num_key_value_heads)]
        return rows

    def float_tensor(self, info: TensorInfo) -> torch.Tensor:
        """The tensor in float32 (dequantized if stored packed) with llama.cpp's changes undone."""
        if info.ggml_type in FLOAT_TYPES:
            values = self.raw(info).view(FLOAT_TYPES[info.ggml_type]).reshape(info.shape)
        else:
            values = dequantize(self.raw(info), info.ggml_type, info.shape)
        values = self._rows_fixed(info, values)
        fix = fix_for(self.arch, info.name)
        if fix is Fix.UNIT_OFFSET:
            values = values.float() - 1.0
        elif fix is Fix.TRANSPOSE:
            values = values.t()
        return values

    # ---- placement ------------------------------------------------------------

    def _set_module(self, model: nn.Module, path: str, module: nn.Module) -> None:
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, module)

    def _bias(self, group: _Module, module: nn.Module) -> torch.Tensor | None:
        info = group.tensors.get("bias")
        if info is None:
            return None
        expected = getattr(module, "bias", None)
        if not isinstance(expected, torch.Tensor):
            raise ValueError(f"{self.source}: unexpected tensor {info.name!r}: {group.path!r} has no bias")
        self._expect(info, f"{group.path}.bias", tuple(expected.shape))
        return self.float_tensor(info).to(self.dtype)

    def place(self, model: nn.Module, group: _Module) -> None:
        module = model.get_submodule(group.path)
        weight = group.tensors.get("weight")
        if weight is None:
            orphan = group.tensors["bias"]
            raise ValueError(f"{self.source}: tensor {orphan.name!r} has no matching weight tensor")
        packed = weight.ggml_type not in FLOAT_TYPES
        if isinstance(module, nn.Linear | Conv1D) and packed:
            shape = (module.out_features, module.in_features)
            self._expect(weight, f"{group.path}.weight", shape)
            raw = self._rows_fixed(weight, self.raw(weight))
            bias = self._bias(group, module)
            name = f"{self.source}: {weight.name}"
            linear = packed_linear(
                raw,
                weight.ggml_type,
                shape,
                bias,
                name=name,
                compute_dtype=self.compute_dtype,
                head=group.path == "lm_head",
            )
            self._set_module(model, group.path, linear)
            return
        if isinstance(module, nn.Embedding) and packed:
            shape = (module.num_embeddings, module.embedding_dim)
            self._expect(weight, f"{group.path}.weight", shape)
            name = f"{self.source}: {weight.name}"
            if group.path == "embed_tokens" and self.config.tie_word_embeddings:
                # One packed copy serves both: the head, and the lookup reading the head's rows.
                head = packed_linear(
                    self.raw(weight),
                    weight.ggml_type,
                    shape,
                    None,
                    name=name,
                    compute_dtype=self.compute_dtype,
                    head=True,
                )
                self._set_module(model, "lm_head", head)
                embedding = QuantizedEmbedding.from_linear(head, dtype=self.dtype)
            else:
                raw = self.raw(weight)
                embedding = packed_embedding(raw, weight.ggml_type, shape, name=name, dtype=self.dtype)
            self._set_module(model, group.path, embedding)
            return
        param = getattr(module, "weight", None)
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"{self.source}: tensor {weight.name!r} maps to {group.path!r}: no weight there")
        expected = tuple(param.shape)
        stored = expected[::-1] if isinstance(module, Conv1D) else expected  # Conv1D is [in, out]
        self._expect(weight, f"{group.path}.weight", stored)
        values = self.float_tensor(weight).to(self.dtype)
        assign_parameter(model, f"{group.path}.weight", values)
        bias_values = self._bias(group, module)
        if bias_values is not None:
            assign_parameter(model, f"{group.path}.bias", bias_values)

    def load(
        self, model_cls: Callable[[ModelConfig], nn.Module], progress: ProgressFn | None = None
    ) -> DecoderLM:
        model = build_empty(self.config, model_cls)
        if not isinstance(model, DecoderLM):
            raise TypeError(f"{model_cls} built a {type(model).__name__}, expected a DecoderLM")
        if "token_embd.weight" not in self.gguf.tensors:
            raise ValueError(f"{self.source}: missing required tensor 'token_embd.weight'")
        groups = self.modules()
        for done, group in enumerate(groups, 1):
            self.place(model, group)
            if progress is not None:
                progress(done, len(groups))
        if self.config.tie_word_embeddings and isinstance(model.embed_tokens, nn.Embedding):
            model.lm_head.weight = model.embed_tokens.weight  # float embedding: the very same Parameter
        missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if missing:
            by_target = {v: k for k, v in self.weight_map.items()}
            names = [by_target.get(n, n) for n in missing]
            raise ValueError(f"{self.source}: missing required tensor(s) {names[:10]} (for {missing[:10]})")
        return model.eval()


def load_gguf(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    progress: ProgressFn | None = None,
) -> tuple[ModelConfig, DecoderLM, Tokenizer]:
    """Load a GGUF file: its config, a ready `DecoderLM` (packed weights stay packed) and its tokenizer.

    Quantized weight matrices keep a packed format (`infer.quant.QuantizedLinear`);
    norms, biases and float matrices are converted to the activation dtype.

    ``dtype=None`` (default): float32 activations (residual stream, norms, attention,
    KV cache) with the packed matrix products in bfloat16, which is what torch's fast
    packed kernels take; as fast as all-bfloat16, with float32 everywhere else.
    ``dtype=torch.float32``: everything in float32 (the packed products too), which
    matches transformers' dequantized float32 model to rounding but decodes several
    times slower. Any other dtype: everything in that dtype.

    ``progress(done, total)`` is called per module. Errors name the file and the
    tensor or metadata key at fault.
    """
    gguf = GGUFFile(path)
    config = config_from_gguf(gguf)
    run_dtype = dtype if dtype is not None else torch.float32
    compute_dtype = dtype if dtype is not None else DEFAULT_COMPUTE_DTYPE
    config.torch_dtype = str(run_dtype).removeprefix("torch.")
    loader = GGUFModelLoader(gguf, config, dtype=run_dtype, compute_dtype=compute_dtype)
    model = loader.load(model_class(config), progress)
    model.to(device)
    tokenizer = gguf_tokenizer(gguf, config)
    return config, model, tokenizer


def inspect_rows(path: str | Path) -> tuple[ModelConfig, list[tuple[str, tuple[int, ...], str, int]]]:
    """The config and ``(name, shape, type, bytes)`` of every tensor, without loading anything."""
    gguf = GGUFFile(path)
    config = config_from_gguf(gguf)
    rows = [(t.name, t.shape, t.type_name, t.nbytes) for t in gguf.tensors.values()]
    return config, rows
