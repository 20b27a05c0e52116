"""Build a streamed `DecoderLM`: skeleton on meta, memory plan, resident parts placed, executor plugged in."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from infer.loader.build import assign_parameter
from infer.loader.config import ModelConfig
from infer.loader.tokenizer import Tokenizer
from infer.models.base import DecoderLM
from infer.streaming.config import StreamingConfig
from infer.streaming.executor import StreamingExecutor
from infer.streaming.modules import StreamedEmbedding, StreamedHead
from infer.streaming.pipeline import Pipeline
from infer.streaming.plan import MemoryPlan, plan_memory
from infer.streaming.source import EMBED, HEAD, NORM, SafetensorsSource, TensorRef, WeightSource
from infer.streaming.stats import StreamingStats
from infer.streaming.transport import CpuTransport, CudaTransport, Transport, cuda_event


def build_streaming_model(
    path: str | Path,
    config: ModelConfig,
    model_cls: Callable[[ModelConfig], nn.Module],
    *,
    device: torch.device | str,
    dtype: torch.dtype | None,
    streaming: StreamingConfig,
    quantize: str | None = None,
    max_context: int | None = None,
) -> DecoderLM:
    """A ``model_cls`` model whose layers stream from the safetensors checkpoint at ``path``.

    Only the parts the plan keeps resident are read at load; the executor reads
    the rest one layer group at a time while generating. ``max_context`` overrides
    ``streaming.max_context`` for planning the KV cache. Raises `BudgetError` (a
    `ValueError`) when the configuration cannot fit ``streaming.memory_budget``,
    with what would fit.
    """
    source: WeightSource
    if quantize is not None:
        from infer.streaming.quantized_source import QuantizedSafetensorsSource

        source = QuantizedSafetensorsSource(path, config, dtype, quantize)
    else:
        source = SafetensorsSource(path, config, dtype)
    try:
        return build_from_source(
            source, model_cls, device=device, streaming=streaming, max_context=max_context
        )
    except BaseException:
        source.close()
        raise


def build_streaming_model_gguf(
    path: str | Path,
    *,
    device: torch.device | str,
    dtype: torch.dtype | None,
    streaming: StreamingConfig,
    max_context: int | None = None,
) -> tuple[ModelConfig, DecoderLM, Tokenizer]:
    """``(config, model, tokenizer)`` for a GGUF file whose layers stream in their packed form.

    ``dtype`` means what it means for `infer.gguf.load_gguf` (``None``: float32
    activations, bfloat16 packed products). The layers are converted to the packed
    modules' storage once, at load, into a temporary file; the embedding, ``lm_head``
    and final norm stay resident.
    """
    from infer.gguf.tokenizer import gguf_tokenizer
    from infer.models import model_class
    from infer.streaming.gguf_source import GGUFSource

    source = GGUFSource(path, dtype=dtype)
    try:
        model = build_from_source(
            source, model_class(source.config), device=device, streaming=streaming, max_context=max_context
        )
    except BaseException:
        source.close()
        raise
    return source.config, model, gguf_tokenizer(source.gguf, source.config)


def _check_skeleton(model: DecoderLM, source: WeightSource, *, layers_only: bool = False) -> None:
    """Every layer tensor of the model has a tensor in the source with the same shape, and the reverse."""
    for i, layer in enumerate(model.layers):
        refs = source.layer_tensors(i)
        expected = dict(layer.state_dict(keep_vars=True))
        missing = sorted(set(expected) - set(refs))
        unexpected = sorted(set(refs) - set(expected))
        if missing:
            raise ValueError(f"{source.description}: missing tensor(s) for layer {i}: {missing}")
        if unexpected:
            raise ValueError(f"{source.description}: unexpected tensor(s) for layer {i}: {unexpected}")
        for name, ref in refs.items():
            want = expected[name]
            if tuple(want.shape) != ref.shape:
                raise ValueError(
                    f"{source.description}: tensor {ref.key!r} has shape {list(ref.shape)}, "
                    f"expected {list(want.shape)} for layers.{i}.{name}"
                )
            if want.dtype.is_floating_point != ref.dtype.is_floating_point:
                raise ValueError(
                    f"{source.description}: tensor {ref.key!r} has dtype {ref.dtype}, expected {want.dtype}"
                )
    if layers_only:
        return
    for name, ref in (
        (EMBED, source.tensor(EMBED)),
        (HEAD, source.tensor(HEAD)),
        (NORM, source.tensor(NORM)),
    ):
        want = model.get_parameter(name)
        if tuple(want.shape) != ref.shape:
            raise ValueError(
                f"{source.description}: tensor {ref.key!r} has shape {list(ref.shape)}, "
                f"expected {list(want.shape)}"
            )


def _read(source: WeightSource, ref: TensorRef, device: torch.device) -> torch.Tensor:
    host = torch.empty(ref.shape, dtype=ref.dtype)
    source.read_into(ref, host)
    return host if device.type == "cpu" else host.to(device)


def _place_resident(model: DecoderLM, source: WeightSource, plan: MemoryPlan, device: torch.device) -> None:
    for i in plan.resident_layers:
        layer = model.layers[i]
        for name, ref in source.layer_tensors(i).items():
            module_name, _, attr = name.rpartition(".")
            module = layer.get_submodule(module_name) if module_name else layer
            if attr in module._buffers:  # packed modules hold their weights as buffers
                module._buffers[attr] = _read(source, ref, device)
            else:
                assign_parameter(layer, name, _read(source, ref, device))
    model.rotary.to(device)
    place = getattr(source, "place_nonlayer", None)
    if callable(place):  # the source loaded embedding, head and norm itself (GGUF: packed)
        place(model, device)
        return
    assign_parameter(model, NORM, _read(source, source.tensor(NORM), device))
    tied = model.config.tie_word_embeddings
    if plan.head_resident:
        assign_parameter(model, HEAD, _read(source, source.tensor(HEAD), device))
        if tied:
            model.embed_tokens.weight = model.lm_head.weight  # one tensor, as in the resident model
    if plan.embed_resident and not (tied and plan.head_resident):
        assign_parameter(model, EMBED, _read(source, source.tensor(EMBED), device))
    if not plan.embed_resident:
        model.embed_tokens = StreamedEmbedding(source, source.tensor(EMBED), device)  # type: ignore[assignment]


def _host_cache_units(plan: MemoryPlan, host_budget: int) -> dict[int, int]:
    """Units kept in the pinned host cache after their first read: the first ones that fit."""
    cached: dict[int, int] = {}
    used = 0
    for unit in plan.units:
        if used + unit.nbytes > host_budget:
            break
        cached[unit.index] = unit.nbytes
        used += unit.nbytes
    return cached


def _transport(
    source: WeightSource, plan: MemoryPlan, streaming: StreamingConfig, device: torch.device
) -> Transport:
    if device.type == "cpu":
        if streaming.host_budget_bytes:
            plan.notes.append(
                "host_memory_budget is ignored on CPU: the page cache of the checkpoint plays that role"
            )
        return CpuTransport(source, plan.num_buffers, plan.buffer_bytes)
    if device.type == "cuda":
        cached = _host_cache_units(plan, streaming.host_budget_bytes)
        return CudaTransport(
            source,
            device,
            plan.num_buffers,
            plan.buffer_bytes,
            pin_memory=streaming.pin_memory,
            cached_units=cached,
            all_cached=len(cached) == len(plan.units),
            blocking=not streaming.prefetch,
        )
    raise ValueError(f"layer streaming supports cpu and cuda devices, not {device}")


def build_from_source(
    source: WeightSource,
    model_cls: Callable[[ModelConfig], nn.Module],
    *,
    device: torch.device | str,
    streaming: StreamingConfig,
    max_context: int | None = None,
) -> DecoderLM:
    """`build_streaming_model` for any `WeightSource` (safetensors, GGUF later, a test's slowed source)."""
    streaming.validate()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    model = source.build_skeleton(model_cls)
    source_places_nonlayer = callable(getattr(source, "place_nonlayer", None))
    if source_places_nonlayer and streaming.resident_embeddings is False:
        raise ValueError(f"{source.description}: this source keeps the embedding and lm_head resident")
    _check_skeleton(model, source, layers_only=source_places_nonlayer)
    small = sum(b.numel() * b.element_size() for b in model.rotary.buffers())
    small += int(getattr(source, "workspace_extra", 0))
    if device.type == "cpu":  # host memory is device memory: the reader's conversion buffer counts
        small += int(getattr(source, "scratch_bytes", 0))
    dtype = model.dtype if source_places_nonlayer else source.tensor(NORM).dtype
    plan = plan_memory(source, streaming, dtype=dtype, max_context=max_context, small_extra=small)
    open_all = getattr(source, "open_all", None)
    if callable(open_all):
        open_all()
    _place_resident(model, source, plan, device)
    stats = StreamingStats(
        peak_weight_bytes=plan.weight_bytes,
        planned_bytes=plan.total,
        resident_layers=len(plan.resident_layers),
        streamed_layers=plan.num_layers - len(plan.resident_layers),
    )
    pipeline: Pipeline | None = None
    if plan.units:
        origin = time.perf_counter()
        gpu_origin = None
        if device.type == "cuda":
            event = cuda_event()
            event.record(torch.cuda.current_stream(device))
            gpu_origin = (event, origin)
        pipeline = Pipeline(
            plan.units,
            _transport(source, plan, streaming, device),
            prefetch=streaming.prefetch,
            stats=stats,
            on_progress=streaming.on_progress,
            trace=streaming.trace,
            clock_origin=origin,
            gpu_origin=gpu_origin,
        )
        if not plan.head_resident:
            model.lm_head = StreamedHead(pipeline, plan.head_unit_list, model.config.vocab_size)  # type: ignore[assignment]
    model.executor = StreamingExecutor(model, plan, pipeline, stats)
    return model.eval()
