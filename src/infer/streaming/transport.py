"""Moving a unit's weights into a device buffer: the CPU and the CUDA way.

`CpuTransport` reads the checkpoint straight into the buffer (``pread``); `CudaTransport` fills a
page-locked host buffer, copies on a side stream and orders the streams with events
(`before_compute`, `after_compute`), so neither sees a buffer the other still uses; ``blocking``
overlaps nothing. See docs/streaming.md, "How it works" (*Transports*).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from infer.streaming.layout import Unit
from infer.streaming.store import WeightStore


def cuda_event(timing: bool = True) -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]


@dataclass
class LoadRecord:
    """What one load did: bytes, where they came from, and when (host clock, seconds)."""

    unit: int
    nbytes: int
    bytes_read: int
    tier: str  # "disk" or "host"
    read_start: float
    read_end: float
    copy_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class ComputeRecord:
    """CUDA events around one unit's compute: wait start, compute start, compute end."""

    unit: int
    label: str
    load: LoadRecord
    events: tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event]


class Transport(Protocol):
    store: WeightStore
    num_buffers: int

    def flat(self, buffer: int) -> torch.Tensor: ...

    def load(self, unit: Unit, buffer: int) -> LoadRecord: ...

    def mark_wait(self) -> Any: ...

    def before_compute(
        self, unit: Unit, buffer: int, load: LoadRecord, wait: Any
    ) -> ComputeRecord | None: ...

    def after_compute(self, buffer: int, record: ComputeRecord | None) -> None: ...

    def close(self) -> None: ...


def _read_unit(store: WeightStore, unit: Unit, flat: torch.Tensor) -> None:
    for slot in unit.slots:  # start the readahead of every tensor, then read them in order
        store.prefetch_hint(slot.ref)
    for slot in unit.slots:
        store.read_into(slot.ref, slot.view(flat), slot.rows)


class CpuTransport:
    """Buffers in process memory; a load reads the checkpoint straight into one."""

    def __init__(self, store: WeightStore, num_buffers: int, buffer_bytes: int) -> None:
        self.store = store
        self.num_buffers = num_buffers
        self.buffers = [torch.empty(buffer_bytes, dtype=torch.uint8) for _ in range(num_buffers)]

    def flat(self, buffer: int) -> torch.Tensor:
        return self.buffers[buffer]

    def load(self, unit: Unit, buffer: int) -> LoadRecord:
        start = time.perf_counter()
        _read_unit(self.store, unit, self.buffers[buffer])
        return LoadRecord(unit.index, unit.nbytes, unit.nbytes, "disk", start, time.perf_counter())

    def mark_wait(self) -> Any:
        return None

    def before_compute(self, unit: Unit, buffer: int, load: LoadRecord, wait: Any) -> ComputeRecord | None:
        return None

    def after_compute(self, buffer: int, record: ComputeRecord | None) -> None:
        return None

    def close(self) -> None:
        self.buffers = []


class CudaTransport:
    """Device buffers, pinned staging (and an optional pinned host cache), a copy stream, events."""

    def __init__(
        self,
        store: WeightStore,
        device: torch.device,
        num_buffers: int,
        buffer_bytes: int,
        *,
        pin_memory: bool,
        cached_units: dict[int, int],
        all_cached: bool,
        blocking: bool = False,
    ) -> None:
        self.store = store
        self.device = device
        self.num_buffers = num_buffers
        self.pin = pin_memory
        self.blocking = blocking  # sync mode: nothing overlaps (copy, then compute, then the next read)
        self.copy_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.buffers = [
            torch.empty(buffer_bytes, dtype=torch.uint8, device=device) for _ in range(num_buffers)
        ]
        for buf in self.buffers:
            buf.record_stream(self.copy_stream)  # if ever freed, wait for the copy stream too
        n_staging = 0 if all_cached else num_buffers
        self.staging = [
            torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin_memory) for _ in range(n_staging)
        ]
        self.staging_done: list[torch.cuda.Event | None] = [None] * n_staging
        self.next_staging = 0
        self.cache = {
            unit: torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
            for unit, nbytes in cached_units.items()
        }
        self.cached: set[int] = set()
        self.ready: list[torch.cuda.Event | None] = [None] * num_buffers
        self.free: list[torch.cuda.Event | None] = [None] * num_buffers

    def flat(self, buffer: int) -> torch.Tensor:
        return self.buffers[buffer]

    def load(self, unit: Unit, buffer: int) -> LoadRecord:
        start = time.perf_counter()
        bytes_read, tier = unit.nbytes, "disk"
        staging: int | None = None
        if unit.index in self.cache:
            host = self.cache[unit.index]
            if unit.index in self.cached:
                bytes_read, tier = 0, "host"
            else:
                _read_unit(self.store, unit, host)
                self.cached.add(unit.index)
        else:
            staging = self.next_staging
            self.next_staging = (staging + 1) % len(self.staging)
            done = self.staging_done[staging]
            if done is not None:
                done.synchronize()  # the previous copy out of this staging buffer has finished
            host = self.staging[staging]
            _read_unit(self.store, unit, host)
        read_end = time.perf_counter()
        copy_start = cuda_event()
        copy_end = cuda_event()
        with torch.cuda.stream(self.copy_stream):
            free = self.free[buffer]
            if free is not None:
                self.copy_stream.wait_event(free)  # the last compute that read this buffer is done
            copy_start.record(self.copy_stream)
            self.buffers[buffer][: unit.nbytes].copy_(host[: unit.nbytes], non_blocking=self.pin)
            copy_end.record(self.copy_stream)
        if staging is not None:
            self.staging_done[staging] = copy_end
        self.ready[buffer] = copy_end
        if self.blocking:
            copy_end.synchronize()
        return LoadRecord(unit.index, unit.nbytes, bytes_read, tier, start, read_end, (copy_start, copy_end))

    def mark_wait(self) -> Any:
        """An event on the compute stream recorded when the consumer starts waiting for a unit."""
        event = cuda_event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def before_compute(self, unit: Unit, buffer: int, load: LoadRecord, wait: Any) -> ComputeRecord | None:
        stream = torch.cuda.current_stream(self.device)
        wait_start: torch.cuda.Event = wait
        compute_start = cuda_event()
        compute_end = cuda_event()
        ready = self.ready[buffer]
        if ready is not None:
            stream.wait_event(ready)
        compute_start.record(stream)
        return ComputeRecord(unit.index, unit.label, load, (wait_start, compute_start, compute_end))

    def after_compute(self, buffer: int, record: ComputeRecord | None) -> None:
        stream = torch.cuda.current_stream(self.device)
        if record is not None:
            record.events[2].record(stream)
            self.free[buffer] = record.events[2]
        else:
            event = cuda_event(timing=False)
            event.record(stream)
            self.free[buffer] = event
        if self.blocking:
            stream.synchronize()

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self.buffers = []
        self.staging = []
        self.cache = {}
