"""Module swaps that make a rank's part of a model compute the whole model's result.

Tensor parallelism (within a stage): `RowParallel` all-reduces a row-parallel linear's
partial sums (one all-reduce after attention, one after the MLP), `VocabParallelEmbedding`
looks up the rows a rank holds and all-reduces, `VocabParallelHead` all-gathers the
vocabulary slices of the logits, so every rank has the full logits.

Pipeline parallelism (across stages): `PipelineExecutor` runs a stage's layers between a
receive from the previous stage and a send to the next (micro-batch by micro-batch, so
stages work on different rows at once), and `PipelineHead` broadcasts the last stage's
logits to every stage, so every rank samples the same tokens. `StageInput` stands in for
the embedding on stages that do not hold it.

The model files know nothing of this: like streaming, it replaces modules and the
executor from outside.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from infer.distributed.runtime import Parallel
from infer.models.base import DecoderLM, ExecutorLimits, LayerExecutor, StepInputs


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's input columns, partial sums all-reduced, bias added once."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group
        bias = getattr(inner, "bias", None)
        self.bias: nn.Parameter | None = None
        if isinstance(bias, torch.Tensor):
            self.bias = nn.Parameter(bias.detach(), requires_grad=False)
            inner.bias = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.inner(x)
        dist.all_reduce(y, group=self.group)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


class VocabParallelEmbedding(nn.Module):
    """Lookups of the vocabulary rows ``[start, stop)`` this rank holds; zeros elsewhere; all-reduced."""

    def __init__(self, inner: nn.Module, start: int, stop: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.inner = inner
        self.start, self.stop = start, stop
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)  # [B, T]
        rows: torch.Tensor = self.inner(local.masked_fill(outside, 0))  # [B, T, D]
        rows = rows.masked_fill(outside[..., None], 0.0)
        dist.all_reduce(rows, group=self.group)
        return rows


class VocabParallelHead(nn.Module):
    """Logits of this rank's vocabulary rows, all-gathered: ``[..., V]`` on every rank."""

    def __init__(self, inner: nn.Module, size: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.inner = inner
        self.size = size
        self.group = group

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local: torch.Tensor = self.inner(h).contiguous()  # [..., V / T]
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)  # [..., V]


class StageInput(nn.Module):
    """The embedding of a stage that does not hold it: a placeholder for the previous stage's output."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.hidden_size, dtype=self.dtype, device=self.device)


class PipelineHead(nn.Module):
    """The head of the last stage, whose logits every stage receives (a broadcast down each column)."""

    def __init__(
        self, inner: nn.Module | None, parallel: Parallel, vocab_size: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.inner = inner
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.dtype = dtype

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        p = self.parallel
        if p.last_stage:
            assert self.inner is not None
            logits: torch.Tensor = self.inner(h).contiguous()
        else:
            logits = torch.empty(*h.shape[:-1], self.vocab_size, dtype=self.dtype, device=h.device)
        dist.broadcast(logits, src=p.stage_rank(p.pipeline_parallel - 1), group=p.column_group)
        return logits


class PipelineExecutor:
    """Runs this stage's layers between a receive from the previous stage and a send to the next.

    Every rank of every stage calls it with the same shapes (generation runs in lockstep);
    the first stage starts from the embedding, the others from what the previous stage
    sends; the last stage's result goes to the head. A batch runs as ``micro_batches``
    slices of its rows, each sent on (without waiting) as soon as it is done, so while a
    stage computes slice ``m`` the next stage computes slice ``m - 1``. A row's result does
    not depend on the rows computed beside it (`infer.rows`), so the slicing changes
    nothing in the outputs. ``inner`` runs the stage's layers when they stream (a
    `StreamingExecutor` planned for those layers alone); streaming reads every weight
    once per slice, so a streamed stage runs its batch whole.
    """

    def __init__(
        self,
        parallel: Parallel,
        layers: range,
        inner: LayerExecutor | None = None,
        micro_batches: int | None = None,
    ) -> None:
        self.parallel = parallel
        self.layers = layers
        self.inner = inner
        # Default: as many slices as stages, the fewest that keep every stage busy in the middle.
        self.micro_batches = parallel.pipeline_parallel if micro_batches is None else micro_batches

    @property
    def limits(self) -> ExecutorLimits | None:
        return self.inner.limits if self.inner is not None else None

    @property
    def stats(self) -> Any:  # StreamingStats | None
        """The streaming counters of this stage's layers (None when they are resident)."""
        return self.inner.stats if self.inner is not None else None

    def row_slices(self, batch: int) -> list[tuple[int, int]]:
        """``[start, stop)`` of each micro-batch: ``min(batch, micro_batches)`` near-equal slices."""
        m = 1 if self.inner is not None else max(1, min(batch, self.micro_batches))
        bounds = [batch * j // m for j in range(m + 1)]
        return list(itertools.pairwise(bounds))

    def run_layers(self, model: DecoderLM, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        p = self.parallel
        slices = self.row_slices(x.shape[0])
        outputs: list[torch.Tensor] = []
        sends: list[dist.Work] = []
        for start, stop in slices:
            h = x[start:stop].contiguous()  # [b, T, D]
            if not p.first_stage:
                dist.recv(h, src=p.stage_rank(p.stage - 1))
            rows = step if len(slices) == 1 else step.rows(start, stop)
            if self.inner is not None:
                h = self.inner.run_layers(model, h, rows)
            else:
                for i in self.layers:
                    h = model.run_layer(i, model.layers[i], h, rows)
            h = h.contiguous()
            if not p.last_stage:
                work = dist.isend(h, dst=p.stage_rank(p.stage + 1))
                if work is not None:
                    sends.append(work)
            outputs.append(h)
        for work in sends:  # the buffers must outlive their sends
            work.wait()
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [B, T, D]


__all__ = [
    "PipelineExecutor",
    "PipelineHead",
    "RowParallel",
    "StageInput",
    "VocabParallelEmbedding",
    "VocabParallelHead",
]
