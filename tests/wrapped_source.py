"""A checkpoint's reads made slow or stalled on purpose, streamed one layer at a time (streaming tests)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from infer.assembly.build import ModelBuilder
from infer.assembly.options import LoadOptions
from infer.loader.config import load_config
from infer.loader.source import StoredTensor, WeightSource
from infer.models.base import DecoderLM
from infer.streaming import StreamingConfig, build_streamed


class WrappedSource:
    """A `WeightSource`, written from the Protocol alone, reading through ``inner``;
    `before_read` (nothing here) runs before each read."""

    def __init__(self, inner: WeightSource) -> None:
        self.inner = inner
        self.description = inner.description
        self.naming = inner.naming

    def before_read(self, out: torch.Tensor) -> None:
        pass

    def tensors(self) -> Mapping[str, StoredTensor]:
        return self.inner.tensors()

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        self.before_read(out)
        self.inner.read_into(name, out, rows)

    def prefetch_hint(self, name: str) -> None:
        self.inner.prefetch_hint(name)

    def close(self) -> None:
        self.inner.close()


def stream_every_layer(source: WeightSource, path: Path, **settings: Any) -> DecoderLM:
    """Checkpoint ``path`` read through ``source``, streamed on the CPU in float32: one layer a group,
    none resident, under a budget they all fit in; ``settings``: the other `StreamingConfig` fields."""
    streaming = StreamingConfig(layer_group_size=1, memory_budget="1GB", max_resident_layers=0, **settings)
    return build_streamed(
        ModelBuilder(
            source,
            load_config(path),
            LoadOptions(device=torch.device("cpu"), dtype=torch.float32, streaming=streaming),
        ),
    )
