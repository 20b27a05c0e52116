"""Tensor and pipeline parallelism over `torch.distributed`: one model across processes.

Under ``torchrun`` (or any initialized default process group), ``infer.load(path,
tensor_parallel=T, pipeline_parallel=P)`` builds on every rank the part of the model it holds
(`infer.assembly.build.Partition`) and installs the executors that make the parts compute the
whole; every rank returns the same `LLM`, run in lockstep. See docs/distributed.md.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from infer.assembly.build import Build, ModelBuilder, Partition, load_model
from infer.assembly.options import LoadOptions
from infer.distributed.executor import PipelineExecutor, TensorParallelExecutor
from infer.distributed.modules import RowParallel
from infer.distributed.runtime import DEFAULT_TIMEOUT_S, Parallel, agree, setup, shared_seed
from infer.distributed.shard import TensorParallel, split_layers
from infer.loader.config import ModelConfig
from infer.loader.source import WeightSource
from infer.models.base import DecoderLM, Executor, ResidentExecutor


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
    model: DecoderLM,
    config: ModelConfig,
    parallel: Parallel,
    partition: Partition,
    dtype: torch.dtype,
    *,
    streamed: bool = False,
) -> DecoderLM:
    """Install the executor that makes this rank's part of ``model`` compute the whole model.

    ``model.executor`` runs this rank's layers (a resident one, or a streaming one when
    ``streamed``); tensor parallelism wraps it in a `TensorParallelExecutor` (and the
    row-parallel linears of the layers in `RowParallel`), pipeline parallelism in a
    `PipelineExecutor`.
    """
    tp = partition.tensor_parallel
    model.vocab_size = config.vocab_size  # the whole vocabulary: the head gathers every slice
    executor: Executor = model.executor if streamed else ResidentExecutor(partition.layers)
    if tp is not None:
        for i in partition.layers:
            layer = model.layers[i]
            for name, module in list(layer.named_modules()):
                if name and tp.row_parallel(f"layers.{i}.{name}"):
                    _set(layer, name, RowParallel(module, parallel.tp_group))
        executor = TensorParallelExecutor(executor, tp.vocab_range, tp.size, parallel.tp_group)
    if parallel.pipeline_parallel > 1:
        if not parallel.last_stage:
            # The final norm runs on the last stage; here it only tells the model its dtype and device.
            for name, t in list(model.norm.named_parameters()):
                setattr(
                    model.norm, name, nn.Parameter(torch.ones(t.shape, dtype=dtype, device=parallel.device))
                )
        executor = PipelineExecutor(parallel, executor, dtype, streamed=streamed)
        model.kv_layers = partition.layers  # the K/V cache holds this stage's layers only
    model.executor = executor
    return model


def load_parallel(
    source: WeightSource,
    config: ModelConfig,
    options: LoadOptions,
    *,
    build: Build = load_model,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[DecoderLM, Parallel]:
    """This rank's part of the model from ``source``, parallelized; every rank fails together.

    ``options.tensor_parallel`` x ``options.pipeline_parallel`` ranks; ``build`` places
    this rank's part on its device (default: `load_model`, resident; `infer.streaming.build_streamed`
    streams it).
    """
    parallel = setup(options.tensor_parallel, options.pipeline_parallel, options.device, timeout_s)

    def work() -> DecoderLM:
        partition = plan_partition(config, parallel, source.description)
        own = dataclasses.replace(options, device=parallel.device)
        model = build(ModelBuilder(source, config, own, partition=partition))
        streamed = options.streaming is not None
        return parallelize(model, config, parallel, partition, options.dtype, streamed=streamed)

    return agree(parallel, work), parallel


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Parallel",
    "PipelineExecutor",
    "TensorParallel",
    "TensorParallelExecutor",
    "agree",
    "load_parallel",
    "parallelize",
    "plan_partition",
    "setup",
    "shared_seed",
    "split_layers",
]
