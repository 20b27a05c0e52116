"""Mutations of the JSON a safetensors checkpoint is made of (`infer.testing.fuzzing`): a
safetensors file's header entries and length field (`mutate_safetensors`), an index's weight
map (`mutate_index`) and config.json's values (`mutate_config`), as data or as text."""

from __future__ import annotations

import json
import math
import random
import struct
from typing import Any

JSON_VALUES: tuple[Any, ...] = (
    0, 1, -1, 2, 3, 7, 2**31, 2**32 - 1, 2**63, -(2**63), 10**30, 1e308, math.nan, math.inf, -math.inf,
    0.5, -0.0, "64", "", "llama", "gemma3_text", None, True, False, [], [1, 2], {}, {"a": 1},
)  # fmt: skip
ST_DTYPES = ("F32", "F16", "BF16", "F64", "I64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "F4", "X", "", 5, None)


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
