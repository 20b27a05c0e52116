"""Running a fuzzing case (`infer.testing.fuzzing`) and naming its outcome: `run_case` feeds it
to the public entry points in order and `classify` names what an error means: rejected with a
documented error (``ValueError`` / ``OSError``; whether the message names the file),
memory-capped, or an undocumented exception, with the innermost `infer` source file it came
from (this module, the harness, left out)."""

from __future__ import annotations

import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infer.testing.fuzz_cases import Case

DOCUMENTED = (
    ValueError,
    OSError,
)  # the library's error types for bad input (FileNotFoundError, TimeoutError...)


@dataclass
class Outcome:
    """What one case did.

    ``outcome``: "loaded", "rejected", "rejected-unnamed" (a documented type whose message
    does not name the input), "memory-capped" or "undocumented".
    """

    index: int
    kind: str
    mutation: str
    outcome: str
    stage: str = ""
    error: str = ""  # exception type name
    origin: str = ""  # innermost infer source file in the traceback ("infer/gguf/reader.py")
    message: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_PACKAGE = Path(__file__).resolve().parents[1]  # the infer package


def infer_frames(exc: BaseException) -> list[str]:
    """The ``infer/...`` source files of the traceback, outermost first (this module left out)."""
    out = []
    for frame in traceback.extract_tb(exc.__traceback__):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(_PACKAGE) and path != Path(__file__).resolve():  # the harness is not a suspect
            out.append("infer/" + path.relative_to(_PACKAGE).as_posix())
    return out


def classify(exc: BaseException, names: tuple[str, ...], stage: str = "") -> tuple[str, str]:
    """(outcome, origin) of an exception raised by entry point ``stage`` given ``names`` (paths)."""
    frames = infer_frames(exc)
    origin = frames[-1] if frames else ""
    text = str(exc)
    if isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text)
    ):
        return "memory-capped", origin
    from infer.params import NonFiniteLogitsError

    if isinstance(exc, NonFiniteLogitsError):  # documented: weights whose activations overflow
        return "rejected", origin
    if isinstance(exc, DOCUMENTED):
        # After loading, a refused call (prompt longer than the context...) is about the call, not the file.
        named = stage == "generate" or any(name in text for name in names)
        return ("rejected" if named else "rejected-unnamed"), origin
    return "undocumented", origin


class CaseTimeout(BaseException):
    """Raised by SIGALRM in a case that overran its time limit (not an ``Exception``: never classified)."""


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise CaseTimeout


def run_case(
    case: Case, *, generate: bool = True, time_limit: float | None = None, reraise: bool = False
) -> Outcome:
    """Feed ``case`` to the public entry points, in order, until one raises.

    ``time_limit`` (seconds; main thread only) interrupts a case that runs longer with
    SIGALRM: its outcome is "hung", attributed like an error from where it was stopped.
    A hang inside native code is not interrupted; the caller needs its own backstop.
    ``reraise`` raises the first error after classifying it (to see its traceback).
    """
    import torch

    import infer
    from infer.gguf.reader import GGUFFile
    from infer.inspect import inspect_checkpoint
    from infer.loader.config import load_config
    from infer.streaming import StreamingConfig

    start = time.perf_counter()
    stages: list[tuple[str, Any]] = []
    if case.kind == "gguf":
        stages.append(("GGUFFile", lambda: GGUFFile(case.path)))
    else:
        stages.append(("load_config", lambda: load_config(case.path)))
    stages.append(("inspect_checkpoint", lambda: inspect_checkpoint(case.path)))
    streaming = (
        StreamingConfig(memory_budget="1GB", layer_group_size=1, max_resident_layers=0, max_context=64)
        if case.streaming
        else None
    )
    llm: list[Any] = []
    stages.append(("load", lambda: llm.append(infer.load(case.path, streaming=streaming))))
    if generate:
        stages.append(("generate", lambda: llm[0].generate("hi there", max_new_tokens=2)))
    names = (str(case.path), case.path.name)
    result = Outcome(
        case.index, case.kind, case.mutation + (" [streaming]" if case.streaming else ""), "loaded"
    )
    previous = signal.signal(signal.SIGALRM, _alarm) if time_limit is not None else None
    stage = ""
    try:
        if time_limit is not None:
            signal.setitimer(signal.ITIMER_REAL, time_limit)
        for stage, fn in stages:
            try:
                with torch.inference_mode():
                    fn()
            except Exception as e:  # classified, never swallowed: the caller decides what is acceptable
                outcome, origin = classify(e, names, stage)
                result.outcome, result.stage, result.error = outcome, stage, type(e).__name__
                result.origin, result.message = origin, str(e)[:300]
                if reraise:
                    raise
                break
    except CaseTimeout as e:
        frames = infer_frames(e)
        result.outcome, result.stage, result.error = "hung", stage, f"over {time_limit} s"
        result.origin = frames[-1] if frames else ""
        result.message = f"stopped after {time_limit} s in {result.origin or stage}"
    finally:
        if time_limit is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        llm.clear()
    result.seconds = time.perf_counter() - start
    return result
