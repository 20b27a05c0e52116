"""A request body has a size limit (issue 29): 413 before the body is read whole.

Raw sockets on 127.0.0.1, so the test controls what is sent: a ``Content-Length`` past the
limit is answered without a byte of the body sent; a chunked body is refused while the
client still has most of it to send; a body under the limit is served.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from openai import OpenAI

from .conftest import LiveServer

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def base(live_server: LiveServer, tiny_llm: Any) -> str:
    return live_server(tiny_llm, max_body_bytes=LIMIT)


def _connect(base: str) -> socket.socket:
    url = urlsplit(base)
    sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=10)
    return sock


def _response(sock: socket.socket, deadline_s: float = 10.0) -> tuple[int, dict[str, Any]]:
    """Read one HTTP response (``Connection: close`` or a Content-Length): status and JSON body."""
    data = b""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            lines = head.split(b"\r\n")
            found = [
                int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:")
            ]
            length = found[0] if found else None
            if length is not None and len(body) >= length:
                break
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, json.loads(body)


def test_declared_length_past_the_limit_is_refused_before_the_body(base: str) -> None:
    """200 MB announced, nothing sent: the answer comes at once, 413 with OpenAI's error body."""
    with _connect(base) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 209715200\r\n\r\n"
        )
        status, body = _response(sock)
    print(f"\n413 body: {body}")
    assert status == 413
    assert body["error"]["code"] == "request_too_large"
    assert "209715200" in body["error"]["message"] and str(LIMIT) in body["error"]["message"]


def test_chunked_body_past_the_limit_is_refused_while_it_arrives(base: str) -> None:
    """A chunked body (no Content-Length): refused once LIMIT bytes have come, long before the
    client has sent all of it (it offers 64x the limit; at most a few chunks past it are sent)."""
    chunk = b"x" * 4096
    offered = 64 * LIMIT
    sent = 0
    with _connect(base) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        sock.settimeout(0.01)
        answered = b""
        while sent < offered:
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break
            sent += len(chunk)
            try:
                answered = sock.recv(65536)
            except (TimeoutError, BlockingIOError):
                continue
            if answered:
                break
        sock.settimeout(10)
        status = int(answered.split(b" ")[1]) if answered else _response(sock)[0]
    print(f"\nsent {sent} of {offered} bytes before the 413")
    assert status == 413
    assert sent < offered // 4


def test_body_under_the_limit_is_served(base: str) -> None:
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="x" * 100, max_tokens=2, temperature=0)
    assert out.choices[0].text is not None
    # One byte past the limit with a Content-Length: 413 through an ordinary client too.
    r = httpx.post(
        base + "/v1/completions", content=b" " * (LIMIT + 1), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413, r.text


def test_bad_limit_is_refused(tiny_llm: Any) -> None:
    from infer.serve import create_app

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_body_bytes must be an int >= 1"):
            create_app(tiny_llm, max_body_bytes=bad)  # type: ignore[arg-type]
