"""What torch's int8 CPU kernel ``aten._weight_int8pack_mm`` assumes of its operands, checked
before every call (`int8_kernel_accepts`; the int4 kernel's check is `infer.quant.int4`)."""

from __future__ import annotations

import torch

from infer.quant.operands import INT32_LIMIT, plain_cpu_operands


def int8_kernel_accepts(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, *, pointers_checked: bool = False
) -> bool:
    """Whether ``aten._weight_int8pack_mm`` computes ``(x @ qweight.T) * scales`` correctly on CPU.

    What its vectorized kernel assumes and torch does not check: ``K % 16 == 0``, ``x`` 32-byte
    and ``qweight`` 16-byte aligned, dense rows, ``scales`` contiguous in x's dtype, ``M*K``,
    ``N*K``, ``M*N`` below 2^31 (why each: docs/quantization.md). ``pointers_checked``: the caller
    vouches for the alignment (inside a compiled graph, where pointers cannot be read).
    """
    if not plain_cpu_operands(x, qweight, torch.int8, scales, 1):
        return False
    m, k = x.shape
    n = qweight.shape[0]
    return (
        qweight.shape[1] == k
        and scales.shape[0] == n
        and k % 16 == 0
        and (pointers_checked or (x.data_ptr() % 32 == 0 and qweight.data_ptr() % 16 == 0))
        and max(m * k, n * k, m * n) < INT32_LIMIT
    )
