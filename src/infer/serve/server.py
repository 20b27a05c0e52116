"""`infer serve`: run the app under uvicorn until SIGTERM or Ctrl-C, then exit 0.

On the first SIGTERM / SIGINT the server stops admitting (new generation requests get
503 + ``Retry-After``), closes its listening socket, lets running requests finish for
up to ``shutdown_timeout`` seconds and then cancels the rest, each stream ending with a
final error event and ``data: [DONE]``. A second signal exits at once.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from infer.serve.app import create_app
from infer.serve.body_limit import MAX_BODY_BYTES
from infer.serve.client import EngineClient
from infer.serve.state import ServeState

if TYPE_CHECKING:
    from infer.llm import LLM


class _Server(uvicorn.Server):
    """uvicorn's server with our signal handling: drain, then return (uvicorn re-raises the signal)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            self.on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def prepare_packages(engine: EngineClient) -> list[str]:
    """Queue, at start, the builds of the compiled decode steps a server will step (`infer.aot`):
    one row and 2-16 rows, greedy, sampled (OpenAI's default temperature is 1) and filtered
    (top-p / top-k), in that order. The background builder takes them in the gaps between
    requests and the engine picks each one up as it lands, so a server steps compiled code
    within minutes of starting, with nothing to wait for. The keys queued ([] where packages
    are off, or every one exists)."""
    from infer.sampling import Sampling

    rows = [1] + ([2] if engine.max_batch > 1 else [])
    modes = [Sampling(), Sampling(greedy=False), Sampling(greedy=False, filtered=True)]
    # One submission, built in its order: each mode for one row, then for several, the likeliest
    # mode first. (The builder takes the newest submission first: a call per mode had the
    # filtered steps built before the greedy ones.)
    return engine.prepare(rows, modes)


def serve(
    llm_or_engine: LLM | EngineClient,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    max_batch: int | None = None,
    max_waiting: int | None = None,
    max_body_bytes: int | None = None,
    shutdown_timeout: float = 30.0,
    log_level: str = "warning",
    announce: Callable[[str], None] | None = None,
) -> int:
    """Serve ``llm_or_engine`` (as `create_app` takes it) over HTTP until a signal; the exit status (0).

    Under tensor/pipeline parallelism (rank 0 of a torchrun) the engine is closed at the end and
    the other ranks told to stop following it (`EngineClient.serving`; they follow in
    `infer.engine.parallel.Ranks.follow`).
    """
    app = create_app(
        llm_or_engine, model_name=model_name, api_key=api_key, max_batch=max_batch, max_waiting=max_waiting,
        max_body_bytes=MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes,
    )  # fmt: skip
    state: ServeState = app.state.serve
    prepare_packages(state.engine)
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=int(shutdown_timeout) + 5,  # a backstop: the app ends streams first
        access_log=False,
        lifespan="on",
    )
    server = _Server(config, on_exit=lambda: state.begin_shutdown(shutdown_timeout))
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    message = f"infer: serving {state.model_name!r} on http://{shown}:{bound_port} (Ctrl-C or SIGTERM stops)"
    (announce or (lambda text: print(text, file=sys.stderr, flush=True)))(message)
    try:
        with state.engine.serving():  # under torchrun: the other ranks follow this engine's plans
            server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


__all__ = ["bind", "prepare_packages", "serve"]
