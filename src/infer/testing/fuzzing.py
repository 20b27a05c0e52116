"""Mutated checkpoints for robustness tests: seed files, structured mutations, outcome classes.

`build_seeds` writes small valid inputs: a tiny Llama GGUF (Q8_0, with tokenizer), a
tiny safetensors checkpoint (single file) and a sharded one (index + shards). `mutate`
derives case ``index`` of a run deterministically from ``(seed, index)`` and writes it
into a work directory: bit flips, byte changes, truncation, integer fields set to
boundary values (0, 1, 2^31, 2^32-1, 2^63, negative...), NaN / infinite floats,
duplicated or shifted tensor offsets, swapped types, huge counts; for safetensors the
header's JSON entries and length field, the index's weight map and config.json values
are mutated as data. `run_case` feeds the result to the public entry points
(`GGUFFile`, `load_config`, `inspect_checkpoint`, `infer.load` and a two-token
`generate`) and `classify` names the outcome: loaded, rejected with a documented error
(``ValueError`` / ``OSError``; whether the message names the file), memory-capped, or
an undocumented exception, with the innermost `infer` source file it came from.

Used by ``tests/integration/test_fuzz.py`` (bounded, in process) and
``benchmarks/fuzz.py`` (100,000 inputs in worker processes with timeouts and a memory cap).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import struct
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

KINDS = ("gguf", "safetensors", "index", "config")
KIND_WEIGHTS = (0.4, 0.25, 0.1, 0.25)
DOCUMENTED = (
    ValueError,
    OSError,
)  # the library's error types for bad input (FileNotFoundError, TimeoutError...)

U32_VALUES = (0, 1, 2, 3, 7, 8, 9, 12, 13, 255, 2**15, 32769, 2**31 - 1, 2**31, 2**32 - 1)
U64_VALUES = (*U32_VALUES, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
FLOAT_VALUES = (math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e38, 1e-45, 3.4e38, 1e300)
JSON_VALUES: tuple[Any, ...] = (
    0, 1, -1, 2, 3, 7, 2**31, 2**32 - 1, 2**63, -(2**63), 10**30, 1e308, math.nan, math.inf, -math.inf,
    0.5, -0.0, "64", "", "llama", "gemma3_text", None, True, False, [], [1, 2], {}, {"a": 1},
)  # fmt: skip
ST_DTYPES = ("F32", "F16", "BF16", "F64", "I64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "F4", "X", "", 5, None)


# ---------------------------------------------------------------------------- seeds


@dataclass(frozen=True)
class Seeds:
    """Paths of the valid inputs the mutations start from."""

    gguf: Path  # a .gguf file
    safetensors: Path  # a checkpoint directory (model.safetensors)
    sharded: Path  # a checkpoint directory (index + shards)


def build_seeds(directory: Path) -> Seeds:
    """Write the seed inputs into ``directory`` (once; later calls reuse them)."""
    from infer.gguf.writer import write_gguf
    from infer.testing import build_checkpoint, build_tokenizer, tiny_hf_model

    directory.mkdir(parents=True, exist_ok=True)
    gguf = directory / "tiny-llama-q8_0.gguf"
    if not gguf.is_file():
        model = tiny_hf_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        tmp = directory / "tmp.gguf"
        write_gguf(tmp, model, build_tokenizer(directory / "gguf-tokenizer"), qtype="Q8_0")
        tmp.rename(gguf)
    single, sharded = directory / "safetensors", directory / "sharded"
    if not (single / "config.json").is_file():
        build_checkpoint(single, "qwen3")
    if not (sharded / "config.json").is_file():
        build_checkpoint(sharded, "llama", sharded=True)
    return Seeds(gguf, single, sharded)


# ---------------------------------------------------------------------------- GGUF layout


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


# ---------------------------------------------------------------------------- safetensors, index, config


def _mutate_value(rng: random.Random, value: Any) -> Any:
    """A replacement for one JSON value: a boundary number, a wrong type, or a nearby valid one."""
    if isinstance(value, int) and not isinstance(value, bool) and rng.random() < 0.3:
        return value + rng.choice((-1, 1, 2, value))
    return rng.choice(JSON_VALUES)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into nested dicts / lists."""
    out: list[tuple[Any, ...]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((*prefix, k))
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append((*prefix, i))
            out += _paths(v, (*prefix, i))
    return out


def mutate_json(obj: Any, rng: random.Random, *, depth_bomb: bool = True) -> tuple[Any, str]:
    """Change, delete or add one entry somewhere in ``obj`` (a copy)."""
    obj = json.loads(json.dumps(obj))
    paths = _paths(obj)
    op = rng.choice(("set", "set", "set", "delete", "add", "top")) if paths else "top"
    if op == "top":
        choices: list[Any] = [[], "x", 1, None, [obj]]
        if depth_bomb:
            choices.append(_nested(rng.choice((100, 5000))))
        return rng.choice(choices), "top-level"
    path = rng.choice(paths)
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if op == "set":
        parent[key] = _mutate_value(rng, parent[key])
        return obj, f"set {'/'.join(map(str, path))}={parent[key]!r}"[:200]
    if op == "delete":
        del parent[key]
        return obj, f"delete {'/'.join(map(str, path))}"
    if isinstance(parent, dict):
        parent[f"fuzz_{rng.randrange(100)}"] = rng.choice(JSON_VALUES)
    else:
        parent.append(rng.choice(JSON_VALUES))
    return obj, f"add under {'/'.join(map(str, path[:-1]))}"


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def _dumps(obj: Any) -> str:
    try:
        return json.dumps(obj)
    except RecursionError:
        return "[" * 5000 + "]" * 5000


def _mutate_text(text: bytes, rng: random.Random) -> tuple[bytes, str]:
    data = bytearray(text)
    op = rng.choice(("bitflip", "bytes", "truncate"))
    if not data:
        return b"", "empty"
    if op == "truncate":
        cut = rng.randrange(len(data))
        return bytes(data[:cut]), f"truncate@{cut}"
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(data))
        data[i] = data[i] ^ (1 << rng.randrange(8)) if op == "bitflip" else rng.randrange(256)
    return bytes(data), op


def mutate_safetensors(seed: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Mutate a safetensors file: its header's JSON entries, its length field, raw bytes, or the data."""
    (n,) = struct.unpack_from("<Q", seed, 0)
    header = json.loads(seed[8 : 8 + n])
    body = seed[8 + n :]
    op = rng.choice(("entry", "entry", "entry", "json", "length", "text", "truncate", "data"))
    if op == "entry":
        names = [k for k in header if k != "__metadata__"]
        name = rng.choice(names)
        entry = header[name]
        what = rng.choice(("dtype", "shape", "offsets", "offsets", "swap", "drop", "replace"))
        if what == "dtype":
            entry["dtype"] = rng.choice(ST_DTYPES)
        elif what == "shape":
            entry["shape"] = rng.choice(
                ([0], [-1], [2**31], [2**63], [2**64], [], [1] * 9, ["4"], None, [*entry["shape"], 1],
                 entry["shape"][::-1], [entry["shape"][0] * 2, *entry["shape"][1:]])
            )  # fmt: skip
        elif what == "offsets":
            begin, end = entry["data_offsets"]
            other = header[rng.choice(names)]["data_offsets"]
            entry["data_offsets"] = rng.choice(
                ([0, 0], [end, begin], other, [begin, end + 4], [begin - 4, end - 4], [begin, len(body) + 64],
                 [-8, end], [begin, 2**64], [str(begin), end], [begin], None)
            )  # fmt: skip
        elif what == "swap":
            other_name = rng.choice(names)
            header[name], header[other_name] = header[other_name], entry
        elif what == "drop":
            del header[name]
        else:
            header[name] = rng.choice((None, 1, "x", [], {}))
        text = json.dumps(header).encode()
        desc = f"entry {name} {what}"
    elif op == "json":
        mutated, desc = mutate_json(header, rng)
        text = _dumps(mutated).encode()
    elif op == "text":
        text, desc = _mutate_text(seed[8 : 8 + n], rng)
        desc = f"header {desc}"
    elif op == "length":
        value = rng.choice((0, 1, 2, 7, n - 1, n + 1, n + 8, len(seed), 2**31, 2**32, 2**63, 2**64 - 1))
        return struct.pack("<Q", value) + seed[8:], f"header length {value}"
    elif op == "truncate":
        cut = rng.randrange(len(seed))
        return seed[:cut], f"truncate@{cut}"
    else:
        data = bytearray(seed)
        start = 8 + n + rng.randrange(len(body))
        stop = min(len(data), start + rng.choice((4, 64, 4096)))
        data[start:stop] = rng.choice((b"\xff", b"\x00")) * (stop - start)
        return bytes(data), f"data@{start}"
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body, desc


def mutate_index(seed: dict[str, Any], shards: list[str], rng: random.Random) -> tuple[str, str]:
    """Mutate a model.safetensors.index.json: weight-map entries as data, or the text."""
    op = rng.choice(("entry", "entry", "entry", "json", "text"))
    if op == "text":
        text, desc = _mutate_text(json.dumps(seed).encode(), rng)
        return text.decode("latin-1"), f"text {desc}"
    if op == "json":
        mutated, desc = mutate_json(seed, rng)
        return _dumps(mutated), desc
    index = json.loads(json.dumps(seed))
    weight_map = index["weight_map"]
    name = rng.choice(sorted(weight_map))
    what = rng.choice(("missing", "other", "traversal", "absolute", "type", "drop", "add", "map"))
    if what == "missing":
        weight_map[name] = "model-99999-of-99999.safetensors"
    elif what == "other":
        weight_map[name] = rng.choice(shards)
    elif what == "traversal":
        weight_map[name] = "../" + rng.choice(shards)
    elif what == "absolute":
        weight_map[name] = "/etc/passwd"
    elif what == "type":
        weight_map[name] = rng.choice((None, 1, [], {}, ""))
    elif what == "drop":
        del weight_map[name]
    elif what == "add":
        weight_map[f"model.fuzz.{rng.randrange(100)}.weight"] = rng.choice(shards)
    else:
        index["weight_map"] = rng.choice((None, [], "x", {}, [weight_map]))
    return json.dumps(index), f"weight_map {what} {name}"


def mutate_config(seed: dict[str, Any], rng: random.Random) -> tuple[str, str]:
    """Mutate a config.json: one value (boundary numbers, NaN, wrong types), a key, or the text."""
    op = rng.choice(("value", "value", "value", "value", "json", "text", "model_type"))
    if op == "text":
        text, desc = _mutate_text(json.dumps(seed).encode(), rng)
        return text.decode("latin-1"), f"text {desc}"
    if op == "model_type":
        config = dict(seed)
        config["model_type"] = rng.choice(
            ("llama", "qwen3", "gemma3_text", "gemma3", "gpt2", "mistral", "x", 3)
        )
        return json.dumps(config), f"model_type={config['model_type']!r}"
    if op == "json":
        mutated, desc = mutate_json(seed, rng)
        return _dumps(mutated), desc
    config = json.loads(json.dumps(seed))
    key = rng.choice(sorted(config))
    config[key] = _mutate_value(rng, config[key])
    return json.dumps(config), f"{key}={config[key]!r}"[:200]


# ---------------------------------------------------------------------------- cases


@dataclass
class Case:
    """One mutated input, written: what to feed (``path``) and how it was made."""

    index: int
    kind: str
    path: Path
    mutation: str
    streaming: bool = False


class Mutator:
    """Writes case ``index`` of run ``seed`` into ``work`` (one directory per kind, reused)."""

    def __init__(self, seeds: Seeds, work: Path, seed: int, kinds: tuple[str, ...] = KINDS) -> None:
        self.seeds = seeds
        self.work = work
        self.seed = seed
        self.kinds = kinds
        self.weights = [KIND_WEIGHTS[KINDS.index(k)] for k in kinds]
        self.gguf_bytes = seeds.gguf.read_bytes()
        self.layout = gguf_layout(self.gguf_bytes)
        self.st_bytes = (seeds.safetensors / "model.safetensors").read_bytes()
        self.config = json.loads((seeds.safetensors / "config.json").read_text())
        self.index = json.loads((seeds.sharded / "model.safetensors.index.json").read_text())
        self.shards = sorted(set(self.index["weight_map"].values()))
        for name, src in (("safetensors", seeds.safetensors), ("index", seeds.sharded)):
            target = work / name
            if not target.is_dir():
                shutil.copytree(src, target)
        (work / "gguf").mkdir(parents=True, exist_ok=True)

    def case(self, index: int) -> Case:
        rng = random.Random(f"{self.seed}:{index}")
        kind = rng.choices(self.kinds, self.weights)[0]
        streaming = rng.random() < 0.1
        if kind == "gguf":
            data, desc = mutate_gguf(self.gguf_bytes, self.layout, rng)
            path = self.work / "gguf" / "model.gguf"
            path.write_bytes(data)
            return Case(index, kind, path, desc, streaming)
        if kind == "index":
            directory = self.work / "index"
            text, desc = mutate_index(self.index, self.shards, rng)
            (directory / "model.safetensors.index.json").write_text(text, encoding="latin-1")
            return Case(index, kind, directory, desc, streaming)
        directory = self.work / "safetensors"
        if kind == "safetensors":
            data, desc = mutate_safetensors(self.st_bytes, rng)
            (directory / "model.safetensors").write_bytes(data)
            (directory / "config.json").write_text(json.dumps(self.config))
        else:
            text, desc = mutate_config(self.config, rng)
            (directory / "model.safetensors").write_bytes(self.st_bytes)
            (directory / "config.json").write_text(text, encoding="latin-1")
        return Case(index, kind, directory, desc, streaming)


# ---------------------------------------------------------------------------- running and classifying


@dataclass
class Outcome:
    """What one case did.

    ``outcome``: "loaded", "rejected", "rejected-unnamed" (a documented type whose message
    does not name the input), "memory-capped" or "undocumented".
    """

    index: int
    kind: str
    mutation: str
    outcome: str
    stage: str = ""
    error: str = ""  # exception type name
    origin: str = ""  # innermost infer source file in the traceback ("infer/gguf/reader.py")
    message: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_PACKAGE = Path(__file__).resolve().parent


def infer_frames(exc: BaseException) -> list[str]:
    """The ``infer/...`` source files of the traceback, outermost first (this module left out)."""
    out = []
    for frame in traceback.extract_tb(exc.__traceback__):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(_PACKAGE) and path != Path(__file__).resolve():  # the harness is not a suspect
            out.append("infer/" + path.relative_to(_PACKAGE).as_posix())
    return out


def classify(exc: BaseException, names: tuple[str, ...], stage: str = "") -> tuple[str, str]:
    """(outcome, origin) of an exception raised by entry point ``stage`` given ``names`` (paths)."""
    frames = infer_frames(exc)
    origin = frames[-1] if frames else ""
    text = str(exc)
    if isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text)
    ):
        return "memory-capped", origin
    from infer.generate import NonFiniteLogitsError

    if isinstance(exc, NonFiniteLogitsError):  # documented: weights whose activations overflow
        return "rejected", origin
    if isinstance(exc, DOCUMENTED):
        # After loading, a refused call (prompt longer than the context...) is about the call, not the file.
        named = stage == "generate" or any(name in text for name in names)
        return ("rejected" if named else "rejected-unnamed"), origin
    return "undocumented", origin


class CaseTimeout(BaseException):
    """Raised by SIGALRM in a case that overran its time limit (not an ``Exception``: never classified)."""


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise CaseTimeout


def run_case(
    case: Case, *, generate: bool = True, time_limit: float | None = None, reraise: bool = False
) -> Outcome:
    """Feed ``case`` to the public entry points, in order, until one raises.

    ``time_limit`` (seconds; main thread only) interrupts a case that runs longer with
    SIGALRM: its outcome is "hung", attributed like an error from where it was stopped.
    A hang inside native code is not interrupted; the caller needs its own backstop.
    ``reraise`` raises the first error after classifying it (to see its traceback).
    """
    import torch

    import infer
    from infer.gguf.reader import GGUFFile
    from infer.inspect import inspect_checkpoint
    from infer.loader.config import load_config
    from infer.streaming import StreamingConfig

    start = time.perf_counter()
    stages: list[tuple[str, Any]] = []
    if case.kind == "gguf":
        stages.append(("GGUFFile", lambda: GGUFFile(case.path)))
    else:
        stages.append(("load_config", lambda: load_config(case.path)))
    stages.append(("inspect_checkpoint", lambda: inspect_checkpoint(case.path)))
    streaming = (
        StreamingConfig(memory_budget="1GB", layer_group_size=1, max_resident_layers=0, max_context=64)
        if case.streaming
        else None
    )
    llm: list[Any] = []
    stages.append(("load", lambda: llm.append(infer.load(case.path, streaming=streaming))))
    if generate:
        stages.append(("generate", lambda: llm[0].generate("hi there", max_new_tokens=2)))
    names = (str(case.path), case.path.name)
    result = Outcome(
        case.index, case.kind, case.mutation + (" [streaming]" if case.streaming else ""), "loaded"
    )
    previous = signal.signal(signal.SIGALRM, _alarm) if time_limit is not None else None
    stage = ""
    try:
        if time_limit is not None:
            signal.setitimer(signal.ITIMER_REAL, time_limit)
        for stage, fn in stages:
            try:
                with torch.inference_mode():
                    fn()
            except Exception as e:  # classified, never swallowed: the caller decides what is acceptable
                outcome, origin = classify(e, names, stage)
                result.outcome, result.stage, result.error = outcome, stage, type(e).__name__
                result.origin, result.message = origin, str(e)[:300]
                if reraise:
                    raise
                break
    except CaseTimeout as e:
        frames = infer_frames(e)
        result.outcome, result.stage, result.error = "hung", stage, f"over {time_limit} s"
        result.origin = frames[-1] if frames else ""
        result.message = f"stopped after {time_limit} s in {result.origin or stage}"
    finally:
        if time_limit is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        llm.clear()
    result.seconds = time.perf_counter() - start
    return result


__all__ = [
    "DOCUMENTED",
    "KINDS",
    "Case",
    "CaseTimeout",
    "Mutator",
    "Outcome",
    "Seeds",
    "build_seeds",
    "classify",
    "gguf_layout",
    "infer_frames",
    "mutate_config",
    "mutate_gguf",
    "mutate_index",
    "mutate_json",
    "mutate_safetensors",
    "run_case",
]
