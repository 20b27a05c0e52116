"""`StreamingExecutor`: runs a `DecoderLM` with most of its weights living outside the device.

For every streamed group it takes the group's buffer from the pipeline, points the layers'
parameters at views of it, runs them and points them back at meta placeholders (a stray use
fails loudly); an embedding that does not fit is read row by row from the checkpoint, a head
chunk by chunk of vocabulary rows (docs/streaming.md).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from infer.host import rows
from infer.models.base import DecoderLM, ExecutorLimits, ResidentExecutor, StepInputs
from infer.streaming.layout import Slot, Unit
from infer.streaming.pipeline import Pipeline
from infer.streaming.plan import MemoryPlan
from infer.streaming.stats import StreamingStats
from infer.streaming.store import TensorRef, WeightStore

Target = tuple[nn.Module, str, bool, torch.Tensor]  # (module, attribute, is a parameter, meta placeholder)
NO_HEAD = (
    "this model was loaded with StreamingConfig(head=False): it has no output head and computes no "
    "logits (hook points only: run_with_cache(..., stop_at_layer=<number of blocks>), save_activations); "
    "load it without head=False for logits and generation"
)


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


def _close(pipeline: Pipeline | None, store: WeightStore | None) -> None:
    if pipeline is not None:
        pipeline.close()
    if store is not None:
        store.close()


@dataclass(frozen=True)
class _StreamedEmbedding:
    """An embedding table left in ``store``: a step reads only the rows it looks up."""

    store: WeightStore | None
    table: TensorRef
    device: torch.device | None

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows ``[B, T, D]`` of ``input_ids [B, T]``, on ``device``."""
        assert self.store is not None and self.device is not None
        size, dim = self.table.shape[0], self.table.shape[1]
        flat = input_ids.reshape(-1)  # [B*T]
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= size):
            raise IndexError(f"token id out of range for an embedding of {size} rows")
        found = self.store.read_rows(self.table, flat)  # [B*T, D]
        return found.to(self.device).view(*input_ids.shape, dim)  # [B, T, D]


class StreamingExecutor(ResidentExecutor):
    """Runs the model through the plan's resident layers and streamed groups.

    ``stats`` (a snapshot) holds bytes loaded, load / wait / compute seconds and the
    weight bytes on the device; ``plan`` tells what is resident and what streams.
    ``embed``: the embedding table in ``store`` when its rows are read on demand (None:
    resident); the head streams when the plan keeps it off the device, and is absent (its
    forwards refused) when the plan has none.
    """

    shares_prefixes = False  # a streamed model copies a shared prefix into each row

    def __init__(
        self,
        model: DecoderLM,
        plan: MemoryPlan,
        pipeline: Pipeline | None,
        stats: StreamingStats,
        store: WeightStore | None = None,
        embed: TensorRef | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.plan = plan
        self.pipeline = pipeline
        self._stats = stats
        self._embed = _StreamedEmbedding(store, embed, device) if embed is not None else None
        self._head_units = [] if plan.head_resident else plan.head_unit_list
        self._targets: dict[int, list[tuple[Target, Slot]]] = {}
        for unit in plan.layer_units:
            self._targets[unit.index] = [
                (_target(model.layers[s.layer], s), s) for s in unit.slots if s.layer is not None
            ]
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._finalizer = weakref.finalize(self, _close, pipeline, store)

    # ---- what generation and the API read -----------------------------------------

    @property
    def limits(self) -> ExecutorLimits:
        """The shapes the memory plan reserved room for (generation stays inside them)."""
        return self.plan.limits

    @property
    def stats(self) -> StreamingStats:
        """A snapshot of the counters (CUDA timings are synchronized first)."""
        if self.pipeline is not None:
            self.pipeline.recorder.resolve(block=True)
        return self._stats.copy()

    def reset_stats(self) -> None:
        if self.pipeline is not None:
            self.pipeline.recorder.resolve(block=True)
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
        """Stop the reader thread, release the buffers and close the checkpoint."""
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

    def lookup(self, model: DecoderLM, input_ids: torch.Tensor) -> torch.Tensor:
        """The token rows, read from the checkpoint when the embedding streams."""
        if self._embed is None:
            return super().lookup(model, input_ids)
        return self._embed.lookup(input_ids)

    def head(self, model: DecoderLM, h: torch.Tensor, greedy: bool) -> torch.Tensor:
        if not self.plan.head:
            raise ValueError(NO_HEAD)
        return super().head(model, h, greedy)

    def project(self, model: DecoderLM, x: torch.Tensor, greedy: bool) -> torch.Tensor:
        """The logits, one chunk of vocabulary rows at a time when the head streams.

        In the deterministic mode (the head's ``tile_rows``) each chunk (a multiple of
        `infer.host.rows.COLUMN_TILE` rows, from row 0) runs in the resident head's row and
        column tiles: the same logits, bit for bit.
        """
        if not self._head_units:
            return super().project(model, x, greedy)
        assert self.pipeline is not None
        tile_rows = getattr(model.lm_head, "tile_rows", 0)
        column_tile = getattr(model.lm_head, "column_tile", 0)
        out = x.new_empty(*x.shape[:-1], model.config.vocab_size)  # [..., V]
        for unit in self._head_units:
            _, buffer = self.pipeline.get(unit.index)
            try:
                assert unit.rows is not None
                weight = unit.slots[0].view(self.pipeline.transport.flat(buffer))  # [rows, D]
                out[..., unit.rows[0] : unit.rows[1]] = rows.linear(  # as the resident head
                    x, weight, None, tile_rows, column_tile
                )
            except BaseException:
                self.pipeline.abort()
                raise
            self.pipeline.done(unit.index, buffer)
        return out
