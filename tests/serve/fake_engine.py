"""A base for the scripted engines the server tests pass to `create_app` in place of `infer.engine.Engine`."""

from __future__ import annotations

from typing import Any


class FakeEngine:
    """What the server reads of an engine besides ``submit`` (each test's own): model, stats, close."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def stats(self) -> dict[str, int]:
        return {"running": 0, "waiting": 0}

    def close(self, drain: bool = True) -> None:
        pass
