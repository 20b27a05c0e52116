"""Build a streamed `DecoderLM`: the resident build's walk (`ModelBuilder`) with another destination.

With ``lazy`` placement, float tensors needing only a dtype conversion stay in the checkpoint and
what the placement converted goes to the `StreamStore`'s local file; the memory plan decides what
is read back resident, and the `StreamingExecutor` takes over the walk (docs/streaming.md).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from infer.assembly.build import ModelBuilder, release_freed_memory, reset_buffers
from infer.assembly.names import Entry
from infer.assembly.options import LoadOptions
from infer.assembly.place import assign_parameter
from infer.loader.config import ModelConfig
from infer.loader.source import WeightSource
from infer.models.base import DecoderLM
from infer.streaming.config import StreamingConfig
from infer.streaming.executor import StreamingExecutor
from infer.streaming.layout import align_up
from infer.streaming.pipeline import Pipeline, Recorder
from infer.streaming.plan import MemoryPlan, PlanInputs, plan_memory
from infer.streaming.stats import StreamingStats
from infer.streaming.store import StreamStore, TensorRef, WeightStore
from infer.streaming.transport import CpuTransport, CudaTransport, Transport, cuda_event

# Packed modules dequantize tile by tile (prefill, non-CPU devices): their workspace.
PACKED_WORKSPACE = 32 * 2**20
EMBED, HEAD = "embed_tokens.weight", "lm_head.weight"


def _module_bytes(model: torch.nn.Module, paths: list[str]) -> int:
    """Bytes of the tensors of modules ``paths``, counting shared storage once."""
    seen: set[int] = set()
    total = 0
    for path in paths:
        for t in model.get_submodule(path).state_dict(keep_vars=True).values():
            if t.is_meta or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += align_up(t.numel() * t.element_size())
    return total


def _read(store: WeightStore, ref: TensorRef, device: torch.device) -> torch.Tensor:
    host = torch.empty(ref.shape, dtype=ref.dtype)
    store.read_into(ref, host)
    return host if device.type == "cpu" else host.to(device)


def _place_layer(
    model: DecoderLM, index: int, refs: dict[str, TensorRef], store: WeightStore, device: torch.device
) -> None:
    layer = model.layers[index]
    for name, ref in refs.items():
        module_name, _, attr = name.rpartition(".")
        module = layer.get_submodule(module_name) if module_name else layer
        if attr in module._buffers:  # packed modules hold their weights as buffers
            module._buffers[attr] = _read(store, ref, device)
        else:
            assign_parameter(layer, name, _read(store, ref, device))


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
    store: WeightStore, plan: MemoryPlan, streaming: StreamingConfig, device: torch.device
) -> Transport:
    if device.type == "cpu":
        if streaming.host_budget_bytes:
            plan.notes.append(
                "host_memory_budget is ignored on CPU: the page cache of the checkpoint plays that role"
            )
        return CpuTransport(store, plan.num_buffers, plan.buffer_bytes)
    if device.type == "cuda":
        cached = _host_cache_units(plan, streaming.host_budget_bytes)
        return CudaTransport(
            store,
            device,
            plan.num_buffers,
            plan.buffer_bytes,
            pin_memory=streaming.pin_memory,
            cached_units=cached,
            all_cached=len(cached) == len(plan.units),
            blocking=not plan.prefetch,
        )
    raise ValueError(f"layer streaming supports cpu and cuda devices, not {device}")


@dataclass
class _Walk:
    """The model after the streamed walk: layers on meta with their refs, the non-layer modules."""

    builder: ModelBuilder
    store: StreamStore
    layer_refs: dict[int, dict[str, TensorRef]]  # layer index -> its tensors as streamed
    deferred_nonlayer: dict[str, Entry]  # float embedding / head / small modules left in the checkpoint


def _walk(builder: ModelBuilder, streaming: StreamingConfig) -> _Walk:
    """Place every layer lazily into the stream store, then the modules outside the layers."""
    streaming.validate()
    if not streaming.head:  # activations only: the head is never placed
        builder.nonlayer = [p for p in builder.nonlayer if p != "lm_head"]
        builder.opts = dataclasses.replace(builder.opts, head=False)
    model, source, options, partition = builder.model, builder.source, builder.options, builder.partition
    dtype, quantize = options.dtype, options.quantize
    store = StreamStore(source, validate=options.validate)
    try:
        layer_refs: dict[int, dict[str, TensorRef]] = {}
        for i, group in enumerate(builder.layer_groups):
            if not group:
                continue  # a layer of another pipeline stage
            deferred = {e.param: e for e in builder.place(group, lazy=True)}
            layer, prefix = model.layers[i], f"layers.{i}."
            refs: dict[str, TensorRef] = {}
            converted: dict[str, torch.Tensor] = {}
            for name, t in layer.state_dict(keep_vars=True).items():
                entry = deferred.get(prefix + name)
                if entry is not None:
                    refs[name] = store.source_ref(entry.stored, dtype)
                else:
                    converted[name] = t
            refs.update(store.write(f"layers.{i}", converted))
            layer.to("meta")
            layer_refs[i] = refs
            del converted
            release_freed_memory()  # glibc keeps the conversion's freed blocks: one layer's at most
        # Outside the layers: a float embedding and head may stream; converted ones stay resident.
        nonlayer_entries = [e for p in builder.nonlayer for e in builder.modules[p].values()]
        lazy_nonlayer = (  # a pipeline stage keeps its embedding / head resident
            quantize is None
            and partition is None
            and not any(e.stored.packed or e.fix for e in nonlayer_entries)
        )
        deferred_nonlayer: dict[str, Entry] = {}
        if lazy_nonlayer and streaming.resident_embeddings is not True:
            deferred_nonlayer = {e.param: e for e in builder.place(builder.nonlayer, lazy=True)}
        elif streaming.resident_embeddings is False:
            raise ValueError(
                f"{source.description}: a packed or quantized embedding and head stay resident "
                "(resident_embeddings=False needs float ones)"
            )
        else:
            builder.place(builder.nonlayer)
    except BaseException:
        store.close()
        raise
    return _Walk(builder, store, layer_refs, deferred_nonlayer)


def _streaming(options: LoadOptions) -> StreamingConfig:
    if not isinstance(options.streaming, StreamingConfig):
        raise ValueError(
            f"a streamed build needs LoadOptions.streaming (a StreamingConfig), got {options.streaming!r}"
        )
    return options.streaming


def plan_streamed(
    source: WeightSource, config: ModelConfig, options: LoadOptions, *, max_context: int | None = None
) -> MemoryPlan:
    """The memory plan `build_streamed` would make, without building (``source`` is closed after).

    Float checkpoints are not read at all (``options.validate`` is not applied); a packed
    or quantized one is converted once.
    """
    streaming = _streaming(options)
    options = dataclasses.replace(options, validate=False)
    walk = _walk(ModelBuilder(source, config, options), streaming)
    try:
        return _plan(walk, streaming, options.dtype, options.device, max_context)
    finally:
        walk.store.close()


def build_streamed(builder: ModelBuilder, *, max_context: int | None = None) -> DecoderLM:
    """The builder's model with its layers streaming from its source under the memory budget of
    its options (``options.streaming``, a `StreamingConfig`).

    The same walk as `infer.assembly.build.load_model`, with the stream store as its
    destination; ``max_context`` overrides ``streaming.max_context``. Raises `BudgetError`
    (a `ValueError`) when settings the user gave cannot fit the budget, with what would
    fit. On success the model owns the source: it is closed with the executor. A builder
    with a ``partition``: only one pipeline stage's layers (`infer.distributed`), streamed
    under this budget.
    """
    options = builder.options
    streaming = _streaming(options)
    device, dtype = options.device, options.dtype
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    walk = _walk(builder, streaming)
    model, store = walk.builder.model, walk.store
    try:
        plan = _plan(walk, streaming, dtype, device, max_context)
        for i in plan.resident_layers:
            _place_layer(model, i, walk.layer_refs[i], store, device)
        streamed_embed = _place_nonlayer(model, walk, plan, dtype, device)
        reset_buffers(model, device)
        _attach(model, plan, store, streaming, device, streamed_embed)
        release_freed_memory()
    except BaseException:
        store.close()
        raise
    return model.eval()


def _plan(
    walk: _Walk, streaming: StreamingConfig, dtype: torch.dtype, device: torch.device, max_context: int | None
) -> MemoryPlan:
    builder, store, deferred, model = walk.builder, walk.store, walk.deferred_nonlayer, walk.builder.model
    config = builder.config
    small = sum(align_up(b.numel() * 4) for b in model.rotary.buffers())  # RoPE frequencies (float32)
    if device.type == "cpu":  # host memory is device memory: the reader's conversion buffer counts
        small += store.scratch_bytes
    converted = builder.opts.quantize is not None or any(
        e.stored.packed for m in builder.modules.values() for e in m.values()
    )
    small += PACKED_WORKSPACE if converted else 0
    embed = head = None
    fixed: int | None = None
    if EMBED in deferred:
        embed = store.source_ref(deferred[EMBED].stored, dtype)
        if not streaming.head:
            head = None
        elif config.tie_word_embeddings:
            head = embed
        else:
            head = store.source_ref(deferred[HEAD].stored, dtype)
        others = [p for p in builder.nonlayer if p not in ("embed_tokens", "lm_head")]
        small += sum(
            align_up(store.source_ref(deferred[f"{p}.{a}"].stored, dtype).nbytes)
            for p in others
            for a in builder.modules[p]
        )
    else:
        fixed = _module_bytes(model, builder.nonlayer)
    inputs = PlanInputs(
        config=config,
        dtype=dtype,
        layer_refs=list(walk.layer_refs.values()),
        layer_indices=list(walk.layer_refs),
        embed=embed,
        head=head,
        small_bytes=small,
        fixed_nonlayer=fixed,
        description=store.description,
    )
    return plan_memory(inputs, streaming, max_context=max_context)


def _place_nonlayer(
    model: DecoderLM, walk: _Walk, plan: MemoryPlan, dtype: torch.dtype, device: torch.device
) -> TensorRef | None:
    """The embedding, head and the small modules outside the layers, as the plan decided.

    Returns the embedding table when its rows are to be read on demand (the executor's);
    a streamed embedding or head stays on the meta device in the model.
    """
    builder, store, deferred = walk.builder, walk.store, walk.deferred_nonlayer
    if not deferred:  # placed at load (packed / quantized / kept resident): move them
        for path in builder.nonlayer:
            model.get_submodule(path).to(device)
        tied = model.config.tie_word_embeddings
        if plan.head and tied and isinstance(model.embed_tokens, torch.nn.Embedding):
            model.lm_head.weight = model.embed_tokens.weight
        return None
    for name, entry in deferred.items():
        if name in (EMBED, HEAD):
            continue
        assign_parameter(model, name, _read(store, store.source_ref(entry.stored, dtype), device))
    tied = model.config.tie_word_embeddings
    embed_ref = store.source_ref(deferred[EMBED].stored, dtype)
    if plan.head_resident and plan.head:
        head_ref = embed_ref if tied else store.source_ref(deferred[HEAD].stored, dtype)
        assign_parameter(model, HEAD, _read(store, head_ref, device))
        if tied:
            model.embed_tokens.weight = model.lm_head.weight  # one tensor
    if plan.embed_resident and not (tied and plan.head_resident and plan.head):
        assign_parameter(model, EMBED, _read(store, embed_ref, device))
    return None if plan.embed_resident else embed_ref


def _attach(
    model: DecoderLM,
    plan: MemoryPlan,
    store: WeightStore,
    streaming: StreamingConfig,
    device: torch.device,
    embed: TensorRef | None,
) -> None:
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
        recorder = Recorder(
            stats,
            on_progress=streaming.on_progress,
            trace=streaming.trace,
            clock_origin=origin,
            gpu_origin=gpu_origin,
        )
        pipeline = Pipeline(
            plan.units,
            _transport(store, plan, streaming, device),
            prefetch=plan.prefetch,
            recorder=recorder,
            read_timeout=streaming.read_timeout,
        )
    model.executor = StreamingExecutor(model, plan, pipeline, stats, store, embed, device)


__all__ = ["build_streamed", "plan_streamed"]
