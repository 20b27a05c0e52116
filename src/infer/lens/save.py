"""Activations to disk: `save_activations` writes the hook points' values of many sequences as shards
of safetensors with an index, memory bounded by one shard, resumable after an interrupt; `load_shard`
and `Activations` read them back (docs/notebooks.md, "Activations to disk").

A shard holds whole sequences: per hook point one tensor ``[tokens, ...]`` (the sequences' positions
one after another), and ``sequence`` / ``position`` ``[tokens]`` int64 saying whose token each row is.
``index.json`` lists the shards written, each with the sequences it holds; a run that finds an index
of the same model and points goes on after its last shard, so an interrupted run loses at most the
shard it was filling.
"""

from __future__ import annotations

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
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ValueError(f"shard_bytes must be an int >= 1, got {shard_bytes!r}")
    model = llm.model
    chosen = select([p.name for p in points(model)], names, "names")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index_path = out / INDEX
    meta = {"names": chosen, "dtype": None if dtype is None else str(dtype).removeprefix("torch.")}
    index: dict[str, Any] = {**meta, "shards": []}
    if index_path.exists():
        index = json.loads(index_path.read_text())
        found = {k: index.get(k) for k in meta}
        if found != meta:
            raise ValueError(f"{index_path}: written for {found}, not {meta}: use another out_dir")
    done = sum(s["sequences"] for s in index["shards"])  # sequences already on disk
    rows = inputs.tolist() if isinstance(inputs, torch.Tensor) else inputs
    stop = _last_block(model, chosen)

    def sequences() -> Iterator[list[int]]:
        for i, item in enumerate(rows):
            if i >= done:
                yield token_ids(llm, item if isinstance(item, str) else [list(item)])[0].tolist()

    buffer: dict[str, list[torch.Tensor]] = {n: [] for n in chosen}
    seq_ids: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
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
        index["shards"].append({"file": name, "first": first, "sequences": count,
                                "tokens": int(tensors[SEQUENCE].numel())})  # fmt: skip
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
        self.index = json.loads(path.read_text())
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
