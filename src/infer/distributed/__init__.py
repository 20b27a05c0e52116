"""Tensor and pipeline parallelism over `torch.distributed`: one model across processes.

Under ``torchrun --nproc-per-node N`` (or any initialized default process group),
``infer.load(path, tensor_parallel=T, pipeline_parallel=P)`` with ``T x P == N`` builds
on every rank the part of the model that rank holds — its pipeline stage's layers, and
within them its tensor-parallel share of every weight, read straight from the checkpoint
(`infer.loader.build.Partition`) — and swaps in the modules that make the parts compute
the whole (`infer.distributed.modules`). Every rank then returns the same `LLM`:
``generate`` / ``stream`` / ``chat`` run in lockstep on all ranks and give the same result
on each. See docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from infer.distributed.modules import (
    PipelineExecutor,
    PipelineHead,
    RowParallel,
    StageInput,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from infer.distributed.runtime import DEFAULT_TIMEOUT_S, Parallel, agree, setup, shared_seed
from infer.distributed.shard import TensorParallel, split_layers
from infer.loader.build import Partition, load_model
from infer.loader.config import ModelConfig
from infer.loader.options import LoadOptions
from infer.loader.source import WeightSource
from infer.models.base import DecoderLM, SequentialExecutor


def plan_partition(config: ModelConfig, parallel: Parallel, source: str) -> Partition:
    """This rank's `Partition`; sizes that do not divide raise `ValueError` (on every rank alike)."""
    tp = None
    if parallel.tensor_parallel > 1:
        tp = TensorParallel(config, parallel.tensor_parallel, parallel.tp_rank, source)
    stages = split_layers(config.num_hidden_layers, parallel.pipeline_parallel, source)
    return Partition(
        layers=stages[parallel.stage],
        embed=parallel.first_stage or (parallel.last_stage and config.tie_word_embeddings),
        head=parallel.last_stage,
        tensor_parallel=tp,
    )


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_name, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)


def parallelize(
    model: DecoderLM, config: ModelConfig, parallel: Parallel, partition: Partition, dtype: torch.dtype
) -> DecoderLM:
    """Swap in the modules that make this rank's part of ``model`` compute the whole model."""
    tp = partition.tensor_parallel
    model.vocab_size = config.vocab_size  # the whole vocabulary: the head gathers every slice
    if tp is not None:
        for i in partition.layers:
            layer = model.layers[i]
            for name, module in list(layer.named_modules()):
                if name and tp.row_parallel(f"layers.{i}.{name}"):
                    _set(layer, name, RowParallel(module, parallel.tp_group))
        if partition.embed:
            start, stop = tp.vocab_range
            model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, start, stop, parallel.tp_group)  # type: ignore[assignment]
        if partition.head:
            model.lm_head = VocabParallelHead(model.lm_head, tp.size, parallel.tp_group)  # type: ignore[assignment]
    if parallel.pipeline_parallel > 1:
        if not parallel.first_stage:
            model.embed_tokens = StageInput(config.hidden_size, dtype, parallel.device)  # type: ignore[assignment]
            if hasattr(model, "embed_positions"):
                model.embed_positions = StageInput(config.hidden_size, dtype, parallel.device)
        if not parallel.last_stage:
            # The final norm runs on the last stage; here it only tells the model its dtype and device.
            for name, t in list(model.norm.named_parameters()):
                setattr(
                    model.norm, name, nn.Parameter(torch.ones(t.shape, dtype=dtype, device=parallel.device))
                )
        head = model.lm_head if parallel.last_stage else None
        model.lm_head = PipelineHead(head, parallel, config.vocab_size, dtype)  # type: ignore[assignment]
        streamed = None if isinstance(model.executor, SequentialExecutor) else model.executor
        model.executor = PipelineExecutor(parallel, partition.layers, streamed)
        model.kv_layers = partition.layers  # the K/V cache holds this stage's layers only
    return model


Build = Callable[[WeightSource, ModelConfig, LoadOptions, Partition], DecoderLM]


def resident(
    source: WeightSource, config: ModelConfig, options: LoadOptions, partition: Partition
) -> DecoderLM:
    """This rank's part, resident on its device (`infer.loader.build.load_model`)."""
    return load_model(source, config, options, partition=partition)


def load_parallel(
    source: WeightSource,
    config: ModelConfig,
    options: LoadOptions,
    *,
    build: Build = resident,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[DecoderLM, Parallel]:
    """This rank's part of the model from ``source``, parallelized; every rank fails together.

    ``options.tensor_parallel`` x ``options.pipeline_parallel`` ranks; ``build`` builds
    this rank's part on its device (default: resident; `infer.streaming.build_streamed`
    streams it).
    """
    parallel = setup(options.tensor_parallel, options.pipeline_parallel, options.device, timeout_s)

    def work() -> DecoderLM:
        partition = plan_partition(config, parallel, source.description)
        model = build(source, config, dataclasses.replace(options, device=parallel.device), partition)
        return parallelize(model, config, parallel, partition, options.dtype)

    return agree(parallel, work), parallel


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Parallel",
    "TensorParallel",
    "agree",
    "load_parallel",
    "parallelize",
    "plan_partition",
    "resident",
    "setup",
    "shared_seed",
    "split_layers",
]
