"""`infer inspect`: what a checkpoint holds and what it will cost, without loading it."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.kv.cache import KVCache
from infer.loader.source import StoredTensor
from infer.loading import open_checkpoint
from infer.realmodels import resolve_name


@dataclass(frozen=True)
class TensorRow:
    name: str
    shape: tuple[int, ...]
    kind: str  # storage type: "BF16", "Q4_K", ...
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


_KINDS = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _row(t: StoredTensor) -> TensorRow:
    kind = t.qtype.name if t.qtype is not None else _KINDS.get(t.dtype, str(t.dtype).removeprefix("torch."))
    return TensorRow(t.name, t.shape, kind, t.nbytes)


def inspect_checkpoint(
    model: str | Path, *, context: int | None = None, batch_size: int = 1, dtype: str | None = None
) -> str:
    """A human-readable report: architecture, parameters, per-layer tensors, memory estimates."""
    checkpoint = open_checkpoint(resolve_name(model))
    path, config = checkpoint.path, checkpoint.config
    rows = [_row(t) for t in checkpoint.stored_tensors()]
    run_dtype = checkpoint.options(dtype).dtype
    context = context or config.max_position_embeddings
    if context > config.max_position_embeddings:  # an estimate for a context no run could have
        raise ValueError(f"context {context} is past the model's {config.max_position_embeddings} positions")
    params = sum(r.numel for r in rows)
    stored = sum(r.nbytes for r in rows)
    as_float = params * torch.empty((), dtype=run_dtype).element_size()
    # What generation allocates (the engine keeps every slot: rows can roll back), and what
    # ring buffers on the sliding-window layers would need.
    kv = KVCache.bytes_needed(config, batch_size, context, run_dtype, rings=False)
    kv_ring = KVCache.bytes_needed(config, batch_size, context, run_dtype)
    kinds: dict[str, int] = defaultdict(int)
    for r in rows:
        kinds[r.kind] += r.nbytes

    lines = [
        f"checkpoint    {path}",
        f"architecture  {config.model_type}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"heads {config.num_attention_heads} (kv {config.num_key_value_heads}) x {config.computed_head_dim}, "
        f"mlp {config.intermediate_size}, vocab {config.vocab_size}",
        f"context       {config.max_position_embeddings} positions"
        + (f", sliding window {config.sliding_window}" if config.sliding_window else ""),
        f"parameters    {params:,} ({params / 1e6:.1f} M)"
        + (", tied embeddings" if config.tie_word_embeddings else ""),
        "stored as     " + ", ".join(f"{k} {_gib(v)}" for k, v in sorted(kinds.items())),
        f"weights       {_gib(stored)} on disk; {_gib(as_float)} if unpacked to "
        f"{str(run_dtype).removeprefix('torch.')}",
        f"KV cache      {_gib(kv)} for batch {batch_size} x {context} tokens at "
        f"{str(run_dtype).removeprefix('torch.')}"
        + (f" (ring buffers on sliding layers would need {_gib(kv_ring)})" if kv != kv_ring else ""),
        "",
    ]
    layer_re = re.compile(r"(?:^|\.)(?:layers|h|blk)\.(\d+)\.")
    per_layer: dict[int, list[TensorRow]] = defaultdict(list)
    other: list[TensorRow] = []
    for r in rows:
        m = layer_re.search(r.name)
        (per_layer[int(m.group(1))] if m else other).append(r)
    width = max((len(r.name) for r in rows), default=10)
    lines.append("global tensors")
    for r in other:
        lines.append(f"  {r.name:<{width}}  {r.kind:>5}  {list(r.shape)}  {_gib(r.nbytes)}")
    for i in sorted(per_layer):
        layer_rows = per_layer[i]
        total = sum(r.nbytes for r in layer_rows)
        kind = (
            config.layer_type(i)
            if i < config.num_hidden_layers
            else f"past the config's {config.num_hidden_layers} layers: a load refuses it"
        )
        lines.append(f"layer {i} ({kind}, {len(layer_rows)} tensors, {_gib(total)})")
        for r in layer_rows:
            lines.append(f"  {r.name:<{width}}  {r.kind:>5}  {list(r.shape)}  {_gib(r.nbytes)}")
    return "\n".join(lines)
