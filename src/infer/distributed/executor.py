"""The executors that make a rank's part of a model compute the whole model's result: a
vocabulary-parallel embedding and head (`TensorParallelExecutor`) and a stage's layers between a
receive and a send (`PipelineExecutor`), stacked as ``PipelineExecutor(TensorParallelExecutor(inner))``
by `infer.distributed.parallelize` (docs/distributed.md)."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from infer.distributed.runtime import Parallel
from infer.models.base import DecoderLM, Executor, ExecutorLimits, ResidentExecutor, StepInputs


class Wrapping:
    """An executor around ``inner``: its ``limits``, ``stats`` and layers are the inner executor's.
    A parallel model copies a shared prefix into each row (`Executor.shares_prefixes`)."""

    shares_prefixes = False

    def __init__(self, inner: Executor) -> None:
        self.inner = inner

    @property
    def limits(self) -> ExecutorLimits | None:
        return self.inner.limits

    @property
    def stats(self) -> Any:  # StreamingStats | None
        """The streaming counters of the layers it runs (None when they are resident)."""
        return self.inner.stats

    def run_layers(self, model: DecoderLM, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        return self.inner.run_layers(model, x, step)


class TensorParallelExecutor(Wrapping, ResidentExecutor):
    """A vocabulary-parallel embedding and head around ``inner``'s layers.

    This rank holds the vocabulary rows ``vocab_range`` of the embedding and of the head
    (``model.embed_tokens`` / ``model.lm_head`` are those slices); ``size`` ranks in
    ``group``. The head's product is always exact: every rank gathers every slice.
    """

    def __init__(
        self, inner: Executor, vocab_range: tuple[int, int], size: int, group: dist.ProcessGroup
    ) -> None:
        super().__init__(inner)
        self.start, self.stop = vocab_range
        self.size = size
        self.group = group

    def lookup(self, model: DecoderLM, input_ids: torch.Tensor) -> torch.Tensor:
        """Lookups of the rows this rank holds; zeros elsewhere; all-reduced."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)  # [B, T]
        rows = super().lookup(model, local.masked_fill(outside, 0))  # [B, T, D]
        rows = rows.masked_fill(outside[..., None], 0.0)
        dist.all_reduce(rows, group=self.group)
        return rows

    def project(self, model: DecoderLM, x: torch.Tensor, greedy: bool) -> torch.Tensor:
        """Logits of this rank's vocabulary rows, all-gathered: ``[..., V]`` on every rank."""
        local = super().project(model, x, False).contiguous()  # [..., V / size]
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)  # [..., V]


class PipelineExecutor(Wrapping):
    """Runs this stage's layers between a receive from the previous stage and a send to the next.

    Every rank calls it with the same shapes (generation runs in lockstep); the last stage's
    logits are broadcast to every stage. A batch runs as ``micro_batches`` slices of its rows, each
    sent on as soon as it is done (a row's result does not depend on its neighbours:
    `infer.host.rows`); a ``streamed`` stage runs its batch whole (each slice would read every
    weight again). ``dtype``: the activations' and logits' dtype on every stage.
    """

    def __init__(
        self,
        parallel: Parallel,
        inner: Executor,
        dtype: torch.dtype,
        *,
        streamed: bool = False,
        micro_batches: int | None = None,
    ) -> None:
        super().__init__(inner)
        self.parallel = parallel
        self.dtype = dtype
        self.streamed = streamed
        # Default: as many slices as stages, the fewest that keep every stage busy in the middle.
        self.micro_batches = parallel.pipeline_parallel if micro_batches is None else micro_batches

    def row_slices(self, batch: int) -> list[tuple[int, int]]:
        """``[start, stop)`` of each micro-batch: ``min(batch, micro_batches)`` near-equal slices."""
        m = 1 if self.streamed else max(1, min(batch, self.micro_batches))
        bounds = [batch * j // m for j in range(m + 1)]
        return list(itertools.pairwise(bounds))

    def embed(self, model: DecoderLM, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first stage's embedding; elsewhere a placeholder the previous stage's output replaces."""
        if self.parallel.first_stage:
            return self.inner.embed(model, input_ids, positions)
        return torch.zeros(
            *input_ids.shape, model.config.hidden_size, dtype=self.dtype, device=self.parallel.device
        )  # [B, T, D]

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
            h = self.inner.run_layers(model, h, rows).contiguous()
            if not p.last_stage:
                work = dist.isend(h, dst=p.stage_rank(p.stage + 1))
                if work is not None:
                    sends.append(work)
            outputs.append(h)
        for work in sends:  # the buffers must outlive their sends
            work.wait()
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [B, T, D]

    def head(self, model: DecoderLM, h: torch.Tensor, greedy: bool) -> torch.Tensor:
        """The last stage's logits (exact: every stage receives them all), broadcast to every stage."""
        p = self.parallel
        if p.last_stage:
            logits = self.inner.head(model, h, False).contiguous()
        else:
            logits = torch.empty(*h.shape[:-1], model.vocab_size, dtype=self.dtype, device=h.device)
        dist.broadcast(logits, src=p.stage_rank(p.pipeline_parallel - 1), group=p.column_group)
        return logits


__all__ = ["PipelineExecutor", "TensorParallelExecutor"]
