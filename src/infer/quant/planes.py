"""GGML blocks -> 4-bit planes with a scale and a zero per group of 32: the int4 kernel's form.

A weight row of K values becomes P planes of K nibbles each (P = 1 for 4-bit types, 2 for 5- to
8-bit ones), ``w = sum_p ((nib_p - 8) * scale_p + zero_p)`` per group of 32, exact in real
arithmetic. Types with groups of 16 (Q2_K, Q3_K, Q6_K) take the **paired** form: a group of 32
holds one group of 16 as ``v + 8 = 16*h + l`` over a paired input (`pair_input`: ``[x_j, 16 *
x_j]``), so the kernel computes ``s * v + 17 * z``. Each type's mapping: the table in
docs/quantization.md, "How each type is held and computed".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infer.quant.dequant import (
    bits32,
    e8m0_to_float_half,
    f16,
    k_group_params,
    k_low_nibbles,
    nibbles,
    q2_k_parts,
    q3_k_parts,
    q6_k_parts,
)
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
    d = f16(b[:, :2])
    return _one_plane(nibbles(b[:, 2:]), d, torch.zeros_like(d))


def _q4_1(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d, m = f16(b[:, :2]), f16(b[:, 2:4])
    return _one_plane(nibbles(b[:, 4:]), d, m + 8 * d)


def _q4_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    n = b.shape[0]
    scale, offset = k_group_params(b)  # [n, 8, 1]
    nib = k_low_nibbles(b[:, 16:]).reshape(n, 256)
    return _one_plane(nib, scale[..., 0], (8 * scale - offset)[..., 0])


def _q5_0(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d = f16(b[:, :2])
    q = (nibbles(b[:, 6:]) | (bits32(b[:, 2:6]) << 4)).to(torch.int16)  # 0..31
    return _two_planes(q, d, -8 * d)  # (lo - 8) d - 8d + 16 d hi = d (q - 16)


def _q5_1(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d, m = f16(b[:, :2]), f16(b[:, 2:4])
    q = (nibbles(b[:, 8:]) | (bits32(b[:, 4:8]) << 4)).to(torch.int16)
    return _two_planes(q, d, m + 8 * d)


def _q5_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    n = b.shape[0]
    scale, offset = k_group_params(b)  # [n, 8, 1]
    bit = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 1, 8, 1)
    qh = (b[:, 16:48].reshape(n, 1, 1, 32) >> bit).reshape(n, 8, 32) & 1
    q = (k_low_nibbles(b[:, 48:]) | (qh << 4)).to(torch.int16).reshape(n, 256)
    return _two_planes(q, scale[..., 0], (8 * scale - offset)[..., 0])


def _q8_0(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d = f16(b[:, :2])
    q = b[:, 2:].contiguous().view(torch.int8).to(torch.int16)  # -128..127 = 16*hi + lo
    return _two_planes(q, d, 8 * d)


def _mxfp4(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d = e8m0_to_float_half(b[:, :1])
    values = torch.tensor(_MXFP4_VALUES, dtype=torch.int16, device=b.device)
    u = values[nibbles(b[:, 1:]).to(torch.int64)] + 12  # 0..24
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


def _paired(v: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Values ``v [n, G, 16]`` (int16, -136..119) of groups of 16 with ``scale`` (and an additive
    ``offset``) ``[n, G, 1]`` -> paired nibbles ``[n, G * 32]``, scale and zero ``[n, G]``."""
    n, g, _ = v.shape
    u = v + 8
    lo, hi = u & 0x0F, (u >> 4) + 8  # (lo - 8) + 16 (hi - 8) = u - 8 = v
    nib = torch.stack([lo, hi], dim=2).to(torch.uint8).reshape(n, g * 2 * 16)  # [n, G, 2, 16]
    zero = torch.zeros_like(scale) if offset is None else offset / 17  # the kernel adds 17 * zero
    return nib, scale.reshape(n, g), zero.reshape(n, g)


def _q2_k_paired(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    dl, ml, q = q2_k_parts(b)
    return _paired(q, dl, -ml)


def _q3_k_paired(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    dl, q = q3_k_parts(b)
    return _paired(q, dl, None)


def _q6_k_paired(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d, q = q6_k_parts(b)
    return _paired(q, d, None)


# blocks [n, type_size] uint8 -> paired nibbles [n, 2 * block_size] uint8, scale, zero [n, block_size/16] f32
PAIRED_DECODERS: dict[QType, PlaneDecoder] = {
    QType.Q2_K: _q2_k_paired,  # type: ignore[dict-item]
    QType.Q3_K: _q3_k_paired,  # type: ignore[dict-item]
    QType.Q6_K: _q6_k_paired,  # type: ignore[dict-item]
}
PAIR = 16  # values per group of the paired types


def is_paired(qtype: QType) -> bool:
    """Whether ``qtype`` takes the paired form (groups of 16)."""
    return qtype in PAIRED_DECODERS


def has_int4_form(qtype: QType) -> bool:
    """Whether ``qtype`` is held as int4 nibbles (planes or paired), not as a dense copy."""
    return qtype in PLANE_DECODERS or qtype in PAIRED_DECODERS


def pair_input(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` -> ``[M, 2K]``: each 16 values ``x_j`` followed by ``16 * x_j`` (paired form)."""
    m, k = x.shape
    x3 = x.reshape(m, k // PAIR, 1, PAIR)
    return torch.cat([x3, x3 * 16], dim=2).reshape(m, 2 * k)  # [M, K/16, 2, 16]


def compose_paired(nib: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The weights ``[R, K]`` float32 of paired nibbles ``[R, 2K]`` with ``scale``/``zero`` ``[R, K/16]``."""
    r, kp = nib.shape
    pairs = nib.view(r, kp // (2 * PAIR), 2, PAIR).to(torch.float32)
    c = pairs[:, :, 0] + 16 * pairs[:, :, 1]  # [R, K/16, 16]
    return ((c - 136) * scale[..., None] + 17 * zero[..., None]).reshape(r, kp // 2)


def num_planes(qtype: QType) -> int:
    """Nibble planes per value for a type `to_planes` handles (1 or 2)."""
    return 1 if qtype in (QType.Q4_0, QType.Q4_1, QType.Q4_K) else 2  # paired: 2 nibbles a value


def to_planes(rows: torch.Tensor, qtype: QType, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows [R, row_bytes]`` of GGML blocks -> nibbles ``[R, P*cols]``, scale and zero ``[R, P*cols/32]``.

    Plane ``p`` occupies columns ``p*cols .. (p+1)*cols``, so ``x @ W.T`` is
    ``cat([x] * P) @ W_planes.T``; a paired type's (P = 2) are ``pair_input(x) @ W_paired.T``.
    """
    r = rows.shape[0]
    bs, ts = block_size(qtype), type_size(qtype)
    nb = cols // bs
    if qtype in PAIRED_DECODERS:  # blocks side by side: the paired form is local to a group of 16
        nib, scale, zero = PAIRED_DECODERS[qtype](rows.reshape(r * nb, ts))
        return nib.reshape(r, 2 * cols), scale.reshape(r, -1), zero.reshape(r, -1)
    decode = PLANE_DECODERS.get(qtype)
    if decode is None:
        raise ValueError(f"GGML type {qtype.name} has no 4-bit form; keep it dense")
    nib, scale, zero = decode(rows.reshape(r * nb, ts))  # [r*nb, P, bs], [r*nb, P, bs/32]
    p = nib.shape[1]
    # [r, nb, P, bs] -> [r, P, nb, bs]: planes first along a row
    nib = nib.reshape(r, nb, p, bs).transpose(1, 2).reshape(r, p * cols)
    scale = scale.reshape(r, nb, p, bs // GROUP).transpose(1, 2).reshape(r, p * cols // GROUP)
    zero = zero.reshape(r, nb, p, bs // GROUP).transpose(1, 2).reshape(r, p * cols // GROUP)
    return nib, scale, zero


__all__ = [
    "GROUP",
    "PAIR",
    "PAIRED_DECODERS",
    "PLANE_DECODERS",
    "compose_paired",
    "has_int4_form",
    "is_paired",
    "num_planes",
    "pair_input",
    "to_planes",
]
