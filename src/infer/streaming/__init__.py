"""Layer streaming: run models larger than the device memory, one layer group at a time.

``infer.load(path, device=..., streaming=StreamingConfig(memory_budget=...))`` builds
the model with `build_streamed`: the same walk over the checkpoint as a resident load,
whose destination is a `StreamStore`; the plan (`plan_memory`) decides which layers
stay resident and which stream through preallocated, reused group buffers;
`StreamingExecutor` replaces the model's executor and a background reader keeps the
next group loaded while the current one computes. See ``docs/streaming.md``.
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
