"""One engine under ``torchrun``: rank 0 schedules, every rank runs the same batched step.

Rank 0's `Engine` runs with a `Broadcasting` runner. Its KV slots (`Journaled`) write down every
change the scheduler makes to them (rows reserved, rolled back, prefixes shared, bounds set),
and before each forward the runner sends that journal and the step (rows, what each row is
fed, the head's mode) to the other ranks in one broadcast. The other ranks `follow`: they keep
KV slots of the same rows and capacity for their own part of the model (a tensor-parallel
rank's heads, a pipeline stage's layers), apply the journal and run the same step, so every
rank holds the same tokens in the same slots by construction, and the step's collectives meet.
Only rank 0 samples (its logits are whole: the tensor-parallel head gathers the vocabulary,
the last stage broadcasts them), decodes text and talks to clients; a follower's own sampling
is greedy and discarded. Speculative decoding stays off under parallelism; a processed row
(constraint, bias, penalty) takes the exact head (no partial re-scoring, whose vocabulary rows
live on several ranks).

A server's followers stay in `follow` until rank 0 closes its engine (`Broadcasting.close`);
rank 0 sends a keep-alive every `KEEPALIVE_S` while idle so no collective times out. A call of
the Python API (`LLM.generate` under torchrun, on every rank) ends with `Broadcasting.end_call`,
which gives the other ranks the call's result.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from infer.distributed.runtime import Parallel, broadcast_object, is_peer_failure, peer_failures
from infer.engine.runner import Runner
from infer.engine.slots import KVSlots
from infer.models.base import DecoderLM
from infer.runtime.step import Sampling, Stepper

KEEPALIVE_S = 60.0  # a server's idle rank 0 tells the others it is alive this often
F = TypeVar("F", bound=Callable[..., Any])


def _tracked(written: bool) -> Callable[[F], F]:
    """A `KVSlots` method made from outside a step (``written``: its call is appended to the
    journal for the other ranks) or by a step (the other ranks' step makes it too). Either way the
    changes it makes through other methods are not written down: the other ranks replay it whole."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def wrapper(self: Journaled, *args: Any) -> Any:
            if written and self.depth == 0:
                self.journal.append((method.__name__, args))
            self.depth += 1
            try:
                return method(self, *args)
            finally:
                self.depth -= 1

        return wrapper  # type: ignore[return-value]

    return wrap


class Journaled(KVSlots):
    """Rank 0's `KVSlots`: each change made from outside a step is appended to ``journal``."""

    def __init__(self, model: DecoderLM, max_rows: int, context: int, share: bool | None = None) -> None:
        self.journal: list[tuple[str, tuple[Any, ...]]] = []
        self.depth = 0
        super().__init__(model, max_rows, context, share=share)

    reserve = _tracked(True)(KVSlots.reserve)
    rollback = _tracked(True)(KVSlots.rollback)
    share_prefix = _tracked(True)(KVSlots.share_prefix)
    shrink = _tracked(True)(KVSlots.shrink)
    set_bound = _tracked(True)(KVSlots.set_bound)
    fit = _tracked(False)(KVSlots.fit)
    advance = _tracked(False)(KVSlots.advance)

    def take_journal(self) -> list[tuple[str, tuple[Any, ...]]]:
        journal, self.journal = self.journal, []
        return journal


REPLAYED = frozenset({"reserve", "rollback", "share_prefix", "shrink", "set_bound"})


@dataclass
class Step:
    """One message to the other ranks: the slots' journal since the last one, then a step (or none)."""

    shape: tuple[int, int, bool]  # the slots' (max_rows, context, share)
    journal: list[tuple[str, tuple[Any, ...]]]
    rows: tuple[int, int] | None = None  # [lo, hi) of the step
    feeds: dict[int, list[int]] = field(default_factory=dict)
    pad_to: int = 0
    exact_head: bool = False


@dataclass
class EndCall:
    """The end of one Python API call on every rank: its result, for the other ranks to return."""

    result: Any


STOP = "stop"
KEEPALIVE = "keepalive"


class Broadcasting(Runner):
    """Rank 0's runner: each step is sent to the other ranks, then run (see the module's docstring)."""

    def __init__(self, parallel: Parallel, slots: Journaled, stepper: Stepper | None = None) -> None:
        super().__init__(slots, stepper)
        self.parallel = parallel
        self.journaled = slots
        self._lock = threading.Lock()  # one broadcast at a time (steps, keep-alives)
        self._sent = time.monotonic()
        self._closed = False
        self._keepalive: threading.Thread | None = None

    @property
    def exact_logits_allowed(self) -> bool:
        return False

    def _send(self, message: object) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the parallel engine is closed: the other ranks have stopped following")
            broadcast_object(self.parallel, message)
            self._sent = time.monotonic()

    def _shape(self) -> tuple[int, int, bool]:
        s = self.slots
        return (s.max_rows, s.context, s.share)

    def before_step(self, lo: int, hi: int, feeds: dict[int, list[int]], mode: Sampling, pad_to: int) -> None:
        """Send the journal and the step to the other ranks (they run it with this rank)."""
        journal = self.journaled.take_journal()
        self._send(Step(self._shape(), journal, (lo, hi), feeds, pad_to, mode.exact_head))

    def forward(self) -> contextlib.AbstractContextManager[None]:
        return peer_failures(self.parallel)  # a rank gone mid-step is named

    def verify_rows(
        self, lo: int, hi: int, feeds: dict[int, list[int]], greedy: bool = False
    ) -> dict[int, torch.Tensor]:
        raise RuntimeError("speculative decoding runs in one process, not under tensor/pipeline parallelism")

    def end_call(self, result: Any) -> None:
        """A Python API call ends on rank 0: the other ranks apply the journal and return ``result``."""
        self._send(Step(self._shape(), self.journaled.take_journal()))
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
    """A rank other than 0: its KV slots (made to rank 0's shape) and the loop that replays rank 0's steps."""

    def __init__(self, model: DecoderLM, stepper: Stepper, parallel: Parallel) -> None:
        self.model = model
        self.stepper = stepper
        self.parallel = parallel
        self.runner: Runner | None = None

    def _slots(self, shape: tuple[int, int, bool]) -> Runner:
        s = None if self.runner is None else self.runner.slots
        if self.runner is None or s is None or (s.max_rows, s.context, s.share) != shape:
            max_rows, context, share = shape
            self.runner = Runner(KVSlots(self.model, max_rows, context, share=share), self.stepper)
        return self.runner

    def follow(self) -> Any:
        """Replay rank 0's steps until it ends a call (its result is returned) or stops (None)."""
        while True:
            message = broadcast_object(self.parallel, None)
            if message == STOP:
                return None
            if message == KEEPALIVE:
                continue
            if isinstance(message, EndCall):
                return message.result
            assert isinstance(message, Step), f"rank 0 sent {type(message).__name__}"
            runner = self._slots(message.shape)
            # Rank 0 made the same change on the same state: where it failed there (a request
            # ended with the error), it fails here, and this rank goes on as rank 0 does.
            for name, args in message.journal:
                if name not in REPLAYED:
                    raise RuntimeError(f"rank 0 sent an unknown KV slots change {name!r}")
                with contextlib.suppress(Exception):
                    getattr(runner.slots, name)(*args)
            if message.rows is not None:
                lo, hi = message.rows
                mode = Sampling(greedy=True, exact_head=message.exact_head)
                try:
                    with torch.inference_mode():
                        runner.step(lo, hi, message.feeds, mode, None, None, message.pad_to)
                except Exception as e:
                    if is_peer_failure(e):
                        raise  # a rank gone: this run is over


__all__ = ["KEEPALIVE_S", "Broadcasting", "EndCall", "Follower", "Journaled", "Step"]
