"""Layer streaming: run models larger than the device memory, one layer group at a time.

``infer.load(path, device=..., streaming=StreamingConfig(...))`` builds the model with
`build_streaming_model`: the plan (`plan_memory`) decides which layers stay resident
and which stream through preallocated, reused group buffers; `StreamingExecutor`
replaces the model's executor and a background reader keeps the next group loaded
while the current one computes. See ``docs/streaming.md``.
"""

from __future__ import annotations

from infer.streaming.build import build_from_source, build_streaming_model, build_streaming_model_gguf
from infer.streaming.config import StreamingConfig, format_bytes, parse_bytes
from infer.streaming.executor import StreamingExecutor
from infer.streaming.plan import BudgetError, MemoryPlan, plan_memory
from infer.streaming.source import SafetensorsSource, TensorRef, WeightSource
from infer.streaming.stats import ProgressEvent, StreamingStats, TimelineEntry

__all__ = [
    "BudgetError",
    "MemoryPlan",
    "ProgressEvent",
    "SafetensorsSource",
    "StreamingConfig",
    "StreamingExecutor",
    "StreamingStats",
    "TensorRef",
    "TimelineEntry",
    "WeightSource",
    "build_from_source",
    "build_streaming_model",
    "build_streaming_model_gguf",
    "format_bytes",
    "parse_bytes",
    "plan_memory",
]
