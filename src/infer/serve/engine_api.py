"""The engine interface the server is written against (`infer.engine`, docs/serving.md).

Kept in one place so the HTTP layer imports the names from here.
"""

from __future__ import annotations

from infer.engine import (
    Delta,
    Engine,
    EngineClosed,
    EngineFull,
    RequestHandle,
    SamplingParams,
    TokenLogprob,
)

__all__ = ["Delta", "Engine", "EngineClosed", "EngineFull", "RequestHandle", "SamplingParams", "TokenLogprob"]
