"""KV memory: where a model's keys and values live between steps, and how they change.

* `cache` — `KVCache`: preallocated K/V addressed by per-row slot tensors (float or int8 with
  scales, rings for sliding-window layers), a step's plan (`StepPlan`) and one layer's buffers
  bound to it (`StepKV`), a step's `SharedPrefix`; `bucket`, the powers of two of compiled shapes;
  `KVModel`, what KV memory needs of a model;
* `ops` — the typed KV operations (`Reserve`, `Rollback`, `SharePrefix`, `Shrink`, `SetBound`),
  each `Done` with its outcome: the engine's one way to change its slots;
* `prefix` — `PrefixStore`: prefixes several rows share, stored once as segments;
* `slots` — `KVSlots`: the engine's rows of slots, grown and shrunk on demand, rolled back, their
  shared prefixes in a `PrefixStore`; it never runs the model.

Below the models (`infer.models` imports the cache; nothing here imports a model: a model is a
`KVModel`).
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
