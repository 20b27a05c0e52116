"""GGML blocks -> 4-bit planes with a scale and a zero per group of 32: the int4 kernel's form.

A weight row of K values becomes P planes of K nibbles each (P = 1 for 4-bit types,
2 for 5- to 8-bit ones), and ``w = sum_p ((nib_p - 8) * scale_p + zero_p)`` per group of
32 values. The mapping is exact in real arithmetic (in float32 it can differ from the
reference by one rounding of ``zero``):

- Q4_0: nib = q, scale d, zero 0
- Q4_1: nib = q, scale d, zero m + 8d
- Q4_K: nib = q, scale d*sc, zero 8*d*sc - dmin*m
- Q5_0 / Q5_1 / Q5_K: the low 4 bits as above (zero shifted by -16d for Q5_0), and a
  second plane ``hi + 8`` with scale 16d (16*d*sc for Q5_K) and zero 0
- Q8_0: q = 16*hi + lo with lo = q & 15 and hi = q >> 4 (arithmetic): planes lo
  (scale d, zero 8d) and hi + 8 (scale 16d, zero 0)
- MXFP4: the doubled e2m1 value v in -12..12 as v + 12 = 16*hi + lo, scale 2^(e-128)

Types with groups of 16 (Q2_K, Q3_K, Q6_K) do not fit the kernel's group of 32 and are
not handled here (`to_planes` raises): the caller keeps them as dense float.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infer.quant.dequant import _bits32, _f16, _k_group_params, _k_low_nibbles, _nibbles, e8m0_to_float_half
from infer.quant.ggml import QType, block_size, type_size

GROUP = 32

# blocks [n, type_size] uint8 -> nibbles [n, P, block_size] uint8, scale and zero [n, P, block_size/32] f32
PlaneDecoder = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _one_plane(nib: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """nib ``[n, bs]``, scale/zero ``[n, bs/32]`` -> with a plane axis of size 1."""
    return nib[:, None], scale[:, None], zero[:, None]


def _two_planes(
    u: torch.Tensor, scale: torch.Tensor, zero_lo: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values ``u = 16*hi + lo`` (``hi`` in -8..7) with per-group ``scale``: planes lo and hi + 8."""
    lo = u & 0x0F
    hi = (u >> 4) + 8
    nib = torch.stack([lo, hi], dim=1).to(torch.uint8)  # [n, 2, bs]
    scales = torch.stack([scale, scale * 16], dim=1)
    zeros = torch.stack([zero_lo, torch.zeros_like(zero_lo)], dim=1)
    return nib, scales, zeros


def _q4_0(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d = _f16(b[:, :2])
    return _one_plane(_nibbles(b[:, 2:]), d, torch.zeros_like(d))


def _q4_1(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return _one_plane(_nibbles(b[:, 4:]), d, m + 8 * d)


def _q4_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    n = b.shape[0]
    scale, offset = _k_group_params(b)  # [n, 8, 1]
    nib = _k_low_nibbles(b[:, 16:]).reshape(n, 256)
    return _one_plane(nib, scale[..., 0], (8 * scale - offset)[..., 0])


def _q5_0(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d = _f16(b[:, :2])
    q = (_nibbles(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4)).to(torch.int16)  # 0..31
    return _two_planes(q, d, -8 * d)  # (lo - 8) d - 8d + 16 d hi = d (q - 16)


def _q5_1(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = (_nibbles(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4)).to(torch.int16)
    return _two_planes(q, d, m + 8 * d)


def _q5_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    n = b.shape[0]
    scale, offset = _k_group_params(b)  # [n, 8, 1]
    bit = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 1, 8, 1)
    qh = (b[:, 16:48].reshape(n, 1, 1, 32) >> bit).reshape(n, 8, 32) & 1
    q = (_k_low_nibbles(b[:, 48:]) | (qh << 4)).to(torch.int16).reshape(n, 256)
    return _two_planes(q, scale[..., 0], (8 * scale - offset)[..., 0])


def _q8_0(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d = _f16(b[:, :2])
    q = b[:, 2:].contiguous().view(torch.int8).to(torch.int16)  # -128..127 = 16*hi + lo
    return _two_planes(q, d, 8 * d)


def _mxfp4(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d = e8m0_to_float_half(b[:, :1])
    values = torch.tensor(_MXFP4_VALUES, dtype=torch.int16, device=b.device)
    u = values[_nibbles(b[:, 1:]).to(torch.int64)] + 12  # 0..24
    return _two_planes(u, d, -4 * d)  # (lo - 8) d - 4d + 16 d hi = d (u - 12)


PLANE_DECODERS: dict[QType, PlaneDecoder] = {
    QType.Q4_0: _q4_0,  # type: ignore[dict-item]
    QType.Q4_1: _q4_1,  # type: ignore[dict-item]
    QType.Q4_K: _q4_k,  # type: ignore[dict-item]
    QType.Q5_0: _q5_0,  # type: ignore[dict-item]
    QType.Q5_1: _q5_1,  # type: ignore[dict-item]
    QType.Q5_K: _q5_k,  # type: ignore[dict-item]
    QType.Q8_0: _q8_0,  # type: ignore[dict-item]
    QType.MXFP4: _mxfp4,  # type: ignore[dict-item]
}


def num_planes(qtype: QType) -> int:
    """Nibble planes per value for a type `to_planes` handles (1 or 2)."""
    return 1 if qtype in (QType.Q4_0, QType.Q4_1, QType.Q4_K) else 2


def to_planes(rows: torch.Tensor, qtype: QType, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows [R, row_bytes]`` of GGML blocks -> nibbles ``[R, P*cols]``, scale and zero ``[R, P*cols/32]``.

    Plane ``p`` occupies columns ``p*cols .. (p+1)*cols``, so ``x @ W.T`` is
    ``cat([x] * P) @ W_planes.T``.
    """
    decode = PLANE_DECODERS.get(qtype)
    if decode is None:
        raise ValueError(f"GGML type {qtype.name} has no 4-bit plane form (groups of 16); keep it dense")
    r = rows.shape[0]
    bs, ts = block_size(qtype), type_size(qtype)
    nb = cols // bs
    nib, scale, zero = decode(rows.reshape(r * nb, ts))  # [r*nb, P, bs], [r*nb, P, bs/32]
    p = nib.shape[1]
    # [r, nb, P, bs] -> [r, P, nb, bs]: planes first along a row
    nib = nib.reshape(r, nb, p, bs).transpose(1, 2).reshape(r, p * cols)
    scale = scale.reshape(r, nb, p, bs // GROUP).transpose(1, 2).reshape(r, p * cols // GROUP)
    zero = zero.reshape(r, nb, p, bs // GROUP).transpose(1, 2).reshape(r, p * cols // GROUP)
    return nib, scale, zero


__all__ = ["GROUP", "PLANE_DECODERS", "num_planes", "to_planes"]
