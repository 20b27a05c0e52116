"""What the server uses of an engine and of a submitted request: `EngineClient`, `HandleClient`.

`infer.engine.Engine` and its `infer.engine.RequestHandle` have all of it; so do the scripted
engines of the server's tests (tests/serve/fake_engine.py). Nothing else of an engine is read.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol

from infer.engine import Delta, ServedModel
from infer.params import SamplingParams
from infer.sampling import Sampling
from infer.text.structured import Grammars


class HandleClient(Protocol):
    """A submitted request as the server reads it."""

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length in tokens (the response's ``usage``)."""
        ...

    def aiter(self) -> AsyncIterator[Delta]:
        """The request's events in the event loop, the last with a ``finish_reason``."""
        ...

    def cancel(self) -> None:
        """End the request (its stream ends with "cancelled"); a no-op once it has ended."""
        ...


class EngineClient(Protocol):
    """An engine as the server drives it (`infer.engine.Engine`)."""

    @property
    def served(self) -> ServedModel:
        """The model it serves, as a server shows it: name, tokenizer, vocabulary, context."""
        ...

    @property
    def context(self) -> int:
        """Prompt + generated tokens of one request at most (``/v1/models``' ``max_model_len``)."""
        ...

    @property
    def max_batch(self) -> int:
        """Requests generated together at most (the compiled steps queued at start)."""
        ...

    @property
    def grammars(self) -> Grammars:
        """The compiled constraints (a schema it cannot enforce is a 400 before submitting)."""
        ...

    def submit_many(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
    ) -> Sequence[HandleClient]:
        """Queue the requests of one response (its prompts' choices) whole or not at all:
        `infer.engine.EngineFull` when the queue is full, `infer.engine.EngineClosed` after `close`,
        `ValueError` (`infer.params.ParamError` naming the argument) for a bad one."""
        ...

    def stats(self) -> Mapping[str, float | int]:
        """Counters for ``/metrics`` (running, waiting, batch_size, ...)."""
        ...

    def prepare(self, rows: Sequence[int], modes: Sequence[Sampling]) -> list[str]:
        """Queue the builds of the compiled decode steps of these shapes (the keys queued)."""
        ...

    def serving(self) -> contextlib.AbstractContextManager[None]:
        """Around a server's run (under torchrun: the other ranks kept following, then let go)."""
        ...

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting and end the loop."""
        ...


__all__ = ["EngineClient", "HandleClient"]
