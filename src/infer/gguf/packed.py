"""Packed GGUF weights as modules: linear layers and embedding tables that stay quantized.

`dequantize` and `packed_linear` are the only places that touch a dequantization
implementation, so switching implementations is a one-line change here.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

FLOAT_TYPES: dict[GGMLQuantizationType, torch.dtype] = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


def row_bytes(qtype: GGMLQuantizationType, n: int) -> int:
    """Bytes of one row of ``n`` values stored as ``qtype``."""
    block, size = GGML_QUANT_SIZES[qtype]
    return n // block * size


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """``raw`` (uint8, ``[..., row_bytes]`` or flat) as a float32 tensor of ``shape``."""
    from gguf.quants import dequantize as np_dequantize

    values = np_dequantize(raw.cpu().numpy().reshape(-1), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape).to(raw.device)


def packed_linear(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int], bias: torch.Tensor | None
) -> nn.Module:
    """A linear layer ``[out, in] = shape`` computing from the packed bytes ``raw``."""
    out_features, in_features = shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(dequantize(raw, qtype, shape), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


class QuantizedEmbedding(nn.Module):
    """An embedding table kept in its GGUF block format; only the rows looked up are dequantized.

    ``weight_raw [num_embeddings, row_bytes]`` (uint8) holds each row's blocks.
    """

    weight_raw: torch.Tensor

    def __init__(
        self, raw: torch.Tensor, qtype: GGMLQuantizationType, num_embeddings: int, embedding_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        super().__init__()
        expected = (num_embeddings, row_bytes(qtype, embedding_dim))
        raw = raw.reshape(expected)
        self.qtype = qtype
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.out_dtype = dtype
        self.register_buffer("weight_raw", raw)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.qtype in FLOAT_TYPES:
            rows = self.weight_raw.view(FLOAT_TYPES[self.qtype])
            return F.embedding(input_ids, rows).to(self.out_dtype)
        flat = input_ids.reshape(-1)
        packed = self.weight_raw.index_select(0, flat)  # [N, row_bytes]
        values = dequantize(packed, self.qtype, (flat.numel(), self.embedding_dim))
        return values.to(self.out_dtype).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}"
