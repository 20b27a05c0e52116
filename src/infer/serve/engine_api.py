"""The engine interface the server is written against (docs/serving.md, *Design*).

The names come from `infer.engine` (the continuous-batching engine that owns a loaded
model); kept in one place so the HTTP layer imports them from here.
"""

from __future__ import annotations

from infer.serve.interim import Delta, Engine, EngineFull, RequestHandle, SamplingParams, TokenLogprob

__all__ = ["Delta", "Engine", "EngineFull", "RequestHandle", "SamplingParams", "TokenLogprob"]
