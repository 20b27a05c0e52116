"""Quantized weights that stay quantized: `dequantize` (GGUF bytes -> float32, bit-exact),
`QuantizedLinear`, `QuantizedEmbedding` and `quantize_linear` (at load). See docs/quantization.md.
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
