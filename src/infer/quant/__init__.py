"""Quantized weights that stay quantized.

- `dequantize`: GGUF tensor bytes -> float32, in torch, bit-exact with ``gguf.quants``.
- `QuantizedLinear`: a drop-in ``nn.Linear`` over packed weights (from GGUF bytes or
  quantized at load), using torch's packed int4/int8 kernels for decode.
- `QuantizedEmbedding`: row lookups over GGUF bytes or over a tied `QuantizedLinear`.
- `quantize_linear`: ``quantize="q4_0" | "int8"`` at load time (`infer.assembly.place`).

See docs/quantization.md for the formats, kernels, memory and accuracy.
"""

from __future__ import annotations

from infer.quant.convert import SCHEMES, module_nbytes, quantize_linear
from infer.quant.dequant import dequantize
from infer.quant.embedding import QuantizedEmbedding
from infer.quant.ggml import SUPPORTED, QType, UnsupportedQuantType, check_supported, tensor_bytes
from infer.quant.linear import QuantizedLinear
from infer.quant.quantize import quantize_int8_per_channel, quantize_q4_0

__all__ = [
    "SCHEMES",
    "SUPPORTED",
    "QType",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "UnsupportedQuantType",
    "check_supported",
    "dequantize",
    "module_nbytes",
    "quantize_int8_per_channel",
    "quantize_linear",
    "quantize_q4_0",
    "tensor_bytes",
]
