"""A stalled streaming reader raises ``TimeoutError`` instead of hanging (issue 10).

The source's reads block on an ``Event`` (a hung disk or network file system). A
forward must raise ``TimeoutError`` naming the unit and the source within the
configured ``read_timeout``; while the reader is still stuck, the next forward fails
the same way; once the read returns, forwards work again and give the same logits as
before the stall.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from infer.loader.config import load_config
from infer.loader.options import LoadOptions
from infer.loader.source import StoredTensor
from infer.loader.weights import SafetensorsSource
from infer.models.base import DecoderLM
from infer.streaming import StreamingConfig, build_streamed

TIMEOUT = 0.5


class StallingSource:
    """A `WeightSource` whose reads block while ``stall`` is set, until ``release`` is."""

    def __init__(self, inner: SafetensorsSource) -> None:
        self.inner = inner
        self.description = inner.description
        self.naming = inner.naming
        self.stall = threading.Event()
        self.release = threading.Event()

    def tensors(self) -> Mapping[str, StoredTensor]:
        return self.inner.tensors()

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        if self.stall.is_set():
            self.release.wait()
        self.inner.read_into(name, out, rows)

    def prefetch_hint(self, name: str) -> None:
        self.inner.prefetch_hint(name)

    def close(self) -> None:
        self.inner.close()


def build(path: Path, streaming: StreamingConfig) -> tuple[DecoderLM, StallingSource]:
    source = StallingSource(SafetensorsSource(path))
    model = build_streamed(
        source,
        load_config(path),
        LoadOptions(device=torch.device("cpu"), dtype=torch.float32, streaming=streaming),
    )
    return model, source


def timed_forward(model: DecoderLM, ids: torch.Tensor) -> tuple[BaseException | None, float]:
    start = time.monotonic()
    try:
        with torch.inference_mode():
            model(ids)
    except BaseException as e:
        return e, time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
def test_stalled_reader_times_out_then_recovers(tiny_ckpt_factory: Any, prefetch: bool) -> None:
    path = tiny_ckpt_factory("llama")
    streaming = StreamingConfig(
        layer_group_size=1,
        memory_budget="1GB",
        prefetch=prefetch,
        max_resident_layers=0,
        read_timeout=TIMEOUT,
    )
    model, source = build(path, streaming)
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    try:
        with torch.inference_mode():
            want = model(ids)
        source.stall.set()
        errors = [timed_forward(model, ids) for _ in range(2)]
        for error, seconds in errors:
            print(f"after {seconds:.2f} s: {type(error).__name__}: {error}")
            assert isinstance(error, TimeoutError)
            assert source.description in str(error) and "streaming unit" in str(error)
            assert "read_timeout" in str(error)
        source.stall.clear()
        source.release.set()
        with torch.inference_mode():
            assert torch.equal(model(ids), want)
            assert torch.equal(model(ids), want)
    finally:
        source.release.set()


def test_read_timeout_reaches_the_pipeline(tiny_ckpt_factory: Any) -> None:
    path = tiny_ckpt_factory("llama")
    streaming = StreamingConfig(
        layer_group_size=1, memory_budget="1GB", max_resident_layers=0, read_timeout=TIMEOUT
    )
    model, source = build(path, streaming)
    ids = torch.tensor([[1, 5, 9]])
    timer = threading.Timer(5.0, source.release.set)  # without the setting, the forward waits for this
    try:
        source.stall.set()
        timer.start()
        error, seconds = timed_forward(model, ids)
        print(f"after {seconds:.2f} s: {error!r}")
        assert isinstance(error, TimeoutError)
    finally:
        timer.cancel()
        source.release.set()
