"""Process groups of a tensor x pipeline parallel run, on `torch.distributed`.

``world = tensor_parallel x pipeline_parallel`` ranks: rank ``r`` is stage ``r // T`` of
the pipeline and rank ``r % T`` of its stage's tensor-parallel group, so the ranks of one
stage are consecutive (on one node under ``torchrun``: tensor parallelism needs the fast
links). Each tensor-parallel rank talks to the same tensor-parallel rank of the next
stage, and the last stage broadcasts the logits down its "column" of ranks.

If no process group exists, `setup` initializes one from torchrun's environment variables
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): gloo on CPU, NCCL on CUDA,
with a timeout, so a dead rank makes the others fail instead of waiting forever.
"""

from __future__ import annotations

import atexit
import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
T = TypeVar("T")

# Exception types that cross ranks as themselves (others arrive as RuntimeError).
_PORTABLE: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "FileNotFoundError": FileNotFoundError,
    "OSError": OSError,
    "KeyError": KeyError,
    "RuntimeError": RuntimeError,
}


@dataclass(frozen=True)
class Parallel:
    """This rank's place in a ``tensor_parallel x pipeline_parallel`` run."""

    tensor_parallel: int
    pipeline_parallel: int
    rank: int
    world: int
    tp_group: dist.ProcessGroup  # the ranks of this stage
    column_group: dist.ProcessGroup  # the ranks of every stage with this tensor-parallel rank
    device: torch.device

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel

    @property
    def stage(self) -> int:
        return self.rank // self.tensor_parallel

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pipeline_parallel - 1

    def stage_rank(self, stage: int) -> int:
        """The global rank of this tensor-parallel rank in ``stage``."""
        return stage * self.tensor_parallel + self.tp_rank


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, found {value!r}")
    return value


def setup(
    tensor_parallel: int, pipeline_parallel: int, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Parallel:
    """The `Parallel` of this process; initializes the default process group when there is none."""
    tp = _positive("tensor_parallel", tensor_parallel)
    pp = _positive("pipeline_parallel", pipeline_parallel)
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch")
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(
                f"tensor_parallel={tp} x pipeline_parallel={pp} needs {tp * pp} processes: "
                "run under torchrun "
                f"(torchrun --nproc-per-node {tp * pp} ...) or initialize torch.distributed first; "
                f"missing environment variables {missing}"
            )
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(_shutdown)  # ours to close: before the interpreter tears torch down
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != tp * pp:
        raise ValueError(
            f"tensor_parallel={tp} x pipeline_parallel={pp} = {tp * pp} processes, "
            f"but the world size is {world}"
        )
    if device.type == "cuda" and device.index is None:
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    tp_group: dist.ProcessGroup | None = None
    column_group: dist.ProcessGroup | None = None
    for stage in range(pp):  # every rank creates every group, in the same order
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks)
        if rank in ranks and isinstance(group, dist.ProcessGroup):
            tp_group = group
    for t in range(tp):
        ranks = [stage * tp + t for stage in range(pp)]
        group = dist.new_group(ranks)
        if rank in ranks and isinstance(group, dist.ProcessGroup):
            column_group = group
    assert tp_group is not None and column_group is not None
    return Parallel(tp, pp, rank, world, tp_group, column_group, device)


def _shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def agree(parallel: Parallel | None, work: Callable[[], T]) -> T:
    """Run ``work`` on every rank; if it raised on any, raise that error on all of them.

    Loading has no collectives, so a rank that fails would otherwise leave the others
    waiting in their first collective. Here every rank reports, then all raise the first
    failing rank's error (same type for the common ones), or all go on.
    """
    if parallel is None:
        return work()
    result: T | None = None
    failure: tuple[str, str] | None = None
    try:
        result = work()
    except Exception as e:
        failure = (type(e).__name__, str(e))
    reports: list[Any] = [None] * parallel.world
    dist.all_gather_object(reports, failure)
    for rank, report in enumerate(reports):
        if report is not None:
            kind, message = report
            cls = _PORTABLE.get(kind, RuntimeError)
            text = message if kind in _PORTABLE else f"{kind}: {message}"
            raise cls(f"rank {rank}: {text}")
    assert result is not None
    return result


def shared_seed(parallel: Parallel) -> int:
    """A random seed drawn on rank 0 and sent to every rank."""
    box = [torch.seed() % 2**63 if parallel.rank == 0 else 0]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def broadcast_object(parallel: Parallel, value: T) -> T:
    """Rank 0's ``value`` on every rank (a chat line read on rank 0, whose stdin torchrun feeds)."""
    box: list[Any] = [value if parallel.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    result: T = box[0]
    return result


__all__ = ["DEFAULT_TIMEOUT_S", "Parallel", "agree", "broadcast_object", "setup", "shared_seed"]
