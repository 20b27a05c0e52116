"""An OpenAI-compatible HTTP server for a loaded model (docs/serving.md).

`create_app(llm_or_engine)` is the ASGI app (FastAPI) for embedding in your own server;
`serve(llm, host=, port=)` runs it under uvicorn (what ``infer serve`` does). `EngineClient`
lists what the server uses of an engine (`infer.engine.Engine` has it).
"""

from __future__ import annotations

from infer.serve.app import APIError, create_app
from infer.serve.client import EngineClient
from infer.serve.server import serve

__all__ = ["APIError", "EngineClient", "create_app", "serve"]
