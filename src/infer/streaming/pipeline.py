"""The schedule of loads: a background reader that keeps the next unit loaded while the current one computes.

Units load cyclically in the plan's order (two buffers with ``prefetch``; without it, one buffer
and synchronous loads). A request out of order drops what was prefetched and restarts there; a
unit later than ``read_timeout`` raises ``TimeoutError``. What it observes goes to its `Recorder`.
Details: docs/streaming.md, "How it works" (*Schedule*).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from infer.streaming.config import DEFAULT_READ_TIMEOUT
from infer.streaming.layout import Unit
from infer.streaming.stats import COMPUTED, LOADED, ProgressEvent, StreamingStats, TimelineEntry
from infer.streaming.transport import ComputeRecord, LoadRecord, Transport

Ready = tuple[int, int, LoadRecord | BaseException]  # (unit, buffer, record or the reader's error)


@dataclass(eq=False)
class Recorder:
    """What a `Pipeline` records of the units it loads and the executor computes.

    The counters go to ``stats``; with ``trace``, an interval per read, copy and compute to
    its timeline (seconds since ``clock_origin``, a `time.perf_counter` value); every load and
    compute is an ``on_progress`` event. On CUDA, copy and compute times come from events,
    folded in by `resolve` once they finished (``gpu_origin``: a CUDA event recorded at
    ``clock_origin``'s time, its host time, to align the GPU lanes with the host's).
    """

    stats: StreamingStats
    _: KW_ONLY
    on_progress: Callable[[ProgressEvent], None] | None
    trace: bool
    clock_origin: float
    gpu_origin: tuple[Any, float] | None = None
    # CUDA records whose events are not resolved yet
    pending: list[ComputeRecord] = field(default_factory=list, init=False)

    def loaded(self, unit: Unit, record: LoadRecord, waited: float) -> None:
        """``unit`` is in a buffer, as ``record`` says; the consumer waited ``waited`` seconds for it."""
        s = self.stats
        s.bytes_loaded += record.nbytes
        s.bytes_read += record.bytes_read
        s.units_loaded += 1
        s.load_seconds += record.read_end - record.read_start
        if record.copy_events is None:
            s.wait_seconds += waited  # CPU: the consumer was blocked this long (all of it in sync mode)
        # CUDA: the GPU's wait comes from events (`resolve`): from when the host asked for the
        # unit (after the work queued before it) to when its compute could start.
        if self.trace:
            s.timeline.append(
                TimelineEntry(
                    "read",
                    unit.index,
                    unit.label,
                    record.read_start - self.clock_origin,
                    record.read_end - self.clock_origin,
                )
            )
        if self.on_progress is not None:
            seconds = record.read_end - record.read_start
            self.on_progress(
                ProgressEvent(
                    LOADED, unit.index, unit.group, unit.layers, record.nbytes, seconds, record.tier
                )
            )

    def computed(self, unit: Unit, start: float, end: float, compute: ComputeRecord | None) -> None:
        """``unit`` ran from ``start`` to ``end`` (host time); ``compute``: its CUDA events, if any."""
        self.stats.units_computed += 1
        if compute is None:  # CPU: host time is compute time
            self.stats.compute_seconds += end - start
            if self.trace:
                self.stats.timeline.append(
                    TimelineEntry(
                        "compute", unit.index, unit.label, start - self.clock_origin, end - self.clock_origin
                    )
                )
        else:
            self.pending.append(compute)
            if len(self.pending) > 256:
                self.resolve(block=False)
        if self.on_progress is not None:
            self.on_progress(
                ProgressEvent(COMPUTED, unit.index, unit.group, unit.layers, unit.nbytes, end - start)
            )

    def resolve(self, block: bool = True) -> None:
        """Fold finished CUDA event timings into the stats (all of them when ``block``)."""
        if not self.pending:
            return
        import torch

        if block:
            torch.cuda.synchronize()
        keep: list[ComputeRecord] = []
        for rec in self.pending:
            wait_start, compute_start, compute_end = rec.events
            if not block and not compute_end.query():  # type: ignore[no-untyped-call]
                keep.append(rec)
                continue
            s = self.stats
            s.compute_seconds += compute_start.elapsed_time(compute_end) / 1e3
            copy = rec.load.copy_events
            if copy is not None:
                s.load_seconds += copy[0].elapsed_time(copy[1]) / 1e3
            s.wait_seconds += wait_start.elapsed_time(compute_start) / 1e3
            if self.trace and copy is not None and self.gpu_origin is not None:
                base, host = self.gpu_origin
                t0 = host - self.clock_origin
                for lane, (a, b) in (("copy", copy), ("compute", (compute_start, compute_end))):
                    start, end = t0 + base.elapsed_time(a) / 1e3, t0 + base.elapsed_time(b) / 1e3
                    s.timeline.append(TimelineEntry(lane, rec.unit, rec.label, start, end))
        self.pending = keep


class Pipeline:
    """Loads ``units`` into the transport's buffers ahead of their use; ``recorder`` records it."""

    def __init__(
        self,
        units: list[Unit],
        transport: Transport,
        *,
        prefetch: bool,
        recorder: Recorder,
        read_timeout: float | None = DEFAULT_READ_TIMEOUT,
    ) -> None:
        self.units = units
        self.transport = transport
        self.prefetch = prefetch
        self.recorder = recorder
        self.cond = threading.Condition()
        self.free: deque[int] = deque(range(transport.num_buffers))
        self.ready: deque[Ready] = deque()
        self.next_load = 0
        self.generation = 0
        self.active = False
        self.closed = False
        self.expected: int | None = None
        self.thread: threading.Thread | None = None
        self._current: tuple[Unit, int, LoadRecord, ComputeRecord | None, float] | None = None
        self.read_timeout = read_timeout
        self._sync_load: threading.Thread | None = (
            None  # sync mode: a load that timed out, maybe still running
        )

    # ---- reader ---------------------------------------------------------------

    def _reader(self) -> None:
        while True:
            with self.cond:
                while not self.closed and not (self.active and self.free):
                    self.cond.wait()
                if self.closed:
                    return
                buffer = self.free.popleft()
                unit = self.next_load
                self.next_load = (unit + 1) % len(self.units)
                generation = self.generation
            item: LoadRecord | BaseException
            try:
                item = self.transport.load(self.units[unit], buffer)
            except BaseException as e:  # handed to the consumer, which raises it
                item = e
            with self.cond:
                if generation == self.generation:
                    self.ready.append((unit, buffer, item))
                    if isinstance(item, BaseException):
                        self.active = False
                else:
                    self.free.append(buffer)
                self.cond.notify_all()

    def _restart(self, unit: int) -> None:
        """Drop everything prefetched and continue loading from ``unit`` (lock held)."""
        self.generation += 1
        while self.ready:
            self.free.append(self.ready.popleft()[1])
        self.next_load = unit
        self.active = True
        if self.thread is None:
            self.thread = threading.Thread(target=self._reader, name="infer-streaming-reader", daemon=True)
            self.thread.start()
        self.cond.notify_all()

    # ---- consumer -------------------------------------------------------------

    def get(self, unit_index: int) -> tuple[Unit, int]:
        """Block until ``unit_index`` is in a buffer; return the unit and the buffer index.

        Raises ``TimeoutError`` if the unit is not loaded within ``read_timeout`` seconds.
        """
        unit = self.units[unit_index]
        start = time.perf_counter()
        deadline = None if self.read_timeout is None else time.monotonic() + self.read_timeout
        wait_mark = self.transport.mark_wait()
        if not self.prefetch:
            buffer = 0
            record = self._load_now(unit, buffer, deadline)
        else:
            with self.cond:
                if self.expected != unit_index:
                    self._restart(unit_index)
                while not self.ready:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        self.expected = None  # the next get restarts; the stalled read is discarded
                        raise self._timed_out(unit)
                    self.cond.wait(remaining)
                got, buffer, item = self.ready.popleft()
                self.expected = (unit_index + 1) % len(self.units)
                if isinstance(item, BaseException):
                    self.free.append(buffer)
                    self.expected = None
                    self.cond.notify_all()
                    raise item
                if got != unit_index:  # cannot happen: loads are issued in order after a restart
                    raise RuntimeError(
                        f"streaming pipeline out of order: wanted unit {unit_index}, got {got}"
                    )
                record = item
        waited = time.perf_counter() - start
        compute = self.transport.before_compute(unit, buffer, record, wait_mark)
        self.recorder.loaded(unit, record, waited)
        self._current = (unit, buffer, record, compute, time.perf_counter())
        return unit, buffer

    def _load_now(self, unit: Unit, buffer: int, deadline: float | None) -> LoadRecord:
        """Sync mode: load ``unit`` into ``buffer`` and wait for it, at most until ``deadline``."""
        if deadline is None and self._sync_load is None:
            return self.transport.load(unit, buffer)
        stalled = self._sync_load
        if stalled is not None:  # a load that timed out still writes into the only buffer
            stalled.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if stalled.is_alive():
                raise self._timed_out(unit, still=True)
            self._sync_load = None
        outcome: list[LoadRecord | BaseException] = []

        def load() -> None:
            try:
                outcome.append(self.transport.load(unit, buffer))
            except BaseException as e:  # handed to the consumer, which raises it
                outcome.append(e)

        thread = threading.Thread(target=load, name="infer-streaming-load", daemon=True)
        thread.start()
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            self._sync_load = thread
            raise self._timed_out(unit)
        item = outcome[0]
        if isinstance(item, BaseException):
            raise item
        return item

    def _timed_out(self, unit: Unit, still: bool = False) -> TimeoutError:
        where = self.transport.store.description
        waiting = "an earlier read that timed out is still running" if still else "the reader is stalled"
        return TimeoutError(
            f"{where}: {unit.label} (streaming unit {unit.index}) was not loaded within "
            f"{self.read_timeout} s: {waiting} (a hung disk or network file system?). "
            "StreamingConfig.read_timeout sets the limit; None waits forever"
        )

    def done(self, unit_index: int, buffer: int) -> None:
        """The consumer finished with ``unit_index``: its buffer may be refilled."""
        current = self._current
        self._current = None
        self.transport.after_compute(buffer, current[3] if current else None)
        if self.prefetch:
            with self.cond:
                self.free.append(buffer)
                self.cond.notify_all()
        if current is None:
            return
        unit, _, _, compute, start = current
        self.recorder.computed(unit, start, time.perf_counter(), compute)

    def abort(self) -> None:
        """Forget the unit in use after an error, so the next `get` restarts cleanly."""
        if self._current is not None:
            unit, buffer = self._current[0], self._current[1]
            self.done(unit.index, buffer)
        self.expected = None

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=30)
            self.thread = None
        self.recorder.resolve(block=True)
        self.transport.close()
