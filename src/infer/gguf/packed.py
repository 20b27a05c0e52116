"""The one place the GGUF loader meets `infer.quant`: packed linear layers and embeddings."""

from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType

from infer.quant import QuantizedEmbedding, QuantizedLinear, dequantize
from infer.quant.ggml import row_bytes

FLOAT_TYPES: dict[GGMLQuantizationType, torch.dtype] = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


def packed_linear(
    raw: torch.Tensor,
    qtype: GGMLQuantizationType,
    shape: tuple[int, int],
    bias: torch.Tensor | None,
    *,
    name: str,
    compute_dtype: torch.dtype,
    head: bool = False,
) -> QuantizedLinear:
    """A linear layer ``[out, in] = shape`` over the packed GGUF bytes ``raw`` (converted, not kept).

    ``head``: the output head, whose top logits are re-scored exactly (`QuantizedLinear.rescore`).
    """
    return QuantizedLinear.from_gguf(
        raw, qtype, shape, bias, name=name, compute_dtype=compute_dtype, exact_rescoring=head
    )


def packed_embedding(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int], *, name: str, dtype: torch.dtype
) -> QuantizedEmbedding:
    """An embedding table kept in its GGUF block format (rows dequantized on lookup)."""
    return QuantizedEmbedding.from_gguf(raw, qtype, shape, name=name, dtype=dtype)


__all__ = [
    "FLOAT_TYPES",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "dequantize",
    "packed_embedding",
    "packed_linear",
    "row_bytes",
]
