"""`StreamingExecutor`: runs a `DecoderLM`'s layers with most of their weights living outside the device.

It replaces the model's ``executor``: resident layers run as they are; for every
streamed group it takes the group's buffer from the pipeline, points the layers'
parameters at views of that buffer, runs them, points them back at meta
placeholders (so a stray use fails loudly instead of reading another group's
weights) and hands the buffer back for the next load.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from infer.models.base import DecoderLM, StepInputs
from infer.streaming.layout import Slot, Unit
from infer.streaming.pipeline import Pipeline
from infer.streaming.plan import MemoryPlan
from infer.streaming.stats import StreamingStats

Target = tuple[nn.Module, str, bool, torch.Tensor]  # (module, attribute, is a parameter, meta placeholder)


def _target(layer: nn.Module, slot: Slot) -> Target:
    module_name, _, attr = slot.name.rpartition(".")
    module = layer.get_submodule(module_name) if module_name else layer
    placeholder: torch.Tensor | None
    if attr in module._parameters:
        placeholder = module._parameters[attr]
        is_param = True
    elif attr in module._buffers:
        placeholder = module._buffers[attr]
        is_param = False
    else:
        raise ValueError(f"layer {slot.layer}: no parameter or buffer {slot.name!r}")
    assert placeholder is not None
    return module, attr, is_param, placeholder


def _close_pipeline(ref: weakref.ref[Pipeline]) -> None:
    pipeline = ref()
    if pipeline is not None:  # (None: it had no reader thread and was freed with the model)
        pipeline.close()


class StreamingExecutor:
    """Runs the layer stack through the plan's resident layers and streamed groups.

    ``stats`` (a snapshot) holds bytes loaded, load / wait / compute seconds and the
    weight bytes on the device; ``plan`` tells what is resident and what streams.
    """

    def __init__(
        self, model: DecoderLM, plan: MemoryPlan, pipeline: Pipeline | None, stats: StreamingStats
    ) -> None:
        self.plan = plan
        self.pipeline = pipeline
        self._stats = stats
        self.limits = plan.limits
        self._targets: dict[int, list[tuple[Target, Slot]]] = {}
        for unit in plan.layer_units:
            self._targets[unit.index] = [
                (_target(model.layers[s.layer], s), s) for s in unit.slots if s.layer is not None
            ]
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        # The finalizer holds the pipeline weakly: a strong reference would keep alive whatever
        # the pipeline reaches (its source, and from a GGUF source the model and this executor),
        # so nothing of a streamed model would ever be freed, nor its converted-layer files.
        self._finalizer = (
            weakref.finalize(self, _close_pipeline, weakref.ref(pipeline)) if pipeline is not None else None
        )

    # ---- what the lead's API and generation loop read --------------------------

    @property
    def stats(self) -> StreamingStats:
        """A snapshot of the counters (CUDA timings are synchronized first)."""
        if self.pipeline is not None:
            self.pipeline.resolve(block=True)
        return self._stats.copy()

    def reset_stats(self) -> None:
        if self.pipeline is not None:
            self.pipeline.resolve(block=True)
        self._stats.reset()

    @property
    def max_context(self) -> int:
        """Tokens per sequence the KV cache was planned for."""
        return self.limits.max_context

    @property
    def max_prefill_tokens(self) -> int:
        """Tokens per forward the workspace was planned for (feed longer prompts in chunks)."""
        return self.limits.max_prefill_tokens

    def close(self) -> None:
        """Stop the reader thread and release the buffers."""
        if self._finalizer is not None:
            self._finalizer()

    # ---- the walk ---------------------------------------------------------------

    def _check(self, x: torch.Tensor, step: StepInputs) -> None:
        """Refuse a forward the plan has no memory for (in tokens: batches trade with length)."""
        batch, tokens = x.shape[0], x.shape[1]
        lim = self.limits
        cache = step.cache
        keys = cache.max_len if cache is not None else tokens
        hint = (
            f"the memory budget was planned for max_batch_size={lim.max_batch_size} x "
            f"max_context={lim.max_context} cached tokens and max_prefill_tokens={lim.max_prefill_tokens} "
            "per forward: load with a larger "
            "StreamingConfig(max_batch_size=..., max_context=..., max_prefill_tokens=...)"
        )
        per_forward = lim.max_batch_size * lim.max_prefill_tokens
        if batch * tokens > per_forward:
            raise ValueError(
                f"streamed forward of {batch} x {tokens} tokens exceeds the plan; feed the prompt in "
                f"chunks of at most {per_forward // batch} tokens with a KV cache, or {hint}"
            )
        if cache is not None and cache.batch_size * cache.max_len > lim.max_batch_size * lim.max_context:
            raise ValueError(
                f"KV cache of {cache.batch_size} x {cache.max_len} tokens exceeds the plan; {hint}"
            )
        if batch * tokens * keys > lim.max_batch_size * lim.max_prefill_tokens * lim.max_context:
            raise ValueError(
                f"streamed forward of {batch} x {tokens} tokens over {keys} keys exceeds the plan; {hint}"
            )

    def _bind(self, unit: Unit, buffer: int) -> None:
        assert self.pipeline is not None
        key = (unit.index, buffer)
        views = self._views.get(key)
        if views is None:
            flat = self.pipeline.transport.flat(buffer)
            views = [slot.view(flat) for _, slot in self._targets[unit.index]]
            self._views[key] = views
        for ((module, attr, is_param, _), _slot), view in zip(self._targets[unit.index], views, strict=True):
            if is_param:
                module._parameters[attr] = view  # type: ignore[assignment]
            else:
                module._buffers[attr] = view

    def _unbind(self, unit: Unit) -> None:
        for (module, attr, is_param, placeholder), _ in self._targets[unit.index]:
            if is_param:
                module._parameters[attr] = placeholder  # type: ignore[assignment]
            else:
                module._buffers[attr] = placeholder

    def run_layers(self, model: DecoderLM, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        self._check(x, step)
        self._stats.forwards += 1
        for i in self.plan.resident_layers:
            x = model.run_layer(i, model.layers[i], x, step)
        for unit in self.plan.layer_units:
            assert self.pipeline is not None
            _, buffer = self.pipeline.get(unit.index)
            try:
                self._bind(unit, buffer)
                for i in unit.layers:
                    x = model.run_layer(i, model.layers[i], x, step)
            except BaseException:
                self._unbind(unit)
                self.pipeline.abort()
                raise
            self._unbind(unit)
            self.pipeline.done(unit.index, buffer)
        return x
