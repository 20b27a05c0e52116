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
from pathlib import Path
from typing import Any

import pytest
import torch
from wrapped_source import WrappedSource, stream_every_layer

from infer.loader.weights import SafetensorsSource
from infer.models.base import DecoderLM

TIMEOUT = 0.5


class StallingSource(WrappedSource):
    """A `WeightSource` whose reads block while ``stall`` is set, until ``release`` is."""

    def __init__(self, inner: SafetensorsSource) -> None:
        super().__init__(inner)
        self.stall = threading.Event()
        self.release = threading.Event()

    def before_read(self, out: torch.Tensor) -> None:
        if self.stall.is_set():
            self.release.wait()


def build(path: Path, **settings: Any) -> tuple[DecoderLM, StallingSource]:
    source = StallingSource(SafetensorsSource(path))
    return stream_every_layer(source, path, **settings), source


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
    model, source = build(path, prefetch=prefetch, read_timeout=TIMEOUT)
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
    model, source = build(path, read_timeout=TIMEOUT)
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
