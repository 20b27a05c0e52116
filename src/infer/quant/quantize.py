"""Float weights -> quantized weights at load time: Q4_0 blocks and int8 per channel.

`quantize_q4_0` follows the reference engine's load-time Q4_0 quantizer exactly, per block
of 32 values along a row: ``d = max|x| / 7`` (float32), ``id = 1/d`` (0 when d is 0),
``q = clamp(round(x * id), -8, 7)`` with round half away from zero, stored as ``q + 8``
in GGML's Q4_0 layout (fp16 ``d``, then 16 bytes: value ``z`` in the low nibble of byte
``z`` and value ``z + 16`` in its high nibble). The result is an ordinary Q4_0 tensor:
``gguf.quants.dequantize`` and `infer.quant.dequantize` read it as ``(q - 8) * fp16(d)``.
(llama.cpp's own Q4_0 quantizer differs: it uses the signed max and ``d = max / -8``.)
"""

from __future__ import annotations

import torch

Q4_0_BLOCK = 32


_CHUNK_ROWS = 4096  # rows quantized at a time


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero (Rust's ``f32::round``), exactly for all floats."""
    a = x.abs()
    f = torch.floor(a)
    return torch.sign(x) * (f + torch.floor(2 * (a - f)))


def quantize_q4_0(weight: torch.Tensor, *, name: str = "weight") -> torch.Tensor:
    """``weight [N, K]`` (K a multiple of 32) -> GGML Q4_0 bytes ``[N, K/32*18]`` uint8."""
    if weight.dim() != 2 or weight.shape[1] % Q4_0_BLOCK != 0:
        raise ValueError(
            f"{name}: Q4_0 needs a 2-D weight with columns a multiple of 32, got {list(weight.shape)}"
        )
    n, k = weight.shape
    if n > _CHUNK_ROWS:  # bound the float32 temporaries (a 262k-row embedding would need GBs)
        return torch.cat([quantize_q4_0(part, name=name) for part in torch.split(weight, _CHUNK_ROWS)])
    x = weight.detach().to(torch.float32).reshape(n, k // Q4_0_BLOCK, Q4_0_BLOCK)  # [N, blocks, 32]
    d = x.abs().amax(dim=-1, keepdim=True) / 7.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = round_half_away(x * inv).clamp(-8, 7).to(torch.int16) + 8  # 0..15
    qs = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)  # [N, blocks, 16]
    d16 = d.to(torch.float16).view(torch.uint8)  # [N, blocks, 2]
    return torch.cat([d16, qs], dim=-1).reshape(n, k // Q4_0_BLOCK * 18)


def quantize_int8_per_channel(
    weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> ``(q [N, K] int8, scale [N])`` with ``w ≈ q * scale``, symmetric per row.

    The scale is rounded to ``scale_dtype`` first (the dtype the kernel multiplies by),
    and the values are rounded against that rounded scale.
    """
    if weight.shape[0] > _CHUNK_ROWS:  # bound the float32 temporaries
        parts = [quantize_int8_per_channel(p, scale_dtype) for p in torch.split(weight, _CHUNK_ROWS)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / 127.0).to(scale_dtype)
    s = scale.to(torch.float32)
    inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
    q = round_half_away(w * inv[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


__all__ = ["Q4_0_BLOCK", "quantize_int8_per_channel", "quantize_q4_0", "round_half_away"]
