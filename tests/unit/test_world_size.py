"""`infer.distributed.runtime.setup` checks ``WORLD_SIZE`` before it joins a process group: a
mismatch or a malformed value is a clear error on every rank, never a half-formed group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from infer.distributed.runtime import setup


@pytest.mark.parametrize(
    ("world", "message"),
    [
        ("3", "tensor_parallel=1 x pipeline_parallel=2 = 2 processes, but the world size is 3"),
        ("two", "WORLD_SIZE='two': expected a positive integer"),
        ("0", "WORLD_SIZE='0': expected a positive integer"),
    ],
)
def test_world_size_is_checked_before_joining(
    monkeypatch: pytest.MonkeyPatch, world: str, message: str
) -> None:
    assert not dist.is_initialized()
    env = {"RANK": "0", "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
        setup(1, 2, torch.device("cpu"), timeout_s=1)
    print(e.value)
    assert not dist.is_initialized()  # refused before any connection (port 1 would never answer)
