"""GGML blocks -> float32, in torch (CPU or CUDA), bit-exact with ``gguf.quants.dequantize``.

Every block decoder takes ``blocks [n, type_size] uint8`` and returns ``[n, block_size]``
float32. The arithmetic follows the reference step by step (same operand order, all in
float32, no fused multiply-add), which is what makes the results identical bit for bit.
Layouts (llama.cpp's ``ggml-common.h``):

- Q8_0 ``d:f16, q[32]:i8``                       w = d * q
- Q4_0 ``d:f16, qs[16]``                          w = d * (q - 8); low nibbles are values 0..15
- Q4_1 ``d:f16, m:f16, qs[16]``                   w = d * q + m
- Q5_0 ``d:f16, qh:u32, qs[16]``                  w = d * (q - 16); bit i of qh is bit 4 of value i
- Q5_1 ``d:f16, m:f16, qh:u32, qs[16]``           w = d * q + m
- Q2_K ``scales[16], qs[64], d:f16, dmin:f16``    w = d * sc * q - dmin * m, 16 groups of 16
- Q3_K ``hmask[32], qs[64], scales[12], d:f16``   w = d * (sc - 32) * q, q in -4..3
- Q4_K ``d, dmin:f16, scales[12], qs[128]``       w = d * sc * q - dmin * m, 8 groups of 32 (6-bit sc, m)
- Q5_K ``d, dmin:f16, scales[12], qh[32], qs[128]``  as Q4_K with a fifth bit
- Q6_K ``ql[128], qh[64], scales[16]:i8, d:f16``  w = d * sc * (q - 32), 16 groups of 16
- MXFP4 ``e:u8 (E8M0), qs[16]``                   w = 2^(e-128) * e2m1_doubled[q]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from infer.quant.ggml import QType, block_size, check_supported, tensor_bytes, type_size

BlockDecoder = Callable[[torch.Tensor], torch.Tensor]

# Values per chunk when decoding a large tensor: bounds the temporaries (~8 MB each).
_CHUNK_VALUES = 1 << 21

_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled


def f16(b: torch.Tensor) -> torch.Tensor:
    """``[n, 2]`` bytes holding a little-endian fp16 -> ``[n, 1]`` float32."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _shifts(values: Sequence[int], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` packed bytes -> ``[n, 32]`` values: low nibbles first, then high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def bits32(qh: torch.Tensor) -> torch.Tensor:
    """``[n, 4]`` bytes of a little-endian u32 -> ``[n, 32]`` bits (bit i at index i)."""
    n = qh.shape[0]
    bits = (qh.reshape(n, 4, 1) >> _shifts(range(8), (1, 1, 8), qh.device)) & 1  # [n, 4, 8]
    return bits.reshape(n, 32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = f16(b[:, :2])
    x = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return x * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = f16(b[:, :2])
    q = (nibbles(b[:, 2:]).to(torch.int8) - 8).to(torch.float32)
    return d * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = f16(b[:, :2]), f16(b[:, 2:4])
    q = nibbles(b[:, 4:]).to(torch.float32)
    return (d * q) + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = f16(b[:, :2])
    q = nibbles(b[:, 6:]) | (bits32(b[:, 2:6]) << 4)
    return d * (q.to(torch.int8) - 16).to(torch.float32)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = f16(b[:, :2]), f16(b[:, 2:4])
    q = nibbles(b[:, 8:]) | (bits32(b[:, 4:8]) << 4)
    return (d * q.to(torch.float32)) + m


def q2_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q2_K blocks -> scale ``d*sc``, offset ``dmin*m`` (``[n, 16, 1]`` float32), q ``[n, 16, 16]`` int16."""
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = f16(b[:, 80:82]), f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = (qs.reshape(n, 2, 1, 32) >> _shifts((0, 2, 4, 6), (1, 1, 4, 1), b.device)) & 3  # [n, 2, 4, 32]
    return dl, ml, q.reshape(n, 16, 16).to(torch.int16)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    dl, ml, q = q2_k_parts(b)
    return (dl * q.to(torch.float32) - ml).reshape(b.shape[0], 256)


def q3_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K blocks -> scale ``d * (sc - 32)`` ``[n, 16, 1]`` float32, q in -4..3 ``[n, 16, 16]`` int16."""
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = f16(b[:, 108:110])
    # 16 six-bit scales: low 4 bits in bytes 0..7 (two per byte), high 2 bits in bytes 8..11.
    lo = (scales[:, :8].reshape(n, 1, 8) >> _shifts((0, 4), (1, 2, 1), b.device)).reshape(n, 16)
    hi = (scales[:, 8:].reshape(n, 1, 4) >> _shifts((0, 2, 4, 6), (1, 4, 1), b.device)).reshape(n, 16)
    sc = ((lo & 0x0F) | ((hi & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * sc.to(torch.float32)).reshape(n, 16, 1)
    ql = (qs.reshape(n, 2, 1, 32) >> _shifts((0, 2, 4, 6), (1, 1, 4, 1), b.device)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, 1, 1, 32) >> _shifts(range(8), (1, 1, 8, 1), b.device)).reshape(n, 16, 16) & 1
    qh = qh ^ 1  # the -4 offset applies where the mask bit is 0
    return dl, (ql.to(torch.int8) - (qh << 2).to(torch.int8)).to(torch.int16)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    dl, q = q3_k_parts(b)
    return (dl * q.to(torch.float32)).reshape(b.shape[0], 256)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins, ``[n, 8]`` each."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def k_group_params(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: per-group scale ``d * sc`` and offset ``dmin * m``, ``[n, 8, 1]`` float32."""
    n = b.shape[0]
    d, dmin = f16(b[:, :2]), f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    scale = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    offset = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    return scale, offset


def k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K ``qs[128]`` -> ``[n, 8, 32]``: each 32 bytes hold two groups (low, high nibbles)."""
    n = qs.shape[0]
    q = qs.reshape(n, 4, 1, 32) >> _shifts((0, 4), (1, 1, 2, 1), qs.device)  # [n, 4, 2, 32]
    return q.reshape(n, 8, 32) & 0x0F


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, offset = k_group_params(b)
    q = k_low_nibbles(b[:, 16:]).to(torch.float32)
    return (scale * q - offset).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, offset = k_group_params(b)
    qh = (b[:, 16:48].reshape(n, 1, 1, 32) >> _shifts(range(8), (1, 1, 8, 1), b.device)).reshape(n, 8, 32) & 1
    q = (k_low_nibbles(b[:, 48:]) | (qh << 4)).to(torch.float32)
    return (scale * q - offset).reshape(n, 256)


def q6_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks -> scale ``d * sc`` ``[n, 16, 1]`` float32, ``q - 32`` in -32..31 ``[n, 16, 16]`` int16."""
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = (f16(b[:, 208:210]) * sc).reshape(n, 16, 1)
    lo = (ql.reshape(n, 2, 1, 64) >> _shifts((0, 4), (1, 1, 2, 1), b.device)).reshape(n, 8, 32) & 0x0F
    hi = (qh.reshape(n, 2, 1, 32) >> _shifts((0, 2, 4, 6), (1, 1, 4, 1), b.device)).reshape(n, 8, 32) & 0x03
    return d, ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.int16)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    d, q = q6_k_parts(b)
    return (d * q.to(torch.float32)).reshape(b.shape[0], 256)


def e8m0_to_float_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent byte -> float32 ``2^(e - 128)`` (half the scale: MXFP4 values are doubled)."""
    e32 = e.to(torch.int32)
    small = torch.bitwise_left_shift(torch.full_like(e32, 0x00200000), e32)  # subnormal 2^-128, 2^-127
    bits = torch.where(e32 < 2, small, (e32 - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    d = e8m0_to_float_half(b[:, :1])
    values = torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=b.device)
    q = nibbles(b[:, 1:]).to(torch.int64)
    return d * values[q]


BLOCK_DECODERS: dict[QType, BlockDecoder] = {
    QType.Q8_0: _q8_0,
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q5_0: _q5_0,
    QType.Q5_1: _q5_1,
    QType.Q2_K: _q2_k,
    QType.Q3_K: _q3_k,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
    QType.MXFP4: _mxfp4,
}


def _view_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    try:
        return raw.view(dtype)
    except RuntimeError:  # storage offset not aligned for the wider type
        return raw.clone().view(dtype)


def dequantize(
    raw: torch.Tensor, qtype: int | QType, shape: Sequence[int], *, name: str = "tensor"
) -> torch.Tensor:
    """Dequantize the bytes of one GGUF tensor to float32 of ``shape`` (torch order, rows first).

    ``raw`` is a ``uint8`` tensor (any shape, on any device) holding exactly the tensor's
    bytes. The result is on ``raw``'s device; for F32 it may share memory with ``raw``.
    Raises `UnsupportedQuantType` for types outside `SUPPORTED` and ``ValueError`` when
    the byte count does not match ``shape``; ``name`` is used in both messages.
    """
    qt = check_supported(qtype, name)
    # Sizes as given: a traced graph's row count stays symbolic (int() would fix it to the example's).
    shape = tuple(s if isinstance(s, torch.SymInt) else int(s) for s in shape)
    if raw.dtype != torch.uint8:
        raise TypeError(f"{name}: raw bytes must be a uint8 tensor, got {raw.dtype}")
    expected = tensor_bytes(qt, shape, name)
    flat = raw.reshape(-1)
    if flat.numel() != expected:
        raise ValueError(
            f"{name}: {qt.name} tensor of shape {list(shape)} needs {expected} bytes, got {flat.numel()}"
        )
    flat = flat.contiguous()
    if qt == QType.F32:
        return _view_as(flat, torch.float32).reshape(shape)
    if qt == QType.F16:
        return _view_as(flat, torch.float16).to(torch.float32).reshape(shape)
    if qt == QType.BF16:
        return _view_as(flat, torch.bfloat16).to(torch.float32).reshape(shape)
    decode = BLOCK_DECODERS[qt]
    bs, ts = block_size(qt), type_size(qt)
    blocks = flat.reshape(-1, ts)  # [n_blocks, type_size]
    n = blocks.shape[0]
    chunk = max(1, _CHUNK_VALUES // bs)
    if n <= chunk:
        return decode(blocks).reshape(shape)
    out = torch.empty(n, bs, dtype=torch.float32, device=raw.device)
    for start in range(0, n, chunk):
        out[start : start + chunk] = decode(blocks[start : start + chunk])
    return out.reshape(shape)


__all__ = ["BLOCK_DECODERS", "dequantize", "e8m0_to_float_half", "q2_k_parts", "q3_k_parts", "q6_k_parts"]
