"""An OpenAI-compatible HTTP server for a loaded model (docs/serving.md).

`create_app(llm_or_engine)` is the ASGI app (FastAPI) for embedding in your own server;
`serve(llm, host=, port=)` runs it under uvicorn (what ``infer serve`` does).
"""

from __future__ import annotations

from infer.serve.app import APIError, create_app
from infer.serve.server import serve

__all__ = ["APIError", "create_app", "serve"]
