"""Bases for the scripted engines the server tests pass to `create_app` in place of `infer.engine.Engine`.

`FakeEngine` and `FakeHandle` have what `infer.serve.client.EngineClient` / `HandleClient` list (mypy
checks it below); each test's engine writes its own ``submit`` and each handle its script as
``__iter__``, which ``aiter`` reads on a worker thread (a script may sleep between events). A fake
engine describes a tokenizer (`infer.engine.ServedModel`): it needs no model.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from infer.engine import Delta, ServedModel
from infer.params import SamplingParams
from infer.sampling import Sampling
from infer.text.structured import Grammars

if TYPE_CHECKING:
    from infer.serve.client import EngineClient, HandleClient


class FakeHandle:
    """A request whose events are its ``__iter__`` (none here): override it, and ``cancel``."""

    prompt_tokens = 0

    def __iter__(self) -> Iterator[Delta]:
        return iter(())

    async def aiter(self) -> AsyncIterator[Delta]:
        events = iter(self)
        while (delta := await asyncio.to_thread(next, events, None)) is not None:
            yield delta

    def cancel(self) -> None:
        pass


class FakeEngine:
    """What the server reads of an engine besides ``submit`` (each test's own): the model it serves
    (a description of ``llm``'s tokenizer: anything with ``tokenizer``, ``config`` and ``eos_ids``),
    its context, the grammars, stats, close."""

    max_batch = 1

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.context: int = llm.config.max_position_embeddings
        self.served = ServedModel("tiny", llm.tokenizer, llm.config.vocab_size, self.context)

    @functools.cached_property
    def grammars(self) -> Grammars:
        return Grammars(self.llm.tokenizer, self.llm.config.vocab_size, sorted(self.llm.eos_ids))

    def prepare(self, rows: Sequence[int], modes: Sequence[Sampling]) -> list[str]:
        return []

    def serving(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def submit(self, prompt: list[int], params: SamplingParams) -> Any:
        raise NotImplementedError("each test's engine submits its own way")

    def submit_many(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> list[Any]:
        return [self.submit(p, q) for p, q in zip(prompts, params, strict=True)]

    def stats(self) -> dict[str, int]:
        return {"running": 0, "waiting": 0}

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        pass


if TYPE_CHECKING:  # the fakes have what the server uses of an engine and of a handle

    def _conforms(engine: FakeEngine, handle: FakeHandle) -> tuple[EngineClient, HandleClient]:
        return engine, handle
