"""Process groups of a tensor x pipeline parallel run, on `torch.distributed`.

Ranks are laid out stage-major (rank ``r`` is stage ``r // T``, tensor-parallel rank ``r % T``).
`setup` initializes a process group from torchrun's environment when none exists (gloo on CPU,
NCCL on CUDA, with a timeout); `Heartbeat` and `agree` make a lost or failed rank fail every rank
by name. See docs/distributed.md, "Running it" and "Failures".
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from infer.sampling import global_seed

DEFAULT_TIMEOUT_S = 300.0
HEARTBEAT_S = 0.5  # each rank bumps its counter in the rendezvous store this often
SILENT_S = 1.5  # a rank whose counter has not moved for this long has stopped answering
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
    heartbeat: Heartbeat | None = field(default=None, compare=False, repr=False)

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


def _env_world_size() -> int:
    """``WORLD_SIZE`` as torchrun sets it: a positive integer."""
    text = os.environ["WORLD_SIZE"]
    try:
        world = int(text)
    except ValueError:
        world = 0
    if world < 1:
        raise ValueError(f"WORLD_SIZE={text!r}: expected a positive integer (as torchrun sets it)")
    return world


def _check_world(tp: int, pp: int, world: int) -> None:
    """``tp * pp`` processes are the world of ``world`` processes."""
    if world != tp * pp:
        raise ValueError(
            f"tensor_parallel={tp} x pipeline_parallel={pp} = {tp * pp} processes, "
            f"but the world size is {world}"
        )


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
        # Checked before joining: a rank that refuses after the group formed leaves the others
        # in the middle of connecting, to fail with a connection error of their own.
        _check_world(tp, pp, _env_world_size())
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(_shutdown)  # ours to close: before the interpreter tears torch down
    world, rank = dist.get_world_size(), dist.get_rank()
    _check_world(tp, pp, world)
    if device.type == "cuda" and device.index is None:
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    # Subgroups take gloo's / NCCL's own default (30 / 10 min) unless told: give them the
    # default group's timeout (ours, or the one its creator chose).
    timeout = datetime.timedelta(seconds=group_timeout(None) or timeout_s)
    tp_group: dist.ProcessGroup | None = None
    column_group: dist.ProcessGroup | None = None
    for stage in range(pp):  # every rank creates every group, in the same order
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks and isinstance(group, dist.ProcessGroup):
            tp_group = group
    for t in range(tp):
        ranks = [stage * tp + t for stage in range(pp)]
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks and isinstance(group, dist.ProcessGroup):
            column_group = group
    assert tp_group is not None and column_group is not None
    heartbeat = Heartbeat.start(rank, world) if world > 1 else None
    return Parallel(tp, pp, rank, world, tp_group, column_group, device, heartbeat)


def group_timeout(group: dist.ProcessGroup | None) -> float | None:
    """The collective timeout of ``group`` (None: the default group) in seconds; None if unknown."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
            timeout = backend.options._timeout
        except Exception:  # no backend for this device, or no options to read
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout.total_seconds()
    return None


class RankFailedError(RuntimeError):
    """A collective failed because another rank failed (its own error, where it reported one) or
    stopped answering (it died, was stopped or hangs)."""


class Heartbeat:
    """Each rank's sign of life in the rendezvous store, so a failed collective can name the lost rank.

    A daemon thread adds 1 to ``infer/alive/<rank>`` every `HEARTBEAT_S` and reads every
    other rank's counter through its own store connection (a short timeout: a stopped
    store must not stop it). A rank whose counter has not moved for `SILENT_S` has
    stopped answering; so has the store's host when the store itself stops answering.
    A rank that fails with an error of its own writes it to ``infer/failed/<rank>`` before it
    exits (`report`; ``infer/failures`` counts them); each beat reads any new ones, so the others
    tell that error rather than its silence (`reported`).
    """

    def __init__(self, rank: int, world: int, store: Any, store_host: str) -> None:
        self.rank, self.world = rank, world
        self.store = store
        self.store_host = store_host
        now = time.monotonic()
        self.seen: dict[int, tuple[int, float]] = {r: (-1, now) for r in range(world) if r != rank}
        self.store_ok = now  # when the store last answered
        self.failed: dict[int, str] = {}  # the errors other ranks reported (`report`), as last read
        self.lock = threading.Lock()
        self.store_lock = threading.Lock()  # one store call at a time (the thread's, a report's)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="infer-heartbeat", daemon=True)

    @classmethod
    def start(cls, rank: int, world: int) -> Heartbeat | None:
        """A running heartbeat, or None where there is no TCP store to meet at (MASTER_ADDR/PORT)."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            return None
        try:
            from torch._C._distributed_c10d import TCPStore

            store = TCPStore(
                addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=2 * SILENT_S)
            )
        except Exception:  # no store to reach: failures will name the group instead
            return None
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        beat = cls(rank, world, store, "torchrun's agent" if agent else "rank 0")
        atexit.register(beat.stop.set)
        beat.thread.start()
        global _LATEST
        _LATEST = beat
        return beat

    def _run(self) -> None:
        keys = {r: f"infer/alive/{r}" for r in self.seen}
        reports = 0  # the failures reported so far (`infer/failures`), as last read
        while not self.stop.is_set():
            failed: dict[int, str] | None = None
            try:
                with self.store_lock:
                    self.store.add(f"infer/alive/{self.rank}", 1)
                    counts = {r: int(self.store.add(key, 0)) for r, key in keys.items()}
                    n = int(self.store.add("infer/failures", 0))
                    if n != reports:
                        reports, failed = n, self._read_failures()
            except Exception:  # the store stopped answering: its host is gone or stopped
                time.sleep(HEARTBEAT_S)
                continue
            now = time.monotonic()
            with self.lock:
                self.store_ok = now
                for r, count in counts.items():
                    if count != self.seen[r][0]:
                        self.seen[r] = (count, now)
                if failed is not None:
                    self.failed = failed
            self.stop.wait(HEARTBEAT_S)

    def _read_failures(self) -> dict[int, str]:
        found = {}
        for r in sorted(self.seen):
            key = f"infer/failed/{r}"
            if self.store.check([key]):
                found[r] = bytes(self.store.get(key)).decode(errors="replace")
        return found

    def report(self, error: BaseException) -> None:
        """Leave this rank's own error where the other ranks' heartbeats read it (`reported`)."""
        text = f"{type(error).__name__}: {error}".strip()
        try:
            with self.store_lock:
                self.store.set(f"infer/failed/{self.rank}", text[:2000])
                self.store.add("infer/failures", 1)
        except Exception:  # no store to tell: the others will report this rank as silent
            pass

    def reported(self) -> dict[int, str]:
        """The errors other ranks reported before they stopped (`report`), by rank, as this heartbeat
        last read them (never a store call: a stopped store must not stop the caller)."""
        with self.lock:
            return dict(self.failed)

    def silent(self) -> tuple[list[int], float, bool]:
        """``(ranks silent for SILENT_S, the longest silence, whether the store is silent)``.

        Waits until `SILENT_S` has passed since the call, so a rank that died just now
        has had time to miss its beats.
        """
        time.sleep(SILENT_S + HEARTBEAT_S)
        now = time.monotonic()
        with self.lock:
            if now - self.store_ok > SILENT_S:
                return [], now - self.store_ok, True
            quiet = {r: now - t for r, (_, t) in self.seen.items() if now - t > SILENT_S}
        return sorted(quiet), max(quiet.values(), default=0.0), False


_LATEST: Heartbeat | None = None  # this process's heartbeat (one parallel run per process)


def _failed(reported: dict[int, str]) -> str:
    """``rank R failed: ITS ERROR`` for each rank that reported its own error."""
    return "; ".join(f"rank {r} failed: {text}" for r, text in sorted(reported.items()))


def report_failure(parallel: Parallel | None, error: BaseException) -> None:
    """This rank fails with ``error`` of its own (not a peer's silence): tell the other ranks, whose
    collectives are about to fail, what it was (`Heartbeat.report`)."""
    if parallel is not None and parallel.heartbeat is not None and not is_peer_failure(error):
        parallel.heartbeat.report(error)


def lost_ranks() -> str | None:
    """Who failed or stopped answering, as the last `Heartbeat` of this process sees it (None:
    nobody known). A rank that reported its own error is named with it."""
    if _LATEST is None:
        return None
    lost, _ = _lost(_LATEST)
    return lost


def _lost(beat: Heartbeat) -> tuple[str | None, bool]:
    """What ``beat`` knows of a lost rank: ``(message, whether the rank reported its own error)``."""
    ranks, silence, store = beat.silent()  # (time for the heartbeat to read what was reported)
    reported = beat.reported()
    if reported:
        return _failed(reported), True
    if store:
        why = f"the rendezvous store it holds has been silent for {silence:.1f} s"
        return f"{beat.store_host} stopped answering ({why})", False
    if ranks:
        who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        why = f"no sign of life for {silence:.1f} s; killed, stopped or hung"
        return f"{who} stopped answering ({why})", False
    return None, False


def describe_failure(parallel: Parallel, error: BaseException) -> str:
    """Which rank failed (with its own error, where it reported one) or stopped answering, for the
    collective that failed with ``error``."""
    cause = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    lost, reported = _lost(parallel.heartbeat) if parallel.heartbeat is not None else (None, False)
    if lost is not None:
        return lost if reported else f"{lost}; the collective failed: {cause}"
    others = [r for r in range(parallel.world) if r != parallel.rank]
    return f"one of ranks {others} stopped answering; the collective failed: {cause}"


def is_peer_failure(error: BaseException) -> bool:
    """Gloo / NCCL errors of a peer that is gone or silent (``RuntimeError`` or `dist.DistError`)."""
    if isinstance(error, RankFailedError) or not isinstance(error, RuntimeError):
        return False
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    signs = ("gloo", "Gloo", "NCCL", "Connection reset", "Connection closed", "Timed out", "pair closure")
    return any(k in text for k in signs)


@contextlib.contextmanager
def peer_failures(parallel: Parallel | None) -> Iterator[None]:
    """Turn a collective's failure into a `RankFailedError` naming the rank that stopped answering."""
    try:
        yield
    except RuntimeError as e:
        if parallel is None or not is_peer_failure(e):
            raise
        raise RankFailedError(describe_failure(parallel, e)) from e


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
    box = [global_seed() if parallel.rank == 0 else 0]
    with peer_failures(parallel):
        dist.broadcast_object_list(box, src=0)
    return int(box[0])


def broadcast_object(parallel: Parallel, value: T) -> T:
    """Rank 0's ``value`` on every rank (a chat line read on rank 0, whose stdin torchrun feeds)."""
    box: list[Any] = [value if parallel.rank == 0 else None]
    with peer_failures(parallel):
        dist.broadcast_object_list(box, src=0)
    result: T = box[0]
    return result


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Heartbeat",
    "Parallel",
    "RankFailedError",
    "agree",
    "broadcast_object",
    "describe_failure",
    "group_timeout",
    "is_peer_failure",
    "lost_ranks",
    "peer_failures",
    "report_failure",
    "setup",
    "shared_seed",
]
