"""GGML tensor types: ids, values per block, bytes per block, and byte-size checks.

The ids and block geometry come from the ``gguf`` package (``GGML_QUANT_SIZES``), so
they match the files llama.cpp writes. `SUPPORTED` lists the types `infer` can
dequantize; anything else is refused with an error that names the type.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

if TYPE_CHECKING:
    import torch

QType = GGMLQuantizationType

FLOAT_TYPES: frozenset[QType] = frozenset({QType.F32, QType.F16, QType.BF16})

SUPPORTED: frozenset[QType] = FLOAT_TYPES | frozenset(
    {
        QType.Q8_0,
        QType.Q4_0,
        QType.Q4_1,
        QType.Q5_0,
        QType.Q5_1,
        QType.Q2_K,
        QType.Q3_K,
        QType.Q4_K,
        QType.Q5_K,
        QType.Q6_K,
        QType.MXFP4,
    }
)


class UnsupportedQuantType(ValueError):
    """A GGML tensor type `infer` cannot dequantize."""


# Byte offsets of the fp16 fields in each block of the types whose every value is those fields
# times and plus integers of at most a few bits (`scale_fields_finite`).
FP16_FIELDS: dict[QType, tuple[int, ...]] = {
    QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2),
    QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,),
}  # fmt: skip


def scale_fields_finite(rows: torch.Tensor, qtype: QType) -> bool | None:
    """Whether every value of GGML blocks ``rows [R, row_bytes]`` (uint8) is finite, read off their
    fp16 fields alone (no dequantizing); None for the types it cannot tell (floats, MXFP4).

    Exact: a value is such a field times small integers (no float32 overflow), so all values are
    finite when the fields are, and a NaN or inf field makes the values that use it NaN or inf.
    """
    import torch

    fields = FP16_FIELDS.get(qtype)
    if fields is None:
        return None
    blocks = rows.reshape(-1, type_size(qtype))
    for off in fields:
        half = blocks[:, off : off + 2].contiguous().view(torch.float16)  # [blocks, 1]
        if not bool(torch.isfinite(half).all()):
            return False
    return True


def as_qtype(qtype: int | QType, what: str = "tensor") -> QType:
    """``qtype`` as a `GGMLQuantizationType`; unknown ids raise, naming ``what``."""
    try:
        return QType(int(qtype))
    except ValueError:
        raise UnsupportedQuantType(f"{what}: unknown GGML type id {int(qtype)}") from None


def check_supported(qtype: int | QType, what: str = "tensor") -> QType:
    """``qtype`` as a `QType`, or an error naming the type and the supported ones."""
    qt = as_qtype(qtype, what)
    if qt not in SUPPORTED:
        names = ", ".join(sorted(t.name for t in SUPPORTED))
        raise UnsupportedQuantType(
            f"{what}: GGML type {qt.name} (id {int(qt)}) is not supported; supported: {names}"
        )
    return qt


def block_size(qtype: int | QType) -> int:
    """Values per block (1 for float types, 32 or 256 for quantized ones)."""
    return int(GGML_QUANT_SIZES[as_qtype(qtype)][0])


def type_size(qtype: int | QType) -> int:
    """Bytes per block."""
    return int(GGML_QUANT_SIZES[as_qtype(qtype)][1])


def row_bytes(qtype: int | QType, cols: int, what: str = "tensor") -> int:
    """Bytes of one row of ``cols`` values; ``cols`` must be a whole number of blocks."""
    qt = as_qtype(qtype, what)
    bs, ts = GGML_QUANT_SIZES[qt]
    if cols % bs != 0:
        raise ValueError(f"{what}: row length {cols} is not a multiple of the {qt.name} block size {bs}")
    return cols // bs * ts


def as_rows(raw: torch.Tensor, qtype: QType, rows: int, cols: int, what: str = "tensor") -> torch.Tensor:
    """``raw`` (the bytes of a ``[rows, cols]`` tensor of ``qtype``) as ``[rows, row_bytes]``.

    A ValueError naming ``what`` when the byte count is not that shape's.
    """
    expected = rows * row_bytes(qtype, cols, what)
    if raw.numel() != expected:
        raise ValueError(
            f"{what}: {qtype.name} tensor of shape {[rows, cols]} needs {expected} bytes, got {raw.numel()}"
        )
    return raw.reshape(rows, -1)


def tensor_bytes(qtype: int | QType, shape: Sequence[int], what: str = "tensor") -> int:
    """Bytes of a tensor of ``shape`` (torch order: the last dim is the contiguous one)."""
    if len(shape) == 0:
        return row_bytes(qtype, 1, what)
    return math.prod(shape[:-1]) * row_bytes(qtype, int(shape[-1]), what)
