"""Structured mutations of a GGUF file (`infer.testing.fuzzing`): a walker that finds where each
header field lies (`gguf_layout`), then bit flips, byte changes, truncation, integer fields set
to boundary values, NaN / infinite floats, duplicated or shifted tensor offsets, swapped types,
huge counts and inserted or deleted header bytes (`mutate_gguf`)."""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass, field

U32_VALUES = (0, 1, 2, 3, 7, 8, 9, 12, 13, 255, 2**15, 32769, 2**31 - 1, 2**31, 2**32 - 1)
U64_VALUES = (*U32_VALUES, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
FLOAT_VALUES = (math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e38, 1e-45, 3.4e38, 1e300)


@dataclass
class _Field:
    offset: int
    size: int  # bytes
    kind: str  # "count", "strlen", "vtype", "item_type", "arr_count", "int", "float", "ndims", "dim", ...


@dataclass
class GGUFLayout:
    """Where the fields of a (valid) GGUF header are: what the structured mutations aim at."""

    fields: list[_Field] = field(default_factory=list)
    header_end: int = 0
    data_start: int = 0
    tensors: list[tuple[int, int, int]] = field(
        default_factory=list
    )  # (offset field position, start, nbytes)


def gguf_layout(data: bytes) -> GGUFLayout:
    from infer.gguf.reader import GGUFFile  # noqa: F401  (same format; this walker keeps positions)

    out = GGUFLayout()
    pos = 4
    out.fields.append(_Field(pos, 4, "version"))
    pos += 4
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    out.fields += [_Field(pos, 8, "count"), _Field(pos + 8, 8, "count")]
    pos += 16
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(p: int) -> int:
        n: int = struct.unpack_from("<Q", data, p)[0]
        out.fields.append(_Field(p, 8, "strlen"))
        return p + 8 + n

    for _ in range(n_kv):
        pos = string(pos)
        (vtype,) = struct.unpack_from("<I", data, pos)
        out.fields.append(_Field(pos, 4, "vtype"))
        pos += 4
        if vtype == 8:
            pos = string(pos)
        elif vtype == 9:
            item, count = struct.unpack_from("<IQ", data, pos)
            out.fields += [_Field(pos, 4, "item_type"), _Field(pos + 4, 8, "arr_count")]
            pos += 12
            for _ in range(count):
                if item == 8:
                    pos = string(pos)
                else:
                    kind = "float" if item in (6, 12) else "int"
                    if count <= 16:
                        out.fields.append(_Field(pos, sizes[item], kind))
                    pos += sizes[item]
        else:
            out.fields.append(_Field(pos, sizes[vtype], "float" if vtype in (6, 12) else "int"))
            pos += sizes[vtype]
    alignment = 32
    offsets: list[tuple[int, int, int]] = []
    for _ in range(n_tensors):
        pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", data, pos)
        out.fields.append(_Field(pos, 4, "ndims"))
        pos += 4
        dims = struct.unpack_from(f"<{n_dims}Q", data, pos)
        out.fields += [_Field(pos + 8 * i, 8, "dim") for i in range(n_dims)]
        pos += 8 * n_dims
        (ggml_type,) = struct.unpack_from("<I", data, pos)
        out.fields.append(_Field(pos, 4, "ggml_type"))
        pos += 4
        (offset,) = struct.unpack_from("<Q", data, pos)
        out.fields.append(_Field(pos, 8, "offset"))
        offsets.append((pos, offset, _nbytes(dims, ggml_type)))
        pos += 8
    out.header_end = pos
    out.data_start = -(-pos // alignment) * alignment
    out.tensors = [(field_pos, out.data_start + off, n) for field_pos, off, n in offsets]
    return out


def _nbytes(dims: tuple[int, ...], ggml_type: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    n = 1
    for d in dims:
        n *= d
    return n // block * size


def _put(data: bytearray, f: _Field, value: int) -> None:
    data[f.offset : f.offset + f.size] = (value % 2 ** (8 * f.size)).to_bytes(f.size, "little")


def mutate_gguf(seed: bytes, layout: GGUFLayout, rng: random.Random) -> tuple[bytes, str]:
    """One structured mutation (or two or three) of a GGUF file; returns the bytes and what was done."""
    data = bytearray(seed)
    done: list[str] = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.choice(
            (
                "bitflip",
                "bytes",
                "truncate",
                "int",
                "int",
                "int",
                "float",
                "offsets",
                "type",
                "huge",
                "data",
                "shift",
            )
        )
        header = layout.header_end
        if op == "bitflip":
            span = header if rng.random() < 0.8 else len(data)
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(min(span, len(data)))
                data[i] ^= 1 << rng.randrange(8)
            done.append("bitflip")
        elif op == "bytes":
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(min(header, len(data)))] = rng.randrange(256)
            done.append("bytes")
        elif op == "truncate":
            cut = rng.randrange(header) if rng.random() < 0.7 else rng.randrange(len(data))
            del data[cut:]
            done.append(f"truncate@{cut}")
            break  # later field offsets are gone
        elif op in ("int", "huge", "type", "float", "offsets"):
            kinds = {
                "int": ("count", "strlen", "vtype", "item_type", "arr_count", "int", "ndims", "dim",
                        "ggml_type", "offset", "version"),
                "huge": ("count", "arr_count", "strlen", "dim"),
                "type": ("vtype", "item_type", "ggml_type"),
                "float": ("float",),
                "offsets": ("offset",),
            }[op]  # fmt: skip
            fields = [f for f in layout.fields if f.kind in kinds and f.offset + f.size <= len(data)]
            if not fields:
                continue
            f = rng.choice(fields)
            if op == "float":
                value = rng.choice(FLOAT_VALUES)
                if f.size == 4 and math.isfinite(value) and abs(value) > 3.4e38:
                    value = math.inf  # what a float32 field can hold
                fmt = "<f" if f.size == 4 else "<d"
                data[f.offset : f.offset + f.size] = struct.pack(fmt, value)
                done.append(f"float@{f.offset}={value}")
            elif op == "offsets":
                others = [t for t in layout.tensors if t[0] != f.offset]
                shift = rng.choice(("dup", "shift", "prev"))
                rel = struct.unpack_from("<Q", data, f.offset)[0]
                if shift == "dup" and others:
                    rel = rng.choice(others)[1] - layout.data_start
                elif shift == "shift":
                    rel = max(0, rel + rng.choice((-64, -32, 32, 64)))
                else:
                    rel = max(0, rel - rng.choice((1, 32, 4096)))
                _put(data, f, rel)
                done.append(f"offset@{f.offset}={shift}")
            elif op == "type":
                value = (
                    rng.choice((*range(0, 14), 16, 30, 39, 40, 255, 2**31))
                    if f.kind != "ggml_type"
                    else (
                        rng.choice(
                            (0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 23, 24, 28, 30, 39, 40, 99)
                        )
                    )
                )
                _put(data, f, value)
                done.append(f"{f.kind}@{f.offset}={value}")
            else:
                values = U64_VALUES if f.size == 8 else U32_VALUES
                value = (
                    rng.choice((*values, -1, -2))
                    if op == "int"
                    else rng.choice((2**40, 2**62, 2**63, 2**64 - 1))
                )
                if f.size < 4:
                    value = rng.choice((0, 1, -1, 2 ** (8 * f.size - 1)))
                _put(data, f, value)
                done.append(f"{op}:{f.kind}@{f.offset}={value}")
        elif op == "data":
            if not layout.tensors:
                continue
            _, start, n = rng.choice(layout.tensors)
            fill = rng.choice((b"\xff", b"\x00", b"\x7f", None))
            stop = min(len(data), start + n)
            if stop > start:
                data[start:stop] = fill * (stop - start) if fill is not None else rng.randbytes(stop - start)
            done.append(f"data@{start}={fill!r}")
        else:  # shift: insert or delete bytes inside the header
            i = rng.randrange(min(header, len(data)))
            if rng.random() < 0.5:
                data[i:i] = rng.randbytes(rng.choice((1, 4, 8)))
            else:
                del data[i : i + rng.choice((1, 4, 8))]
            done.append(f"shift@{i}")
            break
    return bytes(data), "+".join(done) or "none"
