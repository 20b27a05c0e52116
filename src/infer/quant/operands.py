"""What torch's packed CPU kernels (int4 and int8 weight products) assume of their operands alike."""

from __future__ import annotations

import torch

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # activations the kernels take
INT32_LIMIT = 2**31  # the kernels index with 32-bit ints


def plain_cpu_operands(
    x: torch.Tensor, weight: torch.Tensor, weight_dtype: torch.dtype, scales: torch.Tensor, scales_dim: int
) -> bool:
    """``x`` and ``weight`` 2-D, ``scales`` of ``scales_dim`` dimensions; all on CPU and contiguous;
    ``x`` in one of `KERNEL_DTYPES`, ``weight`` in ``weight_dtype``, ``scales`` in x's dtype."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and scales.dim() == scales_dim
        and x.is_cpu
        and weight.is_cpu
        and scales.is_cpu
        and x.is_contiguous()
        and weight.is_contiguous()
        and scales.is_contiguous()
        and x.dtype in KERNEL_DTYPES
        and weight.dtype == weight_dtype
        and scales.dtype == x.dtype
    )
