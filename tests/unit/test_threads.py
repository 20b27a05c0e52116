"""`infer.host.threads.release_openmp_workers`: the calling thread's OpenMP pool goes, so the engine's
thread holds the only one (two live pools halved every step's speed: `infer.host.threads`)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator

import pytest
import torch

from infer.host.threads import release_openmp_workers


def _threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


@pytest.fixture
def two_threads() -> Iterator[None]:
    """At least two OpenMP threads (an xdist worker runs on one): a pool with workers to release."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
@pytest.mark.usefixtures("two_threads")
def test_release_frees_the_calling_threads_pool() -> None:
    def body(out: list[int]) -> None:  # a fresh thread: its pool is its own, the test's is untouched
        a = torch.randn(256, 256)
        for _ in range(3):
            a = (a @ a).tanh()  # parallel regions: this thread now holds a pool of workers
        out.append(_threads())
        assert release_openmp_workers()
        out.append(_threads())
        (a @ a).sum()  # the thread may run torch again: a new pool, as before
        out.append(_threads())

    before = _threads()
    counts: list[int] = []
    t = threading.Thread(target=body, args=(counts,))
    t.start()
    t.join()
    with_pool, released, again = counts
    print(f"\nthreads: {before} before, {with_pool} with the pool, {released} released, {again} again")
    assert with_pool > before  # the thread itself and its worker(s)
    assert released == with_pool - (torch.get_num_threads() - 1)  # the workers are gone
    assert again == with_pool
