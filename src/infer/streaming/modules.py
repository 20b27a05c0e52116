"""Module swaps for an embedding and an ``lm_head`` that do not fit the budget.

`StreamedEmbedding` reads only the rows a step looks up, straight from the
checkpoint. `StreamedHead` computes the logits chunk by chunk of vocabulary rows,
each chunk brought in through the same buffers and reader as the layer groups.
Both replace the model's modules from outside; the model's walk is unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from infer import rows
from infer.streaming.layout import Unit
from infer.streaming.pipeline import Pipeline
from infer.streaming.store import TensorRef, WeightStore


class StreamedEmbedding(nn.Module):
    """``input_ids [B, T] -> [B, T, D]`` with the rows read from ``store`` on demand."""

    def __init__(self, store: WeightStore, ref: TensorRef, device: torch.device) -> None:
        super().__init__()
        self.store = store
        self.ref = ref
        self.device = device
        self.num_embeddings, self.embedding_dim = ref.shape[0], ref.shape[1]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)  # [B*T]
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        rows = self.store.read_rows(self.ref, flat)  # [B*T, D]
        return rows.to(self.device).view(*input_ids.shape, self.embedding_dim)  # [B, T, D]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, streamed from {self.ref.key!r}"


class StreamedHead(nn.Module):
    """``h [..., D] -> logits [..., V]``, one chunk of vocabulary rows at a time.

    In the deterministic mode (``tile_rows``) each chunk (a multiple of `infer.rows.COLUMN_TILE`
    rows, from row 0) runs in the resident head's row and column tiles: the same logits, bit for bit.
    """

    tile_rows: int = 0
    column_tile: int = 0

    def __init__(self, pipeline: Pipeline, units: list[Unit], vocab_size: int) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.units = units
        self.vocab_size = vocab_size

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = h.new_empty(*h.shape[:-1], self.vocab_size)  # [..., V]
        for unit in self.units:
            _, buffer = self.pipeline.get(unit.index)
            try:
                assert unit.rows is not None
                weight = unit.slots[0].view(self.pipeline.transport.flat(buffer))  # [rows, D]
                out[..., unit.rows[0] : unit.rows[1]] = rows.linear(  # as the resident head
                    h, weight, None, self.tile_rows, self.column_tile
                )
            except BaseException:
                self.pipeline.abort()
                raise
            self.pipeline.done(unit.index, buffer)
        return out

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, streamed in {len(self.units)} chunk(s)"
