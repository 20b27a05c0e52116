"""The server steps compiled code of its own (issue 26): what it queues at start, and a package
built in the background while it runs, picked up by the next request.

A tiny checkpoint (a temporary one: built only under ``INFER_AOT=on``, set here in the
environment), the package cache and the machine-wide build lock under the test's
``tmp_path``; ``INFER_BUILD_WHEN_BUSY=1`` lets the builder run while the rest of the suite keeps
the CPUs busy; every process the test starts is reaped at teardown.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

import infer
import infer.aot as aot
from infer.aot import builder
from infer.serve.server import prepare_packages

from .conftest import LiveServer

BUILD_TIMEOUT_S = 600

pytestmark = pytest.mark.slow  # builds a package: minutes of compiler


@pytest.fixture
def packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reap_processes: Callable[[], list[int]]
) -> Iterator[Path]:
    """Packages on and built (``INFER_AOT=on``), in a directory of this test's own."""
    monkeypatch.setenv("INFER_AOT", "on")  # read when used (`infer.aot.settings`)
    monkeypatch.setattr(aot.settings, "CACHE_DIR", tmp_path / "aot")
    monkeypatch.setattr(aot.queue, "_MISSING", {})
    monkeypatch.setattr(builder, "RUN_LOCK", tmp_path / "run.lock")
    monkeypatch.setenv("INFER_BUILD_WHEN_BUSY", "1")
    yield tmp_path / "aot"  # (`reap_processes` kills what is left at teardown)


def test_a_server_queues_its_steps_at_start(
    tiny_ckpt_factory: Callable[..., Path], packages: Path, tmp_path: Path
) -> None:
    """`prepare_packages` queues six packages, the likeliest first: one row and 2-16 rows, greedy,
    then sampled (OpenAI's default temperature 1), then filtered; nothing for a single-row
    engine's 2-16 rows. (The machine's build lock is held: the builder waits, builds nothing.)"""
    llm = infer.load(tiny_ckpt_factory("llama"))
    fd = os.open(tmp_path / "run.lock", os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        keys = prepare_packages(llm.start_engine(max_batch=16))
        kinds = [(k.split("-b")[1].rsplit("-", 1)) for k in keys]
        print(f"\nqueued: {kinds}")
        assert kinds == [["1", "100"], ["2-16", "100"], ["1", "000"], ["2-16", "000"], ["1", "010"],
                         ["2-16", "010"]]  # fmt: skip
        assert builder.queued(packages) == sorted(keys)
        requests = (packages / "queue").glob("*.json")  # the builder's order: newest first
        order = [p.stem for p in sorted(requests, key=lambda p: -p.stat().st_mtime_ns)]
        print(f"built in the order: {[k.split('-b')[1] for k in order]}")
        assert order == keys
        assert prepare_packages(llm.engine) == []  # queued already
        other = infer.load(tiny_ckpt_factory("qwen3"))
        keys = prepare_packages(other.start_engine(max_batch=1))
        assert [k.split("-b")[1] for k in keys] == ["1-100", "1-000", "1-010"]
    finally:
        os.close(fd)


def test_the_server_steps_its_package_once_built(
    tiny_ckpt_factory: Callable[..., Path], packages: Path, live_server: LiveServer
) -> None:
    """A request to a fresh server decodes eagerly and queues its shape; the background builder
    builds it while the server runs; the next request decodes from the package, with the same
    tokens (bounded: the build of a tiny model takes ~20-60 s)."""
    llm = infer.load(tiny_ckpt_factory("llama"))
    assert llm.execution.packages is not None
    base = live_server(llm)
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    ask: dict[str, Any] = {"model": model, "prompt": [5, 9, 200, 31], "max_tokens": 12, "temperature": 0}
    first = client.completions.create(**ask, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert llm.execution.packaged_steps == 0
    queued = builder.queued(packages) or aot.building(packages)
    assert queued, "the missed shape was not queued"
    t0 = time.monotonic()
    while aot.building(packages) and time.monotonic() - t0 < BUILD_TIMEOUT_S:
        time.sleep(0.5)
    built = time.monotonic() - t0
    log = (packages / builder.LOG).read_text() if (packages / builder.LOG).exists() else ""
    assert list(packages.glob("*-b1-100.pt2")), f"not built in {built:.0f} s; builder log:\n{log}"
    time.sleep(aot.PackageCache.RECHECK_S)  # the server looks at the path again within this
    second = client.completions.create(**ask, extra_body={"ignore_eos": True, "return_token_ids": True})
    steps = llm.execution.packaged_steps
    print(f"\nbuilt {built:.0f} s after the first request; the second decoded {steps} steps from it")
    # Every decode step of the second request, and its one-token prefill (the prompt is cached).
    assert steps >= 11
    assert second.choices[0].token_ids == first.choices[0].token_ids
    assert second.choices[0].text == first.choices[0].text
