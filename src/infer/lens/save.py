"""Activations to disk: `save_activations` writes the hook points' values of many sequences as shards
of safetensors with an index, memory bounded by one shard, resumable after an interrupt; `load_shard`
and `Activations` read them back (docs/notebooks.md, "Activations to disk").

A shard holds whole sequences: per hook point one tensor ``[tokens, ...]`` (the sequences' positions
one after another), and ``sequence`` / ``position`` ``[tokens]`` int64 saying whose token each row is.
``index.json`` lists the shards written, each with the sequences it holds and a SHA-256 of their
token ids, and what the data set is (the model, the points, the dtype); a run that finds an index of
the same model, points and dtype, whose shards hold the same leading sequences, goes on after its last
shard, so an interrupted run loses at most the shard it was filling. Anything else is refused, naming
the directory and what differs.

Only points with one row per token (``[batch, pos, ...]``) are saved: the attention scores and
pattern (``[batch, head, query, key]``) and the head's points (never run) are refused up front.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from infer.host.pages import reusing_blocks
from infer.lens.points import NameFilter, points, select
from infer.lens.run import LLM, run_with_cache, token_ids

INDEX = "index.json"
POSITION, SEQUENCE = "position", "sequence"
FORMAT = 2  # index.json's layout: 2 records the data set's identity and each shard's token hash
NOT_PER_TOKEN = ("hook_attn_scores", "hook_pattern")  # [B, H, T, S]: no row per token


def _check_names(names: Sequence[str]) -> None:
    """`ValueError` for points a shard cannot hold: not one row per token, or of the head."""
    for n in names:
        if n.rsplit(".", 1)[-1] in NOT_PER_TOKEN:
            raise ValueError(
                f"names: {n} is [batch, head, query, key], not one row per token ([batch, pos, ...]), "
                "which is what a shard stores; pick it with run_with_cache instead, and leave it out "
                "here (e.g. names=lambda n: 'hook_pattern' not in n and 'hook_attn_scores' not in n)"
            )
        if n.startswith("unembed."):
            raise ValueError(
                f"names: {n} is the head's, which save_activations never runs (return_type=None); "
                "save ln_final.hook_normalized (unembed.hook_in's value) or use run_with_cache for logits"
            )


def _identity(llm: LLM, names: list[str], dtype: torch.dtype | None) -> dict[str, Any]:
    """What identifies a data set in ``index.json``: the model, the points, the stored dtype."""
    model = llm.model
    config = getattr(model, "config", None)
    return {
        "format": FORMAT,
        "model": {
            "source": str(getattr(llm, "source", None)),
            "class": type(model).__name__,
            "layers": len(model.layers),
            "hidden_size": getattr(config, "hidden_size", None),
            "vocab_size": getattr(model, "vocab_size", getattr(config, "vocab_size", None)),
            "dtype": str(getattr(model, "dtype", None)).removeprefix("torch."),
        },
        "names": names,
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
    }


def _digest(seqs: Iterable[list[int]]) -> str:
    """SHA-256 of token id sequences (each its length, then its ids, as int64)."""
    h = hashlib.sha256()
    for ids in seqs:
        h.update(len(ids).to_bytes(8, "little"))
        h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def _read_index(path: Path) -> dict[str, Any]:
    """``index.json`` checked: `ValueError` naming the file for one that is not JSON or not an index."""
    try:
        index = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path}: not a valid activations index ({e}); remove it or use another out_dir"
        ) from None
    shard_keys = {"file": str, "first": int, "sequences": int, "tokens": int}
    ok = (
        isinstance(index, dict)
        and isinstance(index.get("names"), list)
        and isinstance(index.get("shards"), list)
        and all(
            isinstance(s, dict) and all(isinstance(s.get(k), t) for k, t in shard_keys.items())
            for s in index["shards"]
        )
    )
    if not ok:
        raise ValueError(
            f"{path}: not an activations index (expected an object with 'names' and 'shards', each shard "
            f"with {', '.join(shard_keys)}); remove it or use another out_dir"
        )
    assert isinstance(index, dict)
    return index


def _rows(inputs: Any) -> Iterable[Any]:
    """``inputs`` as an iterable of sequences: one text, one id list or a ``[T]`` tensor is one
    sequence (as `infer.lens.run.token_ids` takes them); a ``[N, T]`` tensor's rows."""
    if isinstance(inputs, torch.Tensor):
        if inputs.ndim not in (1, 2) or inputs.dtype.is_floating_point or inputs.dtype == torch.bool:
            raise ValueError(
                f"inputs: expected token ids [T] or [N, T] of an integer dtype, got shape "
                f"{tuple(inputs.shape)} {inputs.dtype}"
            )
        rows: list[Any] = inputs.tolist()
        return [rows] if inputs.ndim == 1 else rows
    if isinstance(inputs, str):
        return [inputs]
    if isinstance(inputs, bytes | bytearray) or not isinstance(inputs, Iterable):
        raise TypeError(
            "inputs: expected texts, token id lists or a [N, T] tensor, got "
            f"{inputs!r:.80} ({type(inputs).__name__})"
        )
    if isinstance(inputs, Sequence) and inputs and isinstance(inputs[0], int):
        return [inputs]
    return inputs


def _last_block(model: Any, names: Sequence[str]) -> int | None:
    """The blocks a forward must run for ``names``: the residual before the block after the last one
    they read (`run_with_cache`'s ``stop_at_layer``), or None when a name needs the head's norm."""
    layer = {p.name: p.layer for p in points(model)}
    if any(layer.get(n) is None and n != "hook_embed" for n in names):
        return None
    return max((layer[n] or 0) for n in names) + 1


def _batches(seqs: Iterable[list[int]], batch_size: int) -> Iterator[list[list[int]]]:
    """Consecutive sequences, at most ``batch_size`` a forward, right-padded to the longest (a causal
    forward's positions do not see those after them, so padding changes no real position's inputs).
    A sequence that would make the padding more than half the batch's real tokens starts the next."""
    batch: list[list[int]] = []
    for ids in seqs:
        if batch:
            longest = max(len(ids), *(len(b) for b in batch))
            if longest * (len(batch) + 1) > 1.5 * (len(ids) + sum(len(b) for b in batch)):
                yield batch
                batch = []
        batch.append(ids)
        if len(batch) == batch_size:  # a full batch runs before the next sequence is read
            yield batch
            batch = []
    if batch:
        yield batch


def save_activations(
    llm: LLM,
    inputs: Iterable[str | Sequence[int]] | torch.Tensor,
    names: NameFilter,
    out_dir: str | os.PathLike[str],
    *,
    batch_size: int = 8,
    shard_bytes: int = 256 * 2**20,
    dtype: torch.dtype | None = None,
    progress: bool = True,
) -> Path:
    """Run every sequence of ``inputs`` (texts, token id lists, or the rows of a ``[N, T]`` tensor)
    and write the activations at the hook points ``names`` picks to ``out_dir`` (see the module's
    docstring); returns the index's path. ``batch_size``: consecutive sequences run in one forward,
    right-padded to the longest (`_batches`: at most half as many padded as real tokens);
    ``shard_bytes``: a shard is written once it holds this many bytes (memory is bounded by it plus
    one batch); ``dtype``: what the values are stored as (default: as computed).
    Only the blocks the points need run, and never the head (the final norm if ``ln_final`` is asked)."""
    for arg, given in (("batch_size", batch_size), ("shard_bytes", shard_bytes)):
        if not isinstance(given, int) or isinstance(given, bool) or given < 1:
            raise ValueError(f"{arg} must be an int >= 1, got {given!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype: expected None or a floating torch.dtype (e.g. torch.float16), got {dtype!r}")
    model = llm.model
    chosen = select([p.name for p in points(model)], names, "names")
    _check_names(chosen)
    rows = _rows(inputs)
    out = Path(out_dir)
    index_path = out / INDEX
    meta = _identity(llm, chosen, dtype)
    index: dict[str, Any] = {**meta, "shards": []}
    if index_path.exists():
        index = _read_index(index_path)
        differ = [k for k in meta if index.get(k) != meta[k]]
        if differ:
            found = {k: index.get(k) for k in differ}
            want = {k: meta[k] for k in differ}
            raise ValueError(
                f"{out}: holds activations of another data set ({', '.join(differ)} differ: written for "
                f"{found}, this run is {want}); use another out_dir or remove it"
            )
    done = sum(s["sequences"] for s in index["shards"])  # sequences already on disk
    stop = _last_block(model, chosen)

    def encoded(i: int, item: Any) -> list[int]:
        if not isinstance(item, str) and not (isinstance(item, Sequence | torch.Tensor) and len(item)):
            raise TypeError(
                f"inputs[{i}]: expected a text or a non-empty list of token ids, got {item!r:.80}"
            )
        row = (
            item
            if isinstance(item, str)
            else [item.tolist() if isinstance(item, torch.Tensor) else list(item)]
        )
        ids: list[int] = token_ids(llm, row)[0].tolist()
        return ids

    items = iter(enumerate(rows))
    # A resume: the sequences on disk must be these inputs' first ones (checked before any forward)
    for s in index["shards"]:
        pairs = (next(items, (None, None)) for _ in range(s["sequences"]))
        on_disk = [encoded(i, item) for i, item in pairs if i is not None]
        first_seq, last_seq = s["first"], s["first"] + s["sequences"] - 1
        if len(on_disk) < s["sequences"]:
            raise ValueError(
                f"{out}: holds sequences {first_seq}..{last_seq} in {s['file']}, but these inputs end "
                f"after {first_seq + len(on_disk)} sequences: another data set; use another out_dir "
                "or remove it"
            )
        if s.get("sha256") != _digest(on_disk):
            raise ValueError(
                f"{out}: {s['file']} holds sequences {first_seq}..{last_seq} of other token ids than these "
                "inputs': another data set; use another out_dir or remove it"
            )

    def sequences() -> Iterator[list[int]]:
        for i, item in items:
            yield encoded(i, item)

    out.mkdir(parents=True, exist_ok=True)

    buffer: dict[str, list[torch.Tensor]] = {n: [] for n in chosen}
    seq_ids: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    digest: list[list[int]] = []  # the token ids of the shard being filled
    held, first, count = 0, done, 0

    def flush() -> None:
        nonlocal held, first, count
        if not count:
            return
        tensors: dict[str, torch.Tensor] = {}
        for n, v in buffer.items():  # each point's pieces freed once joined: the shard is held once
            tensors[n] = torch.cat(v).contiguous()
            v.clear()
        tensors[SEQUENCE] = torch.cat(seq_ids)
        tensors[POSITION] = torch.cat(positions)
        name = f"shard-{len(index['shards']):05d}.safetensors"
        save_file(tensors, str(out / (name + ".tmp")))
        os.replace(out / (name + ".tmp"), out / name)  # a shard is on disk whole, or not at all
        tokens = int(tensors[SEQUENCE].numel())
        index["shards"].append({"file": name, "first": first, "sequences": count, "tokens": tokens,
                                "sha256": _digest(digest)})  # fmt: skip
        digest.clear()
        tmp = index_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, index_path)
        seq_ids.clear()
        positions.clear()
        first, held, count = first + count, 0, 0

    from tqdm.auto import tqdm

    total = len(rows) if isinstance(rows, Sequence) else None
    bar = tqdm(total=total, initial=done, unit="seq", desc="activations", disable=not progress)
    seq = done
    with torch.inference_mode():
        for batch in _batches(sequences(), batch_size):
            lengths = [len(ids) for ids in batch]
            digest.extend(batch)
            B, T = len(batch), max(lengths)
            padded = torch.tensor([ids + [0] * (T - len(ids)) for ids in batch], device=model.device)
            with reusing_blocks(B * T):  # the forward's and the shard's temporaries reuse freed blocks
                _, cache = run_with_cache(llm, padded, chosen, stop, return_type=None)  # [B, T]: padded right
                real = torch.tensor([[j < n for j in range(T)] for n in lengths], device=model.device)
                for n in chosen:
                    # [B, T, ...] -> [real tokens, ...], row after row (without padding: a view)
                    value = cache[n].flatten(0, 1) if min(lengths) == T else cache[n][real]
                    value = value if dtype is None else value.to(dtype)
                    buffer[n].append(value.cpu())
                    held += value.numel() * value.element_size()
                seq_ids.append(torch.arange(seq, seq + B).repeat_interleave(torch.tensor(lengths)))
                positions.append(torch.cat([torch.arange(n) for n in lengths]))
                seq, count = seq + B, count + B
                bar.update(B)
                if held >= shard_bytes:
                    flush()
        flush()
    bar.close()
    index["complete"] = True
    index_path.write_text(json.dumps(index, indent=1))
    return index_path


def load_shard(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """One shard's tensors: each hook point's ``[tokens, ...]``, ``sequence`` and ``position``."""
    return load_file(str(path))


class Activations:
    """What `save_activations` wrote to ``out_dir``: ``names``, ``shards`` (their files), and
    ``sequence(i)``: each point's values ``[T, ...]`` for sequence ``i``."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(out_dir)
        path = self.dir / INDEX
        if not path.exists():
            raise FileNotFoundError(f"{path}: no activations index (written by infer.lens.save_activations)")
        self.index = _read_index(path)
        self.names: list[str] = self.index["names"]
        self.shards = [self.dir / s["file"] for s in self.index["shards"]]

    def __len__(self) -> int:
        return sum(s["sequences"] for s in self.index["shards"])

    def sequence(self, i: int) -> dict[str, torch.Tensor]:
        for s, path in zip(self.index["shards"], self.shards, strict=True):
            if s["first"] <= i < s["first"] + s["sequences"]:
                t = load_shard(path)
                rows = t[SEQUENCE] == i
                return {n: t[n][rows] for n in self.names}
        raise IndexError(f"sequence {i}: {self.dir} holds sequences 0..{len(self) - 1}")


__all__ = ["Activations", "load_shard", "save_activations"]
