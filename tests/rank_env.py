"""What the multi-process tests give each rank: a free port and torchrun's environment variables."""

from __future__ import annotations

import os
import socket
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def torchrun(ranks: int, log_dir: Path) -> list[str]:
    """``python -m torch.distributed.run`` for ``ranks`` local processes on a free port, logging
    under ``log_dir`` (without ``--log-dir`` it makes a ``torchelastic_*`` directory in /tmp and
    never removes it)."""
    return ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--master-port", str(free_port()), "--log-dir", str(log_dir)]  # fmt: skip


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment of rank ``rank`` of ``world`` (one thread; infer from this checkout's src)."""
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(SRC),
    }
