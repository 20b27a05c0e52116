"""A live server on 127.0.0.1 for the tests of `infer serve`: uvicorn in a thread of this process.

``live_server(llm_or_engine, **create_app_kwargs)`` (or ``live_server(app)``) starts `create_app`'s app on
a free port and returns its base URL; every server started is stopped at the end of the
test module. ``tiny_llm`` is the tiny Llama checkpoint (it has a chat template), loaded
in the deterministic mode.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

LiveServer = Callable[..., str]


@pytest.fixture(scope="module")
def tiny_path(tiny_ckpt_factory: Callable[..., Path]) -> Path:
    return tiny_ckpt_factory("llama")


@pytest.fixture(scope="module")
def tiny_llm(tiny_path: Path) -> Any:
    import infer

    return infer.load(tiny_path, deterministic=True)


@pytest.fixture(scope="module")
def live_server() -> Iterator[LiveServer]:
    from infer.serve import create_app

    running: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(target: Any, **kwargs: Any) -> str:
        from fastapi import FastAPI

        app = target if isinstance(target, FastAPI) else create_app(target, **kwargs)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not start within 30 s")
            time.sleep(0.02)
        running.append((server, thread))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, _ in running:
        server.should_exit = True
    for _, thread in running:
        thread.join(timeout=30)
