"""One engine under ``torchrun``: rank 0 plans, every rank runs the same plan.

Rank 0's runner (`Broadcasting`) sends each plan (its typed KV operations, each with how it went
on rank 0, and its forwards) to the other ranks (`Follower`), which make the same operations and
run the same forwards on their part of the model; an outcome that differs from rank 0's is a
`DivergenceError`. Only rank 0 samples. `Ranks` is what an `LLM` holds for all of it
(docs/engine.md, *Under torchrun*).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from infer.distributed.runtime import (
    Parallel,
    RankFailedError,
    broadcast_object,
    is_peer_failure,
    peer_failures,
    report_failure,
)
from infer.engine.plan import Draw, Plan, Ran, Wired
from infer.engine.runner import Runner
from infer.execution import Execution
from infer.kv.cache import KVModel
from infer.kv.ops import Done
from infer.kv.slots import KVSlots
from infer.models.base import DecoderLM

KEEPALIVE_S = 60.0  # a server's idle rank 0 tells the others it is alive this often


class DivergenceError(RuntimeError):
    """A rank's KV slots parted from rank 0's: an operation or a forward went otherwise here."""


@dataclass
class Step:
    """One message to the other ranks: the KV operations since the last one, then a plan's forwards
    (none at the end of a call); ``ran``: how each forward of the last plan went on rank 0 (None:
    it ran; else its error)."""

    shape: tuple[int, int, bool]  # the slots' (max_rows, context, share)
    ops: list[Done]
    forwards: list[Wired] = field(default_factory=list)
    ran: list[str | None] | None = None


@dataclass
class EndCall:
    """The end of one Python API call on every rank: its result, for the other ranks to return."""

    result: Any


STOP = "stop"
KEEPALIVE = "keepalive"


def _shape(slots: KVSlots[Any]) -> tuple[int, int, bool]:
    """What a follower's slots must match of rank 0's: ``(max_rows, context, share)``."""
    return (slots.max_rows, slots.context, slots.share)


def _outcome(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


class Broadcasting(Runner):
    """Rank 0's runner: each plan is sent to the other ranks, then run (see the module's docstring)."""

    def __init__(
        self, parallel: Parallel, slots: KVSlots[DecoderLM], execution: Execution | None = None
    ) -> None:
        super().__init__(slots, execution)
        self.parallel = parallel
        self._lock = threading.Lock()  # one broadcast at a time (plans, keep-alives)
        self._sent = time.monotonic()
        self._closed = False
        self._keepalive: threading.Thread | None = None
        self._ran: list[str | None] | None = None  # how the last plan's forwards went here

    def _send(self, message: object) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the parallel engine is closed: the other ranks have stopped following")
            broadcast_object(self.parallel, message)
            self._sent = time.monotonic()

    def _step(self, forwards: list[Wired]) -> Step:
        ran, self._ran = self._ran, None
        return Step(_shape(self.slots), self.slots.take_ops(), forwards, ran)

    def send(self, plan: Plan) -> None:
        """Send the plan to the other ranks (they run it with this rank)."""
        ops, forwards = plan.wire()
        message = self._step(forwards)
        message.ops = ops + message.ops  # (none made between the plan and now)
        self._send(message)

    def run(self, plan: Plan, draws: Sequence[Draw]) -> list[Ran]:
        out = super().run(plan, draws)
        self._ran = [_outcome(r.error) for r in out]
        return out

    def guard(self) -> contextlib.AbstractContextManager[None]:
        return peer_failures(self.parallel)  # a rank gone mid-step is named

    def end_call(self, result: Any) -> None:
        """A Python API call ends on rank 0: the other ranks make the last operations, return ``result``."""
        self._send(self._step([]))
        self._send(EndCall(result))

    def keep_alive(self) -> None:
        """While this server runs: a keep-alive to the other ranks whenever none was sent for
        `KEEPALIVE_S` (a daemon thread; `close` ends it)."""
        if self._keepalive is not None:
            return

        def run() -> None:
            while True:
                time.sleep(min(KEEPALIVE_S / 4, 5.0))
                with self._lock:
                    if self._closed:
                        return
                    if time.monotonic() - self._sent >= KEEPALIVE_S:
                        broadcast_object(self.parallel, KEEPALIVE)
                        self._sent = time.monotonic()

        self._keepalive = threading.Thread(target=run, name="infer-keepalive", daemon=True)
        self._keepalive.start()

    def close(self) -> None:
        """Tell the other ranks to stop following (once)."""
        with self._lock:
            if self._closed:
                return
            broadcast_object(self.parallel, STOP)
            self._closed = True


class Follower:
    """A rank other than 0: its KV slots (made to rank 0's shape) and the loop that replays rank 0's plans."""

    def __init__(self, model: DecoderLM, execution: Execution, parallel: Parallel) -> None:
        self.model = model
        self.execution = execution
        self.parallel = parallel
        self.runner: Runner | None = None
        self._ran: list[str | None] = []  # how the last plan's forwards went here

    def _slots(self, shape: tuple[int, int, bool]) -> Runner:
        if self.runner is None or _shape(self.runner.slots) != shape:
            max_rows, context, share = shape
            self.runner = Runner(KVSlots(self.model, max_rows, context, share=share), self.execution)
        return self.runner

    def _diverged(self, what: str, here: str | None, there: str | None) -> DivergenceError:
        rank = self.parallel.rank
        if here is not None:
            how = f"it failed on rank {rank} ({here}) and went through on rank 0"
        else:
            how = f"it went through on rank {rank} and failed on rank 0 ({there})"
        return DivergenceError(f"rank {rank}'s KV slots diverged from rank 0's at {what}: {how}")

    def apply(self, slots: KVSlots[KVModel], ops: list[Done]) -> None:
        """Make rank 0's KV operations; `DivergenceError` where one goes otherwise than on rank 0."""
        for done in ops:
            here = None
            try:
                slots.apply(done.op)
            except Exception as e:
                here = _outcome(e)
            if (here is None) != (done.error is None):
                raise self._diverged(repr(done.op), here, done.error)

    @torch.inference_mode()
    def follow(self) -> Any:
        """Replay rank 0's plans until it ends a call (its result is returned) or stops (None).

        In inference mode throughout, as rank 0's engine runs: KV operations and forwards touch
        the same tensors (a cache grown by a forward is an inference tensor; rolling it back
        outside inference mode would fail here and not there)."""
        while True:
            message = broadcast_object(self.parallel, None)
            if message == STOP:
                return None
            if message == KEEPALIVE:
                continue
            if isinstance(message, EndCall):
                return message.result
            assert isinstance(message, Step), f"rank 0 sent {type(message).__name__}"
            if message.ran is not None:
                for i, (here, there) in enumerate(zip(self._ran, message.ran, strict=True)):
                    if (here is None) != (there is None):
                        raise self._diverged(f"forward {i} of the last plan", here, there)
            runner = self._slots(message.shape)
            self.apply(runner.slots, message.ops)
            self._ran = []
            for f in message.forwards:
                try:
                    runner.step(f.lo, f.hi, f.feeds, f.mode, None, None, f.pad_to)
                except Exception as e:
                    if is_peer_failure(e):
                        raise  # a rank gone: this run is over
                    self._ran.append(_outcome(e))
                else:
                    self._ran.append(None)


class Ranks:
    """This process's part in a tensor- or pipeline-parallel run, and what it does there: rank 0's
    engine runner (`runner`: it sends every plan), the other ranks' loop that follows it (`follow`,
    `followed`) and the end of a Python API call (`end_call`). (A server's keep-alives:
    `infer.engine.Engine.serving`.)"""

    def __init__(self, parallel: Parallel, model: DecoderLM, execution: Execution) -> None:
        self.parallel = parallel
        self.model = model
        self.execution = execution
        self.broadcasting: Broadcasting | None = None  # rank 0's, once its engine is made
        self._follower: Follower | None = None

    @property
    def primary(self) -> bool:
        return self.parallel.rank == 0

    def runner(self, max_batch: int, context: int) -> Broadcasting:
        """Rank 0's engine runner (`infer.engine.Engine`'s ``runner``)."""
        self.broadcasting = Broadcasting(self.parallel, KVSlots(self.model, max_batch, context, record=True),
                                         self.execution)  # fmt: skip
        return self.broadcasting

    @property
    def follower(self) -> Follower:
        if self._follower is None:
            assert not self.primary
            self._follower = Follower(self.model, self.execution, self.parallel)
        return self._follower

    def follow(self) -> None:
        """A parallel server's rank other than 0: replay rank 0's plans until its server stops."""
        while self._follow() is not None:
            pass  # a call's end (a Python API call on rank 0): keep following

    def followed(self) -> Any:
        """A rank other than 0 in a Python API call: rank 0's result of the call (its error raised)."""
        result = self._follow()
        if isinstance(result, BaseException):
            raise result
        return result

    def _follow(self) -> Any:
        """`Follower.follow`; an error of this rank's own (a divergence, a failed forward) is left
        for the other ranks to tell (`report_failure`) before it is raised here."""
        with peer_failures(self.parallel):
            try:
                return self.follower.follow()
            except RankFailedError:
                raise
            except Exception as e:
                report_failure(self.parallel, e)
                raise

    def end_call(self, result: Any) -> None:
        """Rank 0: the call is over; the other ranks return ``result`` (or raise it)."""
        if self.broadcasting is not None:
            self.broadcasting.end_call(result)


__all__ = ["KEEPALIVE_S", "Broadcasting", "DivergenceError", "EndCall", "Follower", "Ranks", "Step"]
