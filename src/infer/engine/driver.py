"""Which thread runs the engine's iterations (the **driver**: one at a time).

A caller that waits for its tokens in plain Python (iterating a `RequestHandle`: `LLM.generate`,
`stream`, `chat`, the CLI) runs them itself while nobody else does: torch's OpenMP workers are
fastest on the thread that last used them (docs/engine.md, *Threads*). Callers that cannot block
(`Engine.submit`, asyncio's `RequestHandle.aiter`: the server) get a background thread, started
on demand and gone after `IDLE_EXIT_S` idle, that holds its engine only while working (an idle
engine and its model can be garbage collected).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from infer.engine.request import Delta, EngineClosed, EngineFull, Request, RequestHandle
from infer.host.threads import release_openmp_workers

IDLE_EXIT_S = 2.0  # the loop thread ends after this long without work (the next submit starts one)
HANDOVER_S = 0.005  # a caller waiting for another thread's iteration checks this often whether to drive


class Queue(Protocol):
    """What the driver uses of the engine's scheduler (`infer.engine.scheduler.Scheduler`): the queue
    and the running requests, which it touches only with its ``cond`` held."""

    @property
    def idle(self) -> bool: ...
    def enqueue(self, r: Request) -> None: ...
    def full(self, bound: int) -> bool: ...
    def waiting_count(self) -> int: ...
    def running_count(self) -> int: ...
    def take_waiting(self) -> list[Request]: ...
    def abort(self) -> None: ...
    def reap(self) -> None: ...
    def fail(self, requests: Iterable[Request], error: BaseException) -> None: ...


class Engine(Protocol):
    """What the driver runs of an engine (`infer.engine.core.Engine`)."""

    @property
    def scheduler(self) -> Queue: ...
    def step(self, admitted: Sequence[Request] = ()) -> None: ...
    def close(self, drain: bool = True, timeout: float | None = None) -> None: ...


_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _stop_loops() -> None:
    """At interpreter exit: end every engine's loop thread (cancelling what runs) and wait for it,
    so no thread is inside torch while the interpreter finalizes."""
    for engine in list(_ENGINES):
        engine.close(drain=False, timeout=30.0)


class Driver:
    """The thread hand-off of one engine (see the module's docstring). ``cond`` guards the engine's
    queue and running requests; an iteration takes the requests the free rows take (`_poll_locked`)
    and runs `Engine.step` (`_work`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = weakref.ref(engine)
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None  # the background thread, while it lives
        self.current: threading.Thread | None = None  # the thread running an iteration now
        self.parked = False  # the background thread waits for work, holding no reference to the engine
        self.closed = False  # `close`: nothing more is admitted
        _ENGINES.add(engine)

    # ---- the callers' side ------------------------------------------------------------------------

    def submit(self, requests: Sequence[Request], max_waiting: int, *, wait: bool, drive: bool) -> None:
        """Queue ``requests`` in order (`Engine.submit_many`), `EngineClosed` after `close`. Without
        ``wait`` they are one group, queued whole or not at all: `EngineFull` when ``max_waiting``
        requests wait as it arrives (a group never fails halfway, and a server request of more
        choices than the bound is not refused forever). ``wait``: each blocks for room (with
        ``drive``, by running the loop)."""
        engine = self.engine()
        assert engine is not None
        s = engine.scheduler
        if not wait:
            with self.cond:
                if self.closed:
                    raise EngineClosed("the engine is closed")
                if requests and s.full(max_waiting):
                    raise EngineFull(f"{s.waiting_count()} requests are waiting (max_waiting={max_waiting})")
                for r in requests:
                    s.enqueue(r)
                if not drive:
                    self.start_locked()
                self.cond.notify_all()
            return
        for r in requests:
            while drive and self._full(s, max(1, max_waiting)):
                self.drive_once()  # make room by running the loop (or wait while another does)
            with self.cond:
                while not self.closed and s.full(max(1, max_waiting)):
                    if drive:
                        break  # filled since the check above by another caller: one more waits
                    self.start_locked()
                    self.cond.wait(0.5)
                if self.closed:
                    raise EngineClosed("the engine is closed")
                s.enqueue(r)
                if not drive:
                    self.start_locked()
                self.cond.notify_all()

    def _full(self, s: Queue, bound: int) -> bool:
        with self.cond:
            return not self.closed and s.full(bound)

    def close(self, drain: bool, timeout: float | None) -> None:
        """Stop admitting; finish (``drain``) or cancel the running and waiting requests; end the loop."""
        engine = self.engine()
        assert engine is not None
        s = engine.scheduler
        with self.cond:
            self.closed = True
            if not drain:
                s.abort()  # also ends requests being admitted right now (in no list)
            if not s.idle:
                self.start_locked()  # ends them even if no caller is iterating them
            self.cond.notify_all()
        self.join(timeout)

    def reap(self, s: Queue) -> None:
        """End cancelled requests now when no thread is running the loop, so a caller that stopped
        iterating early does not leave its row held until somebody runs the next step."""
        with self.cond:
            if not self.running_elsewhere():  # else the running loop ends them at its next iteration
                s.reap()

    # ---- an iteration -----------------------------------------------------------------------------

    def _poll_locked(self, engine: Engine) -> list[Request] | None:
        """Requests to admit now ([] when only running ones need a step); None when idle."""
        s = engine.scheduler
        admitted = s.take_waiting()
        if admitted:
            self.cond.notify_all()  # room in the waiting queue
        if admitted or s.running_count():
            self.parked = False
            return admitted
        return None

    def _exit_locked(self, engine: Engine) -> bool:
        """Whether the background thread should end now (nothing waiting or running)."""
        if not engine.scheduler.idle:
            return False
        self.thread = None
        return True

    @staticmethod
    def _work(engine: Engine, admitted: list[Request], interruptible: bool = False) -> None:
        """One `Engine.step` of ``admitted``. A failure ends what ran (the engine keeps serving); an
        interrupt (``interruptible``: a caller drives) is raised after that."""
        try:
            engine.step(admitted)
        except BaseException as e:  # a bug or a failing model: end what ran, keep serving
            engine.scheduler.fail(admitted, e)
            if interruptible and not isinstance(e, Exception):
                raise  # Ctrl-C in a caller driving the loop is the caller's

    def start_locked(self) -> None:
        """Start the background thread unless it runs (``cond`` held)."""
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=_loop, args=(weakref.ref(self),), name="infer-engine",
                                           daemon=True)  # fmt: skip
            self.thread.start()

    def start_background(self) -> None:
        """The background thread runs the steps from now on (an asyncio reader never runs them): this
        thread's OpenMP workers (left from loading the model here, say) would halve their speed."""
        with self.cond:
            self.start_locked()
        release_openmp_workers()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def running_elsewhere(self) -> bool:
        """Whether an iteration runs, or the background thread lives (it ends cancelled requests)."""
        return self.current is not None or (self.thread is not None and self.thread.is_alive())

    def join(self, timeout: float | None) -> None:
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def next_event(self, handle: RequestHandle) -> Delta:
        """``handle``'s next event, running the loop on this thread while nobody else does."""
        while True:
            try:
                return handle.events.get_nowait()
            except queue.Empty:
                pass
            if not self.drive_once():
                try:  # another thread is running the loop: it hands this request's events over
                    return handle.events.get(timeout=HANDOVER_S)
                except queue.Empty:
                    continue

    def drive_once(self) -> bool:
        """One iteration on this thread, when no other thread is running one and there is work;
        whether it ran. An interrupt (Ctrl-C) ends the requests of the step it broke and is raised."""
        engine = self.engine()
        if engine is None:
            return False
        with self.cond:
            if self.current is not None:
                self.cond.wait(HANDOVER_S)  # until that iteration ends
                return False
            admitted = self._poll_locked(engine)
            if admitted is None:
                return False
            self.current = threading.current_thread()
        try:
            with torch.inference_mode():
                self._work(engine, admitted, interruptible=True)
        finally:
            with self.cond:
                self.current = None
                self.cond.notify_all()
        return True

    def settle(self, timeout: float = 5.0) -> None:
        """When nothing else is queued: wait until the background thread has let go of the engine
        (so a caller that drops its `LLM` right after frees the model at once)."""
        engine = self.engine()
        if engine is None:
            return
        self.reap(engine.scheduler)
        deadline = time.monotonic() + timeout
        with self.cond:
            while (
                not self.parked and engine.scheduler.idle and self.thread is not None
                and time.monotonic() < deadline
            ):  # fmt: skip
                self.cond.wait(0.01)


def _loop(ref: weakref.ref[Driver]) -> None:
    """The background thread. It holds its engine only while working; it ends at its next wake-up
    after the engine is gone."""
    with torch.inference_mode():
        while True:
            driver = ref()
            engine = None if driver is None else driver.engine()
            if driver is None or engine is None:
                return
            cond = driver.cond
            with cond:
                driven = driver.current is not None  # by a caller (`Driver.drive_once`)
                admitted = None if driven else driver._poll_locked(engine)
                if admitted is None:
                    if not driven and driver.closed and driver._exit_locked(engine):
                        return
                    driver.parked = True
                    cond.notify_all()  # `Driver.settle` waits for this
                    del engine, driver  # wait without holding the engine
                    woke = cond.wait(IDLE_EXIT_S)
                    driver = ref()
                    engine = None if driver is None else driver.engine()
                    if driver is None or engine is None:
                        return
                    if not woke and driver.current is None and driver._exit_locked(engine):
                        return
                    continue
                driver.current = threading.current_thread()
            try:
                driver._work(engine, admitted)
            finally:
                with cond:
                    driver.current = None
                    cond.notify_all()
            del engine, driver


__all__ = ["HANDOVER_S", "IDLE_EXIT_S", "Driver"]
