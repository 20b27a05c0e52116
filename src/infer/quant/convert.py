"""Quantize a float model at load time: swap its ``nn.Linear`` modules for `QuantizedLinear`.

Schemes: ``"q4_0"`` (the reference's Q4_0 blocks, `infer.quant.quantize.quantize_q4_0`)
and ``"int8"`` (weight-only, per output channel). Embeddings and norms stay float. A
``lm_head`` tied to the embedding gets its own packed copy; the embedding keeps the float
parameter. A linear whose ``in_features`` is not a multiple of 32 stays float under
``"q4_0"`` (Q4_0 blocks are 32 values along a row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from infer.quant.ggml import QType
from infer.quant.linear import QuantizedLinear
from infer.quant.quantize import Q4_0_BLOCK, quantize_q4_0

SCHEMES = ("q4_0", "int8")


@dataclass
class QuantizationReport:
    """What `quantize_model_` did; byte counts cover every parameter and buffer, counted once."""

    scheme: str
    bytes_before: int
    bytes_after: int
    quantized: list[str] = field(default_factory=list)
    kept_float: dict[str, str] = field(default_factory=dict)  # module name -> reason

    @property
    def saved_bytes(self) -> int:
        return self.bytes_before - self.bytes_after

    def __str__(self) -> str:
        mib = 1024 * 1024
        return (
            f"{self.scheme}: {len(self.quantized)} linear(s) quantized, {len(self.kept_float)} kept float; "
            f"{self.bytes_before / mib:.2f} MiB -> {self.bytes_after / mib:.2f} MiB "
            f"({self.bytes_after / max(self.bytes_before, 1):.1%})"
        )


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


def _check_scheme(scheme: str) -> None:
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
    _check_scheme(scheme)
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


def quantize_model_(
    model: nn.Module, scheme: str, *, compute_dtype: torch.dtype = torch.bfloat16
) -> QuantizationReport:
    """Replace every ``nn.Linear`` in ``model`` (blocks and ``lm_head``) in place; return a report.

    ``nn.Embedding`` and norm modules are left alone.
    """
    _check_scheme(scheme)
    report = QuantizationReport(scheme, module_nbytes(model), 0)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        new = quantize_linear(linear, scheme, compute_dtype=compute_dtype)
        if new is linear:
            report.kept_float[name] = f"in_features {linear.in_features} is not a multiple of {Q4_0_BLOCK}"
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
        report.quantized.append(name)
    report.bytes_after = module_nbytes(model)
    return report


__all__ = ["SCHEMES", "QuantizationReport", "module_nbytes", "quantize_linear", "quantize_model_"]
