"""Which thread runs the engine's iterations.

One thread at a time runs an iteration (the **driver**). A caller that waits for its tokens in
plain Python (iterating a `RequestHandle`: `LLM.generate`, `stream`, `chat`, the CLI) runs them
itself while nobody else does, so the model runs on the caller's thread: torch's OpenMP workers
spin between the regions of the thread that last used them, and a step issued from another
thread paid ~2x per small op at 2 threads (docs/performance.md). Callers that cannot block
(`Engine.submit`, asyncio's `RequestHandle.aiter`: the server) get a background thread (started
on demand, gone after `IDLE_EXIT_S` idle) that drives whenever no caller does. The background
thread holds its engine only while working, so an idle engine (and the model it owns) can be
garbage collected.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from typing import Protocol

import torch

from infer.engine.request import Delta, Request, RequestHandle
from infer.host.threads import release_openmp_workers

IDLE_EXIT_S = 2.0  # the loop thread ends after this long without work (the next submit starts one)
HANDOVER_S = 0.005  # a caller waiting for another thread's iteration checks this often whether to drive


class Engine(Protocol):
    """What the driver runs of an engine (`infer.engine.core.Engine`); ``_locked``: with ``cond`` held."""

    closed: bool

    def poll_locked(self) -> list[Request] | None: ...
    def work(self, admitted: list[Request], interruptible: bool = False) -> None: ...
    def exit_locked(self) -> bool: ...
    def idle_locked(self) -> bool: ...
    def reap(self) -> None: ...
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
    queues; the engine's `Engine.poll_locked`, `Engine.work` and `Engine.exit_locked` are what an
    iteration runs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = weakref.ref(engine)
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None  # the background thread, while it lives
        self.current: threading.Thread | None = None  # the thread running an iteration now
        self.parked = False  # the background thread waits for work, holding no reference to the engine
        _ENGINES.add(engine)

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
            admitted = engine.poll_locked()
            if admitted is None:
                return False
            self.current = threading.current_thread()
        try:
            with torch.inference_mode():
                engine.work(admitted, interruptible=True)
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
        engine.reap()
        deadline = time.monotonic() + timeout
        with self.cond:
            while (
                not self.parked and engine.idle_locked() and self.thread is not None
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
                admitted = None if driven else engine.poll_locked()
                if admitted is None:
                    if not driven and engine.closed and engine.exit_locked():
                        return
                    driver.parked = True
                    cond.notify_all()  # `Driver.settle` waits for this
                    del engine, driver  # wait without holding the engine
                    woke = cond.wait(IDLE_EXIT_S)
                    driver = ref()
                    engine = None if driver is None else driver.engine()
                    if driver is None or engine is None:
                        return
                    if not woke and driver.current is None and engine.exit_locked():
                        return
                    continue
                driver.current = threading.current_thread()
            try:
                engine.work(admitted)
            finally:
                with cond:
                    driver.current = None
                    cond.notify_all()
            del engine, driver


__all__ = ["HANDOVER_S", "IDLE_EXIT_S", "Driver"]
