"""The generation engine: one loop owns a loaded model and steps every running request together.

The rooms, in the order a step passes through them (docs/engine.md has the flow of one step):

* `core` — `Engine`: submit, close, stats, and `Engine.step`: schedule -> run -> sample -> output;
* `scheduler` — `Scheduler`: the waiting queue, the running requests by row, admission (the
  prefix cache, shared prefixes), the rows each step feeds;
* `slots` — `KVSlots`: the KV memory (rows of slots, grown and shrunk; shared prefixes through
  `infer.runtime.prefix.PrefixStore`); it never runs the model;
* `runner` — `Runner`: the one place that runs the model (steps, verify passes, exact logits);
* `parallel` — under ``torchrun``: rank 0's runner sends every step to the other ranks, which
  replay it on their own part of the model (`follow`);
* `sampling` — what a step samples with; the host-side fix-ups of processed rows;
* `output` — `Outputs`: what each sampled token does to its request (EOS, length, logprobs);
* `request` — `Request` (the engine's record), `RequestHandle` (the caller's side, which decodes
  the text off the model's thread), `Delta`;
* `text` — `TextStream`: incremental detokenizing, stop strings;
* `driver` — `Driver`: which thread runs the iterations.

Speculative decoding proposes and verifies in `infer.speculative`; it returns tokens to the
engine, which takes them through the same output stage.
"""

from infer.engine.core import Engine, Model
from infer.engine.driver import HANDOVER_S, IDLE_EXIT_S
from infer.engine.request import Delta, EngineClosed, EngineFull, RequestHandle, TokenLogprob, collect
from infer.engine.runner import Runner
from infer.engine.slots import KVSlots
from infer.params import MAX_LOGPROBS, SamplingParams

__all__ = [
    "HANDOVER_S",
    "IDLE_EXIT_S",
    "MAX_LOGPROBS",
    "Delta",
    "Engine",
    "EngineClosed",
    "EngineFull",
    "KVSlots",
    "Model",
    "RequestHandle",
    "Runner",
    "SamplingParams",
    "TokenLogprob",
    "collect",
]
