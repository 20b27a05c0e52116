"""A weight source written from the `WeightSource` Protocol alone loads in every mode.

`RangeSource` reads a safetensors checkpoint the way an HTTP client with range requests
would: one ``fetch(start, stop)`` of the header, then a ranged fetch per tensor (or per
row range). It knows nothing of infer's loaders; resident, streamed and quantized
models built from it must equal the ones built from the file source, and the fetches
show that a streamed model reads only what it needs, when it needs it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch

import infer
from infer.assembly.build import ModelBuilder, load_model
from infer.assembly.options import LoadOptions
from infer.loader.config import load_config
from infer.loader.source import StoredTensor
from infer.loader.weights import SafetensorsSource
from infer.streaming import build_streamed

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
IDS = torch.randint(0, 260, (1, 12), generator=torch.Generator().manual_seed(0))

Fetch = Callable[[int, int], bytes]


class RangeSource:
    """A single-file safetensors checkpoint behind ``fetch(start, stop) -> bytes``."""

    naming = "hf"

    def __init__(self, fetch: Fetch, description: str) -> None:
        self.fetch = fetch
        self.description = description
        (n,) = struct.unpack("<Q", fetch(0, 8))
        header = json.loads(fetch(8, 8 + n))
        header.pop("__metadata__", None)
        self._tensors: dict[str, StoredTensor] = {}
        self._start: dict[str, int] = {}
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            self._tensors[name] = StoredTensor(
                name, tuple(entry["shape"]), DTYPES[entry["dtype"]], end - begin
            )
            self._start[name] = 8 + n + begin

    def tensors(self) -> Mapping[str, StoredTensor]:
        return self._tensors

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        info = self._tensors[name]
        first, last = rows if rows is not None else (0, info.rows)
        start = self._start[name] + first * info.row_bytes
        data = self.fetch(start, start + (last - first) * info.row_bytes)
        out.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def prefetch_hint(self, name: str) -> None:
        pass

    def close(self) -> None:
        pass


def ranged(path: Path) -> tuple[RangeSource, list[tuple[int, int]]]:
    blob = (path / "model.safetensors").read_bytes()
    fetches: list[tuple[int, int]] = []

    def fetch(start: int, stop: int) -> bytes:
        fetches.append((start, stop))
        return blob[start:stop]

    return RangeSource(fetch, f"range://{path.name}"), fetches


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_every_mode_matches_the_file_source(tiny_ckpt_factory: Callable[..., Path], arch: str) -> None:
    path = tiny_ckpt_factory(arch)
    config = load_config(path)
    streaming = infer.StreamingConfig(memory_budget="64MB", max_resident_layers=0, resident_embeddings=False)
    with torch.inference_mode():
        for quantize in (None, "int8"):
            options = LoadOptions(dtype=torch.float32, quantize=quantize)
            want = load_model(ModelBuilder(SafetensorsSource(path), config, options))(IDS)
            source, _ = ranged(path)
            resident = load_model(ModelBuilder(source, config, options))(IDS)
            assert torch.equal(resident, want), (arch, quantize)
        source, fetches = ranged(path)
        streamed = LoadOptions(device=torch.device("cpu"), dtype=torch.float32, streaming=streaming)
        model = build_streamed(ModelBuilder(source, config, streamed))
        header_only = len(fetches)
        assert torch.equal(
            model(IDS),
            load_model(ModelBuilder(SafetensorsSource(path), config, LoadOptions(dtype=torch.float32)))(IDS),
        )
    per_forward = len(fetches) - header_only
    print(f"{arch}: {header_only} fetches at load, {per_forward} for one streamed forward")
    # A float checkpoint streams straight from the source: at load only the header (2 fetches)
    # and the final norm, which stays resident, are read.
    assert header_only == 3
    assert per_forward > config.num_hidden_layers
