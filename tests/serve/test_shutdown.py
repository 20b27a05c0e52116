"""SIGTERM: `infer serve` stops admitting, finishes running streams, exits 0; a fault ends one request."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from .fake_engine import FakeEngine, FakeHandle

LiveServer = Callable[..., str]  # tests/serve/conftest.py's live_server
SRC = Path(__file__).resolve().parents[2] / "src"
TIMEOUT = httpx.Timeout(60.0)


def _events(lines: Any) -> list[Any]:
    out: list[Any] = []
    for line in lines:
        if line:
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.slow
def test_sigterm_finishes_running_streams_and_exits_0(tiny_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    argv = [sys.executable, "-m", "infer", "serve", str(tiny_path), "--port", "0", "--quiet"]
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # "infer: serving 'x' on http://127.0.0.1:PORT (...)", after loading
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert match, f"no address announced: {line!r}"
        base = f"http://127.0.0.1:{match.group(1)}"
        body = {"prompt": "Once", "max_tokens": 60, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            events = [json.loads(first.removeprefix("data: ")), *_events(lines)]
        print(f"{len(events)} events after SIGTERM in {time.monotonic() - sent:.2f} s; last {events[-2:]}")
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert last["choices"][0]["finish_reason"] == "length"  # drained: the stream ran to its end
        try:
            late = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
            assert late.status_code == 503, late.text  # before the socket closes: refused politely
        except httpx.TransportError:
            pass  # the listening socket is closed: nothing is admitted
        code = proc.wait(timeout=60)
        err = proc.stderr.read()
        print(f"exit {code}; stderr {err!r}")
        assert code == 0
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_shutdown_timeout_ends_streams_with_a_final_event(live_server: LiveServer, tiny_path: Path) -> None:
    """Past the drain timeout each running stream gets an error event and ``[DONE]``; new requests 503."""
    import infer
    from infer.serve import create_app

    app = create_app(infer.load(tiny_path))
    base = live_server(app)
    body = {"prompt": "Once", "max_tokens": 240, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        next(line for line in lines if line)
        app.state.serve.begin_shutdown(0.0)
        events = _events(lines)
    print(f"last events {events[-2:]}")
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "shutting_down"
    late = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT)
    assert late.status_code == 503 and "Retry-After" in late.headers
    assert httpx.get(base + "/health", timeout=TIMEOUT).json() == {"status": "draining"}


class _FailingEngine(FakeEngine):
    """An engine whose requests for a prompt holding token 7 fail; others stream three tokens."""

    def __init__(self, llm: Any) -> None:
        from infer.engine import Delta

        super().__init__(llm)
        self.Delta = Delta
        self.context = 256

    def submit(self, prompt: list[int], params: Any) -> Any:
        Delta = self.Delta
        fail = 7 in prompt

        class Handle(FakeHandle):
            id = "fake"
            prompt_tokens = len(prompt)

            def __iter__(self) -> Any:
                yield Delta([65], "A", None, None)
                if fail:
                    yield Delta([], "", None, "error", "non-finite logits at decode step 1, batch row 0")
                    return
                yield Delta([66], "B", None, None)
                yield Delta([67], "C", None, "length")

            def cancel(self) -> None:
                pass

        return Handle()


def test_one_failing_request_ends_alone(live_server: LiveServer, tiny_llm: Any) -> None:
    base = live_server(_FailingEngine(tiny_llm))
    results: dict[str, Any] = {}

    def run(name: str, prompt: list[int], stream: bool) -> None:
        body = {"prompt": prompt, "max_tokens": 3, "stream": stream}
        if stream:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=TIMEOUT) as r:
                results[name] = (r.status_code, _events(r.iter_lines()))
        else:
            r = httpx.post(base + "/v1/completions", json=body, timeout=TIMEOUT)
            results[name] = (r.status_code, r.json())

    threads = [
        threading.Thread(target=run, args=("bad-stream", [7, 8], True)),
        threading.Thread(target=run, args=("bad", [7], False)),
        threading.Thread(target=run, args=("good-stream", [9, 10], True)),
        threading.Thread(target=run, args=("good", [9], False)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    print(json.dumps(results)[:1500])
    status, events = results["bad-stream"]
    assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "generation_error"
    assert "non-finite" in events[-2]["error"]["message"]
    status, body = results["bad"]
    assert status == 500 and "non-finite" in body["error"]["message"]
    status, events = results["good-stream"]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "ABC"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    status, body = results["good"]
    assert status == 200 and body["choices"][0]["text"] == "ABC"


class _SlowEngine(FakeEngine):
    """An engine whose requests produce a token every 50 ms until cancelled; it records cancels."""

    def __init__(self, llm: Any) -> None:
        from infer.engine import Delta

        super().__init__(llm)
        self.Delta = Delta
        self.context = 256
        self.cancelled = threading.Event()
        self.submitted = threading.Event()

    def submit(self, prompt: list[int], params: Any) -> Any:
        engine = self
        self.submitted.set()

        class Handle(FakeHandle):
            id = "slow"
            prompt_tokens = len(prompt)

            def __iter__(self) -> Any:
                for _ in range(400):
                    if engine.cancelled.is_set():
                        yield engine.Delta([], "", None, "cancelled")
                        return
                    time.sleep(0.05)
                    yield engine.Delta([65], "A", None, None)
                yield engine.Delta([], "", None, "length")

            def cancel(self) -> None:
                engine.cancelled.set()

        return Handle()


def test_a_client_that_hangs_up_on_a_whole_response_cancels_it(
    live_server: LiveServer, tiny_llm: Any
) -> None:
    """Not streaming: the server notices the closed connection while it waits, and cancels the request."""
    import socket
    from urllib.parse import urlsplit

    engine = _SlowEngine(tiny_llm)
    base = urlsplit(live_server(engine))
    body = json.dumps({"prompt": [1, 2], "max_tokens": 200}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {base.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((base.hostname, base.port)) as sock:
        sock.sendall(head + body)
        time.sleep(0.5)  # generating
        assert engine.submitted.is_set() and not engine.cancelled.is_set()
    hung_up = time.monotonic()
    assert engine.cancelled.wait(10), "the request was not cancelled within 10 s of the client hanging up"
    print(f"cancelled {time.monotonic() - hung_up:.2f} s after the client hung up")
