"""What the streaming executor reports: counters, progress events and an optional timeline."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

LOADED = "loaded"
COMPUTED = "computed"


@dataclass(frozen=True)
class ProgressEvent:
    """One step of the streaming schedule, passed to ``StreamingConfig.on_progress``.

    ``kind`` is ``"loaded"`` (the unit's weights are in a device buffer; ``seconds``
    is the reader's time for it) or ``"computed"`` (the unit's layers ran; ``seconds``
    is the host time spent running them). ``group`` is the layer group index, or
    ``None`` for a chunk of a streamed ``lm_head``; ``layers`` lists the layer indices.
    ``tier`` says where the bytes came from: ``"disk"`` (the checkpoint) or ``"host"``
    (the pinned host cache).
    """

    kind: str
    unit: int
    group: int | None
    layers: tuple[int, ...]
    nbytes: int
    seconds: float
    tier: str = "disk"


@dataclass(frozen=True)
class TimelineEntry:
    """An interval on one lane (``read``, ``copy`` or ``compute``), seconds since the executor started."""

    lane: str
    unit: int
    label: str
    start: float
    end: float


@dataclass
class StreamingStats:
    """Counters of a streaming executor since it was built (or since `reset`).

    * ``bytes_loaded``: weight bytes moved into the group buffers.
    * ``bytes_read``: of those, bytes read from the checkpoint (the rest came from
      the pinned host cache).
    * ``load_seconds``: time the reader spent reading, converting and copying.
    * ``wait_seconds``: time compute waited for weights (the part of loading not
      hidden behind compute).
    * ``compute_seconds``: time spent running streamed units (host time on CPU, GPU
      time from events on CUDA).
    * ``peak_weight_bytes``: weight bytes on the device: resident weights + buffers.
    * ``planned_bytes``: everything the plan reserved (weights, buffers, KV cache,
      workspace), which stays within the budget.
    """

    bytes_loaded: int = 0
    bytes_read: int = 0
    units_loaded: int = 0
    units_computed: int = 0
    forwards: int = 0
    load_seconds: float = 0.0
    wait_seconds: float = 0.0
    compute_seconds: float = 0.0
    peak_weight_bytes: int = 0
    planned_bytes: int = 0
    resident_layers: int = 0
    streamed_layers: int = 0
    timeline: list[TimelineEntry] = field(default_factory=list)

    @property
    def bytes_from_host_cache(self) -> int:
        return self.bytes_loaded - self.bytes_read

    @property
    def hidden_fraction(self) -> float:
        """Fraction of the load time hidden behind compute: ``1 - wait / load`` (1.0 when nothing loaded)."""
        if self.load_seconds <= 0:
            return 1.0
        return max(0.0, 1.0 - self.wait_seconds / self.load_seconds)

    def copy(self) -> StreamingStats:
        return dataclasses.replace(self, timeline=list(self.timeline))

    def reset(self) -> None:
        """Zero the counters and the timeline (the plan facts stay)."""
        fresh = StreamingStats(
            peak_weight_bytes=self.peak_weight_bytes,
            planned_bytes=self.planned_bytes,
            resident_layers=self.resident_layers,
            streamed_layers=self.streamed_layers,
        )
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(fresh, f.name))
