"""`infer.engine.chunks`: the prompt chunk read while nobody waits is measured once per CPU and
model shape, when a prompt first needs it, through the first block alone, and then used.

The tiny models have 256 positions: the tests shrink the candidates to fit them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import infer
from infer.engine import Engine, chunks
from infer.params import SamplingParams
from infer.quant import routes

CANDIDATES = (16, 32, 64, 128)


@pytest.fixture
def table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A route table of this test's own, and candidates that fit the tiny models."""
    monkeypatch.setenv("INFER_ROUTES_DIR", str(tmp_path))
    monkeypatch.setattr(chunks, "CANDIDATES", CANDIDATES)
    monkeypatch.setattr(chunks, "REFERENCE", 128)
    routes.forget()
    yield tmp_path
    routes.forget()


def test_the_shortest_chunk_within_the_tolerance_of_the_fastest_is_chosen() -> None:
    assert chunks.choose({512: 1.0, 1024: 0.895, 2048: 0.88, 4096: 0.95}) == 1024  # 0.895 <= 1.02 x 0.88
    assert chunks.choose({512: 1.0, 1024: 0.9, 2048: 0.88, 4096: 0.95}) == 2048
    assert chunks.choose({512: 2.0, 1024: 1.5, 2048: 1.0, 4096: 1.04}) == 2048
    assert chunks.choose({512: 1.0}) == 512


def test_the_measurement_runs_the_first_block_alone_and_leaves_the_model_as_it_was(
    tiny_ckpt_factory: Callable[..., Path], table: Path
) -> None:
    llm = infer.load(tiny_ckpt_factory("llama"))
    model = llm.model
    before = llm.generate(list(range(5, 40)), 6).token_ids
    calls = [0] * len(model.layers)

    def counter(i: int) -> Callable[..., None]:
        def count(*_: Any) -> None:
            calls[i] += 1

        return count

    handles = [layer.register_forward_hook(counter(i)) for i, layer in enumerate(model.layers)]
    try:
        per_token = chunks.measure(model)
    finally:
        for h in handles:
            h.remove()
    print(f"\nms per token by chunk: {per_token}; block calls {calls}")
    assert list(per_token) == list(CANDIDATES) and all(ms > 0 for ms in per_token.values())
    assert calls[0] == 1 + sum(128 // n for n in CANDIDATES)  # the warm-up, then each reading
    assert calls[1:] == [0] * (len(calls) - 1)
    assert not model.layers[1]._forward_pre_hooks
    assert llm.generate(list(range(5, 40)), 6).token_ids == before


def _forwards(llm: infer.LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The tokens of each forward of the model (its ``hidden``), recorded."""
    sizes: list[int] = []
    real = llm.model.hidden

    def hidden(ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        sizes.append(ids.shape[1])
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(llm.model, "hidden", hidden)
    return sizes


def test_the_engine_measures_once_when_a_prompt_needs_it_then_reads_the_table(
    tiny_ckpt_factory: Callable[..., Path], table: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured: list[int] = []

    def measure(model: Any) -> dict[int, float]:
        measured.append(1)
        return {16: 3.0, 32: 1.0, 64: 0.99, 128: 1.2}  # 32: within 2% of the fastest

    monkeypatch.setattr(chunks, "measure", measure)
    path = tiny_ckpt_factory("llama")
    llm = infer.load(path)
    sizes = _forwards(llm, monkeypatch)
    llm.generate(list(range(5, 15)), 1)  # 10 tokens: one forward whatever the chunk
    assert measured == [] and sizes == [10]
    llm.generate(list(range(120, 220)), 1)  # (no prefix shared with the first)
    print(f"\nforwards of a 100-token prompt: {sizes[1:]}")
    assert measured == [1] and sizes[1:] == [32, 32, 32, 4]
    saved = next(iter(routes.table().chunks.values()))
    assert saved["chunk"] == 32 and saved["ms_per_token"]["64"] == 0.99
    routes.forget()  # as another process: the table is read, nothing measured
    again = infer.load(path)
    sizes = _forwards(again, monkeypatch)
    again.generate(list(range(120, 220)), 1)
    assert measured == [1] and sizes == [32, 32, 32, 4]


@pytest.mark.parametrize("how", ["given", "routes off"])
def test_nothing_is_measured_for_a_given_chunk_or_with_routes_off(
    how: str, tiny_ckpt_factory: Callable[..., Path], table: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunks, "measure", lambda model: pytest.fail("measured"))
    llm = infer.load(tiny_ckpt_factory("llama"))
    sizes = _forwards(llm, monkeypatch)
    if how == "given":
        engine = Engine(llm, idle_prefill_chunk=48)
    else:
        monkeypatch.setenv("INFER_ROUTES", "off")
        monkeypatch.setattr(chunks, "DEFAULT", 40)
        engine = Engine(llm)
    try:
        handle = engine.submit(list(range(5, 105)), SamplingParams(max_tokens=1))
        list(handle)
    finally:
        engine.close(drain=False)
    assert sizes == ([48, 48, 4] if how == "given" else [40, 40, 20])


def test_a_forward_hook_never_sees_the_measurement(
    tiny_ckpt_factory: Callable[..., Path], table: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hook on the model (a user's, unscoped) would run on the measurement's random tokens:
    while one acts the chunk is not measured (the default is used) and nothing is kept."""
    monkeypatch.setattr(chunks, "measure", lambda model: pytest.fail("measured under a hook"))
    monkeypatch.setattr(chunks, "DEFAULT", 40)
    llm = infer.load(tiny_ckpt_factory("llama"))
    seen: list[int] = []
    handle = llm.model.layers[0].register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    try:
        llm.generate(list(range(120, 220)), 1)
    finally:
        handle.remove()
    print(f"\nthe hook saw forwards of {seen} tokens")
    assert seen == [40, 40, 20] and not routes.table().chunks
