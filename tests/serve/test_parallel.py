"""`infer serve --tensor-parallel 2` under torchrun (2 processes, gloo): rank 0 serves, both ranks step."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil  # type: ignore[import-untyped]
import pytest
from rank_env import SRC, torchrun


@dataclass
class Served:
    """A ``torchrun --nproc-per-node 2 -m infer serve`` run: its base URL, and `stop`."""

    base: str
    proc: subprocess.Popen[str]
    err_lines: list[str]
    drain: threading.Thread

    def stop(self) -> None:
        """SIGTERM to rank 0: it drains and tells rank 1 to stop; torchrun sees both exit 0, with
        no traceback on stderr."""
        workers = psutil.Process(self.proc.pid).children()
        rank0 = next(w for w in workers if w.environ().get("RANK") == "0")
        rank0.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=90)
        self.drain.join(timeout=10)
        err = "".join(self.err_lines)
        print(f"torchrun exit {code}; stderr tail {err[-1500:]!r}")
        assert "Traceback" not in err and "RankFailedError" not in err, err[-2000:]
        assert code == 0


@contextlib.contextmanager
def torchrun_server(tiny_path: Path, tmp_path: Path, *flags: str) -> Iterator[Served]:
    """The server on the tiny checkpoint, 2 ranks of one thread, on a free port; killed on the way
    out if the test did not stop it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    serve = ["serve", str(tiny_path), "--port", "0", "--quiet", "--dtype", "float32", *flags]
    argv = [sys.executable, *torchrun(2, tmp_path), "-m", "infer", *serve]
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    err_lines: list[str] = []
    try:
        assert proc.stderr is not None
        match = None
        for line in proc.stderr:  # torchrun's own lines, then rank 0's announcement
            err_lines.append(line)
            match = re.search(r"serving .* on http://127\.0\.0\.1:(\d+)", line)
            if match:
                break
        assert match, f"no address announced: {''.join(err_lines)[-2000:]}"
        drain = threading.Thread(target=lambda: err_lines.extend(proc.stderr or []), daemon=True)
        drain.start()
        yield Served(f"http://127.0.0.1:{match.group(1)}", proc, err_lines, drain)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--tensor-parallel"])  # --pipeline-parallel passes too (kept out: time)
def test_parallel_server_answers_as_one_process(
    tiny_path: Path, tiny_llm: Any, flag: str, tmp_path: Path
) -> None:
    with torchrun_server(tiny_path, tmp_path, flag, "2") as server:
        base = server.base
        import infer

        one = infer.load(tiny_path, dtype="float32")
        expected = one.generate("Hello there", max_new_tokens=8)
        r = httpx.post(
            base + "/v1/completions",
            json={"prompt": "Hello there", "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        print(f"{flag} 2: {r.status_code} {r.text[:300]}; one process: {expected.text!r}")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected.text
        messages = [{"role": "user", "content": "hi"}]
        chat = one.chat(messages, max_new_tokens=6).text
        body = {"messages": messages, "max_tokens": 6, "temperature": 0, "stream": True}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        import json

        text = "".join(json.loads(x[6:])["choices"][0]["delta"].get("content") or "" for x in lines[:-1])
        assert text == chat
        # a streamed request cancelled by its client: both ranks stop it at the same step, the next one works
        long = {"prompt": "Once", "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=long, timeout=120) as s:
            next(line for line in s.iter_lines() if line)
        again = httpx.post(
            base + "/v1/completions",
            json={"prompt": "Hello there", "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        assert again.json()["choices"][0]["text"] == expected.text
        # SIGTERM to the server (rank 0): it drains and tells rank 1 to stop; torchrun sees both exit 0
        server.stop()


def _metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--tensor-parallel", "--pipeline-parallel"])
def test_parallel_server_batches_streams_each_as_alone(tiny_path: Path, flag: str, tmp_path: Path) -> None:
    """Under torchrun, ``--deterministic``: 16 concurrent streaming clients (greedy and seeded
    sampling, ``ignore_eos``) and a chat request under a JSON schema run batched through rank 0's
    one engine (far fewer steps than one request at a time would take), and each gets exactly the
    text it gets alone on the same server."""
    import concurrent.futures

    from openai import OpenAI

    with torchrun_server(tiny_path, tmp_path, "--deterministic", flag, "2") as server:
        base = server.base
        client = OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
        model = client.models.list().data[0].id
        words = ["Once", "Hello there", "The tiny model", "A", "In a hole", "Numbers:", "Why", "It was"]
        requests = [
            {
                "prompt": words[i % 8] + " " * (i // 8),
                "max_tokens": 12,
                "temperature": 0.0 if i % 2 == 0 else 0.8,
                "seed": 100 + i,
                "extra_body": {"ignore_eos": True},
            }
            for i in range(16)
        ]

        def run(req: dict[str, Any]) -> tuple[str, int]:
            stream = client.completions.create(model=model, stream=True, **req)
            text, finish, chunks = "", None, 0
            for chunk in stream:
                chunks += 1
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            assert finish == "length", finish  # ignore_eos: every max_tokens token, whatever they are
            return text, chunks

        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        form = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}

        def constrained() -> str:
            body = {"model": model, "messages": [{"role": "user", "content": "a number"}], "max_tokens": 12,
                    "temperature": 0, "response_format": form}  # fmt: skip
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            content: str = r.json()["choices"][0]["message"]["content"]
            return content

        steps0 = _metric(base, "infer_engine_steps")
        with concurrent.futures.ThreadPoolExecutor(17) as pool:
            json_together = pool.submit(constrained)
            together = list(pool.map(run, requests))
            json_text = json_together.result()
        steps1 = _metric(base, "infer_engine_steps")
        alone = [run(req) for req in requests]
        steps2 = _metric(base, "infer_engine_steps")
        assert json_text == constrained() and json_text.startswith("{"), json_text
        together_steps, alone_steps = steps1 - steps0, steps2 - steps1
        print(f"{flag} 2: 16 streams in {together_steps:.0f} steps together, {alone_steps:.0f} one at a time")
        for i, ((a, _), (b, _)) in enumerate(zip(together, alone, strict=True)):
            assert a == b, f"request {i}: together {a!r}, alone {b!r}"
        assert together_steps < alone_steps / 2  # batched: not one request at a time
        server.stop()
