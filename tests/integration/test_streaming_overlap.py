"""Prefetch hides transfers behind compute (FR-003, NFR-003, T-003).

The reader is slowed down artificially (a sleep proportional to the bytes read,
calibrated so that loading a forward's weights takes about as long as computing
it). Synchronously, a forward costs compute + transfer; with prefetch the two
overlap and the wall time approaches max(compute, transfer). All bounds are
relative to the compute and transfer times measured in the same test, with one
intra-op thread so that the reader and the compute each have a core.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from wrapped_source import WrappedSource, stream_every_layer

from infer.loader.source import WeightSource
from infer.loader.weights import SafetensorsSource
from infer.models.base import DecoderLM
from infer.testing.synthetic import SyntheticSpec, write_synthetic_checkpoint

SPEC = SyntheticSpec(hidden_size=256, intermediate_size=768, num_hidden_layers=8, vocab_size=1024)
TOKENS = 512
FORWARDS = 8


class SlowSource(WrappedSource):
    """A `WeightSource` whose reads take ``nbytes / rate`` longer."""

    def __init__(self, inner: WeightSource, bytes_per_second: float) -> None:
        super().__init__(inner)
        self.rate = bytes_per_second

    def before_read(self, out: torch.Tensor) -> None:
        time.sleep(out.numel() * out.element_size() / self.rate)


@pytest.fixture
def one_thread() -> Any:
    """One intra-op thread: on 2 shared cores, OpenMP's spin-waiting makes threaded timings erratic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("synthetic-overlap"), SPEC)


def build(path: Path, prefetch: bool, rate: float | None) -> DecoderLM:
    source: WeightSource = SafetensorsSource(path)
    if rate is not None:
        source = SlowSource(source, rate)
    return stream_every_layer(source, path, prefetch=prefetch, max_context=TOKENS, max_prefill_tokens=TOKENS)


def run(model: DecoderLM) -> float:
    ids = torch.arange(TOKENS)[None] % SPEC.vocab_size
    with torch.inference_mode():
        model(ids)  # warm-up (and, with prefetch, the first load is not part of the timed loop)
        model.executor.reset_stats()  # type: ignore[attr-defined]
        start = time.perf_counter()
        for _ in range(FORWARDS):
            model(ids)
        return time.perf_counter() - start


def test_prefetch_overlaps_transfer_and_compute(checkpoint: Path, one_thread: None) -> None:
    fast = build(checkpoint, prefetch=False, rate=None)
    run(fast)
    compute = fast.executor.stats.compute_seconds
    per_forward = sum(u.nbytes for u in fast.executor.plan.units)  # type: ignore[attr-defined]
    rate = FORWARDS * per_forward / compute  # loading a forward's weights takes about one forward's compute

    sync = build(checkpoint, prefetch=False, rate=rate)
    wall_sync = run(sync)
    s = sync.executor.stats
    prefetch = build(checkpoint, prefetch=True, rate=rate)
    wall_prefetch = run(prefetch)
    p = prefetch.executor.stats

    c, t = s.compute_seconds, s.load_seconds
    print(
        f"\n{FORWARDS} forwards of {TOKENS} tokens: compute {c:.3f}s, transfer {t:.3f}s "
        f"(sum {c + t:.3f}s, max {max(c, t):.3f}s); sync wall {wall_sync:.3f}s, "
        f"prefetch wall {wall_prefetch:.3f}s; "
        f"prefetch waited {p.wait_seconds:.3f}s of {p.load_seconds:.3f}s loading "
        f"({100 * p.hidden_fraction:.0f}% hidden)"
    )
    assert s.wait_seconds >= 0.9 * t  # synchronous: every load is waited for
    assert wall_sync >= 0.9 * (c + t)
    # Prefetch: at least half of the smaller of the two is hidden (ideal: all of it).
    assert wall_prefetch <= c + t - 0.5 * min(c, t)
    assert p.wait_seconds <= p.load_seconds - 0.5 * min(c, t)
