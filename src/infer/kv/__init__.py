"""KV memory: where a model's keys and values live between steps, and how they change.

`cache` (`KVCache`, a step's `StepPlan`/`StepKV`), `ops` (the typed KV operations), `prefix`
(`PrefixStore`, shared prefixes) and `slots` (`KVSlots`, the engine's rows). Below the models:
nothing here imports a model (a model is a `KVModel`). See docs/architecture.md and docs/engine.md.
"""

from infer.kv.cache import (
    KEY_CHUNK,
    KV_DTYPES,
    KVCache,
    KVModel,
    LayerKV,
    SharedPrefix,
    StepKV,
    StepPlan,
    bucket,
    round_up,
    slot_mask,
)
from infer.kv.ops import Done, KVOp, Reserve, Rollback, SetBound, SharePrefix, Shrink
from infer.kv.prefix import PrefixStore, Segment, common_prefix
from infer.kv.slots import BOUND_MARGIN, MIN_SLOTS, KVSlots

__all__ = [
    "BOUND_MARGIN",
    "KEY_CHUNK",
    "KV_DTYPES",
    "MIN_SLOTS",
    "Done",
    "KVCache",
    "KVModel",
    "KVOp",
    "KVSlots",
    "LayerKV",
    "PrefixStore",
    "Reserve",
    "Rollback",
    "Segment",
    "SetBound",
    "SharePrefix",
    "SharedPrefix",
    "Shrink",
    "StepKV",
    "StepPlan",
    "bucket",
    "common_prefix",
    "round_up",
    "slot_mask",
]
