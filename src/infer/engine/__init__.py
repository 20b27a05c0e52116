"""The generation engine: one loop owns a loaded model and steps every running request together.

Each iteration is one plan (`plan.Plan`) handed from room to room, in the order a step passes
through them (docs/engine.md has the flow of one plan):

* `core` — `Engine`: submit, close, stats, and `Engine.step`: schedule -> run -> sample -> output;
* `scheduler` — `Scheduler`: the waiting queue, the running requests by row, admission (the
  prefix cache, shared prefixes), the plan of each iteration (and all its policy: budget, chunks,
  buckets), and what the output stage's result does to its tables (`Scheduler.update`); the counters;
* `plan` — what flows: the `Plan` (the typed KV operations of `infer.kv.ops`, the forwards), and each
  stage's result;
* `runner` — `Runner`: the one place that runs the model (a plan's forwards, exact logits);
* `parallel` — under ``torchrun``: rank 0's runner sends every plan to the other ranks, which make
  its KV operations and run its forwards on their own part of the model (`Ranks`);
* `sampling` — `Sampler`: what a forward samples with; the host-side draws (processed rows, the
  tokens a verify pass keeps);
* `output` — `Outputs`: what each sampled token does to its request (EOS, length, logprobs), and
  how far each row is kept;
* `request` — `Request` (the engine's record), `RequestHandle` (the caller's side, which decodes
  the text off the model's thread, through `infer.text.stream`), `Delta`;
* `driver` — `Driver`: which thread runs the iterations, and the hand-off between threads;
* `served` — `ServedModel`: what a server shows of the model.

The KV memory the plan's operations change is `infer.kv.KVSlots`; speculative decoding proposes
in `infer.speculative`; a verify pass is a forward of the plan.
"""

from infer.engine.core import Engine, Model
from infer.engine.driver import HANDOVER_S, IDLE_EXIT_S
from infer.engine.request import Delta, EngineClosed, EngineFull, RequestHandle, TokenLogprob, collect
from infer.engine.runner import Runner
from infer.engine.served import ServedModel
from infer.params import MAX_LOGPROBS, SamplingParams

__all__ = [
    "HANDOVER_S",
    "IDLE_EXIT_S",
    "MAX_LOGPROBS",
    "Delta",
    "Engine",
    "EngineClosed",
    "EngineFull",
    "Model",
    "RequestHandle",
    "Runner",
    "SamplingParams",
    "ServedModel",
    "TokenLogprob",
    "collect",
]
