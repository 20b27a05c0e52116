"""Quantize float linear layers at load time: ``nn.Linear`` -> `QuantizedLinear`.

Schemes: ``"q4_0"`` (the reference's Q4_0 blocks, `infer.quant.quantize.quantize_q4_0`)
and ``"int8"`` (weight-only, per output channel). Embeddings and norms stay float. A
``lm_head`` tied to the embedding gets its own packed copy; the embedding keeps the float
parameter. A linear whose ``in_features`` is not a multiple of 32 stays float under
``"q4_0"`` (Q4_0 blocks are 32 values along a row).
"""

from __future__ import annotations

import torch
from torch import nn

from infer.quant.ggml import QType
from infer.quant.linear import QuantizedLinear
from infer.quant.quantize import Q4_0_BLOCK, quantize_q4_0

SCHEMES = ("q4_0", "int8")


def module_nbytes(module: nn.Module) -> int:
    """Bytes of all parameters and buffers of ``module``, each storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_meta:
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {SCHEMES}")


def quantize_linear(
    linear: nn.Linear, scheme: str, *, compute_dtype: torch.dtype = torch.bfloat16, head: bool = False
) -> nn.Module:
    """``linear`` as a `QuantizedLinear` under ``scheme`` ("q4_0" or "int8").

    Returns ``linear`` itself, unchanged and float, when ``scheme`` is "q4_0" and
    ``in_features`` is not a multiple of 32. The original weight is not modified
    (a weight tied to an embedding stays float there). ``head``: the output head, whose
    top logits a q4_0 module re-scores exactly (`QuantizedLinear.rescore`).
    """
    check_scheme(scheme)
    bias = linear.bias.detach() if linear.bias is not None else None
    weight = linear.weight.detach()
    if scheme == "int8":
        return QuantizedLinear.from_int8(weight, bias, compute_dtype=compute_dtype)
    if linear.in_features % Q4_0_BLOCK != 0:
        return linear
    raw = quantize_q4_0(weight)
    shape = (linear.out_features, linear.in_features)
    return QuantizedLinear.from_gguf(
        raw, QType.Q4_0, shape, bias, compute_dtype=compute_dtype, exact_rescoring=head
    )


__all__ = ["SCHEMES", "check_scheme", "module_nbytes", "quantize_linear"]
