"""Layer streaming: run models larger than the device memory, one layer group at a time.

``infer.load(path, streaming=StreamingConfig(memory_budget=...))`` builds the model with
`build_streamed` into a `StreamStore`; `plan_memory` decides what stays resident and what streams
through reused group buffers; `StreamingExecutor` runs the walk while a background reader loads
the next group. See docs/streaming.md.
"""

from __future__ import annotations

from infer.streaming.build import build_streamed, plan_streamed
from infer.streaming.config import StreamingConfig, format_bytes, parse_bytes
from infer.streaming.executor import StreamingExecutor
from infer.streaming.plan import BudgetError, MemoryPlan, PlanInputs, plan_memory
from infer.streaming.stats import ProgressEvent, StreamingStats, TimelineEntry
from infer.streaming.store import StreamStore, TensorRef, WeightStore

__all__ = [
    "BudgetError",
    "MemoryPlan",
    "PlanInputs",
    "ProgressEvent",
    "StreamStore",
    "StreamingConfig",
    "StreamingExecutor",
    "StreamingStats",
    "TensorRef",
    "TimelineEntry",
    "WeightStore",
    "build_streamed",
    "format_bytes",
    "parse_bytes",
    "plan_memory",
    "plan_streamed",
]
