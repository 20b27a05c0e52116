"""The generation engine: one loop owns a loaded model and steps every running request together.

Each iteration is one plan (`plan.Plan`) handed from room to room: `core` (`Engine.step`:
schedule -> run -> sample -> output), `scheduler`, `plan`, `runner` (the one place that runs a
model), `parallel` (under torchrun), `sampling`, `output`, `request`, `text`, `driver`, `served`.
docs/engine.md has the flow of one plan; docs/architecture.md, *The engine's rooms*, each room's job.
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
