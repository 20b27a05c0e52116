"""What cannot combine: the one table of option pairs infer refuses (`REFUSED`: the check of their
stage, `check_load`, `check_intervention` or `check_request`, raises a `ValueError` naming both
options as given, and why), and of those where one gives way (`GIVES_WAY`: what runs instead, and
the code that decides it). docs/architecture.md (*What cannot combine*) shows both tables as
`markdown` writes them; tests/unit/test_combinations.py checks that it does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Stage = Literal["load", "intervene", "submit"]


@dataclass(frozen=True)
class Refused:
    """``first`` and ``second`` cannot run together (checked at ``stage``), because ``reason``."""

    first: str
    second: str
    stage: Stage
    reason: str


@dataclass(frozen=True)
class GivesWay:
    """With ``second``, ``first`` has no effect: ``instead`` runs (decided in ``decided``)."""

    first: str
    second: str
    instead: str
    decided: str


# An option's name in the tables: a key of what each check is given.
COMPILE = "compile=True"
STREAMING = "streaming"
STREAMED_EMBEDDINGS = "StreamingConfig(resident_embeddings=False)"
NO_HEAD = "StreamingConfig(head=False)"
TENSOR = "tensor_parallel > 1"
PIPELINE = "pipeline_parallel > 1"
QUANTIZE = "quantize"
INT8 = "quantize='int8'"
GGUF = "a GGUF file"
INTERVENTION = "an intervention"
SPECULATION = "lookup or draft"
CONSTRAINT = "a constraint"
LOGIT_BIAS = "logit_bias"
PENALTY = "a penalty"
LOGPROBS = "logprobs"

_EAGER = "compile=True applies to one process; tensor- and pipeline-parallel models run eagerly"
_RANK_EMBEDDINGS = "a rank keeps its part of the embedding and head resident (a vocabulary slice, a stage's)"
_HEADLESS = "a model without its head computes activations in one process (`infer.lens`)"
_ONE_PROCESS = (
    "interventions run in one process, not under tensor/pipeline parallelism "
    "(a rank holds part of each block, or some of the blocks)"
)

REFUSED: tuple[Refused, ...] = (
    Refused(
        COMPILE,
        STREAMING,
        "load",
        "compile=True applies to resident models; a streamed model runs eagerly "
        "(its layers' weights are swapped between steps)",
    ),
    Refused(COMPILE, TENSOR, "load", _EAGER),
    Refused(COMPILE, PIPELINE, "load", _EAGER),
    Refused(
        QUANTIZE,
        GGUF,
        "load",
        "quantize= applies to safetensors checkpoints; a GGUF file is already quantized",
    ),
    Refused(
        INT8,
        TENSOR,
        "load",
        "int8's scale is one per output row, over the row's whole input, which tensor parallelism splits "
        "across ranks in o_proj and down_proj: each rank would quantize a model other than one process's "
        "(q4_0's 32-value groups stay within a rank)",
    ),
    Refused(
        STREAMED_EMBEDDINGS,
        QUANTIZE,
        "load",
        "a quantized head stays resident (the embedding and head stream only as float matrices)",
    ),
    Refused(STREAMED_EMBEDDINGS, TENSOR, "load", _RANK_EMBEDDINGS),
    Refused(STREAMED_EMBEDDINGS, PIPELINE, "load", _RANK_EMBEDDINGS),
    Refused(NO_HEAD, TENSOR, "load", _HEADLESS),
    Refused(NO_HEAD, PIPELINE, "load", _HEADLESS),
    Refused(INTERVENTION, TENSOR, "intervene", _ONE_PROCESS),
    Refused(INTERVENTION, PIPELINE, "intervene", _ONE_PROCESS),
)

GIVES_WAY: tuple[GivesWay, ...] = (
    GivesWay(
        'compile="auto" (the CPU default)',
        "deterministic, streaming, tensor/pipeline_parallel > 1, a device other than CPU, "
        "or packed weights without a kernel (a GGUF file at float32)",
        "every step eagerly (no ahead-of-time package)",
        "`infer.api.load`, `infer.aot.pays`",
    ),
    GivesWay(
        'compile=True or "auto"',
        "an intervention (any forward hook on the model)",
        "every step eagerly while it is present: compiled graphs and packages run no Python",
        "`infer.execution.Execution`",
    ),
    GivesWay(
        "compile=True",
        "lookup or draft",
        "verify passes eagerly (their widths change with every proposal); plain decode steps compiled",
        "`infer.execution.Execution`",
    ),
    GivesWay(
        "lookup or draft",
        "a constraint, logit_bias or a penalty (on any request of the step)",
        "plain decode steps: a pass would verify proposals against processed logits, position by position",
        "`infer.speculative.Speculator.propose`",
    ),
    GivesWay(
        "cache=True",
        "streaming or tensor/pipeline_parallel > 1",
        "a GGUF file's matrices converted at every load, nothing written",
        "`infer.loading.Checkpoint.repack_cache`",
    ),
)


def check(given: Mapping[str, str], stage: Stage) -> None:
    """`ValueError` for the first pair of `REFUSED` at ``stage`` that ``given`` holds both of.

    ``given``: the options present, each table name -> the option as the caller gave it
    (``"tensor_parallel=2"``), which the error names."""
    for rule in REFUSED:
        if rule.stage == stage and rule.first in given and rule.second in given:
            raise ValueError(f"{given[rule.first]} cannot combine with {given[rule.second]}: {rule.reason}")


def _parallel(tensor_parallel: int, pipeline_parallel: int) -> dict[str, str]:
    given = {}
    if tensor_parallel != 1:
        given[TENSOR] = f"tensor_parallel={tensor_parallel}"
    if pipeline_parallel != 1:
        given[PIPELINE] = f"pipeline_parallel={pipeline_parallel}"
    return given


def check_load(
    *,
    compile: Any = None,
    streaming: Any = None,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    quantize: str | None = None,
    gguf: str | None = None,
) -> None:
    """The load's pairs of `REFUSED` (`infer.load`, before anything is read; ``gguf``, the path of a
    GGUF file, in `infer.loading.Checkpoint.options`, where the format is known).
    ``streaming``: the `infer.StreamingConfig`, or None."""
    given = _parallel(tensor_parallel, pipeline_parallel)
    if compile is True:
        given[COMPILE] = "compile=True"
    if streaming is not None:
        given[STREAMING] = "streaming"
        if getattr(streaming, "resident_embeddings", None) is False:
            given[STREAMED_EMBEDDINGS] = STREAMED_EMBEDDINGS
        if getattr(streaming, "head", True) is False:
            given[NO_HEAD] = NO_HEAD
    if quantize is not None:
        given[QUANTIZE] = f"quantize={quantize!r}"
        if quantize == "int8":
            given[INT8] = f"quantize={quantize!r}"
    if gguf is not None:
        given[GGUF] = f"{GGUF} ({gguf})"
    check(given, "load")


def check_intervention(tensor_parallel: int = 1, pipeline_parallel: int = 1) -> None:
    """An intervention's pairs of `REFUSED` (`infer.notebook.NotebookMethods.intervene`)."""
    check({INTERVENTION: INTERVENTION, **_parallel(tensor_parallel, pipeline_parallel)}, "intervene")


def check_request(params: Any, *, speculative: bool = False) -> None:
    """A submitted request's pairs of `REFUSED` (`infer.engine.Engine.submit_many`): its options
    (``params``, an `infer.SamplingParams`) against each other and the engine's (``speculative``:
    lookup or a draft). No such pair is refused today (`GIVES_WAY` has those that run); a new one
    is a row of `REFUSED` at ``"submit"``."""
    given: dict[str, str] = {}
    if speculative:
        given[SPECULATION] = "lookup or draft"
    if params.constraint is not None:
        given[CONSTRAINT] = "a constraint"
    if params.logit_bias:
        given[LOGIT_BIAS] = "logit_bias"
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        given[PENALTY] = "a penalty"
    if params.logprobs is not None:
        given[LOGPROBS] = f"logprobs={params.logprobs}"
    check(given, "submit")


def markdown() -> str:
    """Both tables as docs/architecture.md shows them."""
    lines = ["| option | cannot combine with | checked | why |", "|---|---|---|---|"]
    lines += [f"| {r.first} | {r.second} | {r.stage} | {r.reason} |" for r in REFUSED]
    lines += ["", "| option | has no effect with | what runs instead | decided in |", "|---|---|---|---|"]
    lines += [f"| {g.first} | {g.second} | {g.instead} | {g.decided} |" for g in GIVES_WAY]
    return "\n".join(lines)


__all__ = [
    "GIVES_WAY",
    "REFUSED",
    "GivesWay",
    "Refused",
    "check",
    "check_intervention",
    "check_load",
    "check_request",
    "markdown",
]
