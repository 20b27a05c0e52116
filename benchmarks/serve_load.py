"""Load test of `infer serve`: many requests, random lengths, disconnects, a burst past the queue.

    uv run python benchmarks/serve_load.py                       # 1,000 requests on the shipped SmolLM2
    uv run python benchmarks/serve_load.py --requests 200 --model path/to/model.gguf

Starts ``infer serve MODEL --deterministic --max-batch 4 --max-waiting 4`` on a free 127.0.0.1 port
(or drives ``--url`` of a server you started) and sends ``--requests`` greedy ``/v1/completions``
requests (token-id prompts drawn from a pool of ``--distinct`` random prompts of 1 to
``--max-prompt`` tokens, ``max_tokens`` 1 to ``--max-new``, streaming or not, ``--concurrency`` at a
time), of which:

* about ``--disconnect`` of the streaming ones hang up after a random number of tokens;
* a few are deliberately bad (``temperature: -1``): each must get 400;
* after the first 100 (half, for fewer than 200), a burst of ``--burst`` requests at once, past
  ``max-batch + max-waiting``: each must be served correctly or get 429 (with ``Retry-After``).

Then every distinct prompt is served once more, alone, with the largest ``max_tokens`` asked of it,
and checked: every completed response equals (is the prefix of, for a smaller ``max_tokens``) that
answer; a disconnected stream's tokens are a prefix of it; a rejected request got 429 or 400 and
nothing else; the server's RSS after the run is within ``--rss-tolerance`` of its level after the
first 100 requests; ``/metrics`` shows 0 running and 0 waiting at the end. Exits 1 with one line per
violation, else 0; prints what it measured either way.

`run_load` is the reusable part (tests/serve/test_load_short.py runs a short version of it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Job:
    index: int
    prompt: int  # index into the prompt pool
    max_tokens: int
    stream: bool
    disconnect_after: int | None = None  # streaming: hang up after this many token chunks
    bad: bool = False  # a deliberately invalid request (400 expected)
    burst: bool = False


@dataclass
class Outcome:
    job: Job
    status: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    disconnected: bool = False
    retry_after: str | None = None
    error: str | None = None


@dataclass
class Report:
    outcomes: list[Outcome]
    rss_after_100: int | None  # after the first `first_count` requests (100, or half a short run)
    rss_end: int | None
    running_end: float | None
    waiting_end: float | None
    seconds: float
    violations: list[str]
    first_count: int
    prompts: list[list[int]]  # the pool (a job's ``prompt`` indexes it)
    alone: dict[int, list[int]]  # prompt index -> its tokens served alone (the largest max_tokens asked)

    def counts(self) -> dict[str, int]:
        c: dict[str, int] = {}
        for o in self.outcomes:
            key = (
                "disconnected"
                if o.disconnected
                else f"{o.status} {o.finish_reason}"
                if o.status == 200
                else str(o.status)
            )
            c[key] = c.get(key, 0) + 1
        return dict(sorted(c.items()))

    def summary(self) -> str:
        rss = ""
        if self.rss_after_100 and self.rss_end:
            rss = (
                f"RSS {self.rss_after_100 / 2**20:.0f} MiB after the first {self.first_count} requests, "
                f"{self.rss_end / 2**20:.0f} MiB at the end ({self.rss_end / self.rss_after_100 - 1:+.1%}); "
            )
        return (
            f"{len(self.outcomes)} requests in {self.seconds:.0f} s: {self.counts()}; {rss}"
            f"/metrics at the end: running {self.running_end}, waiting {self.waiting_end}; "
            f"{len(self.violations)} violation(s)"
        )


def make_prompts(n: int, max_len: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def make_jobs(
    n: int, prompts: int, max_new: int, disconnect: float, burst: int, bad: int, rng: random.Random
) -> list[Job]:
    jobs = []
    for i in range(n):
        stream = rng.random() < 0.6
        job = Job(i, rng.randrange(prompts), rng.randint(1, max_new), stream)
        if stream and job.max_tokens > 1 and rng.random() < disconnect:
            job.disconnect_after = rng.randint(1, job.max_tokens - 1)
        jobs.append(job)
    for i in rng.sample(range(n), min(bad, n)):
        jobs[i].bad = True
    at = min(100, n // 2)  # the burst comes after the first 100 (half of a short run)
    burst_jobs = [
        Job(n + k, rng.randrange(prompts), rng.randint(1, max_new), rng.random() < 0.5, burst=True)
        for k in range(burst)
    ]
    return jobs[:at] + burst_jobs + jobs[at:]


async def send(client: httpx.AsyncClient, url: str, job: Job, prompt: list[int]) -> Outcome:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": job.max_tokens,
        "temperature": -1 if job.bad else 0,
        "return_token_ids": True,
        "stream": job.stream,
    }
    if not job.stream:
        resp = await client.post(url + "/v1/completions", json=body)
        out = Outcome(job, resp.status_code, retry_after=resp.headers.get("retry-after"))
        data = resp.json()
        if resp.status_code == 200:
            choice = data["choices"][0]
            out.tokens = list(choice["token_ids"])
            out.finish_reason = choice["finish_reason"]
        else:
            out.error = str(data.get("error", data))[:300]
        return out
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        out = Outcome(job, resp.status_code, retry_after=resp.headers.get("retry-after"))
        if resp.status_code != 200:
            out.error = (await resp.aread()).decode()[:300]
            return out
        chunks = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line[6:].strip() == "[DONE]":
                break
            event = json.loads(line[6:])
            if "error" in event:
                out.error = str(event["error"])[:300]
                break
            for choice in event.get("choices") or []:
                ids = choice.get("token_ids") or []
                out.tokens += ids
                chunks += 1 if ids else 0
                if choice.get("finish_reason"):
                    out.finish_reason = choice["finish_reason"]
            if (
                job.disconnect_after is not None
                and chunks >= job.disconnect_after
                and out.finish_reason is None
            ):
                out.disconnected = True
                break  # leaving the block closes the connection mid-stream
    return out


async def metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get(url + "/metrics")).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                out[sample.name] = sample.value
    return out


async def run_load(
    url: str,
    *,
    requests: int,
    distinct: int,
    max_prompt: int,
    max_new: int,
    vocab: int,
    concurrency: int = 6,
    disconnect: float = 0.1,
    burst: int = 24,
    bad: int = 5,
    seed: int = 0,
    rss: Callable[[], int] | None = None,
    rss_tolerance: float = 0.10,
    time_limit: float = 3600.0,
    log: Callable[[str], None] = lambda s: None,
) -> Report:
    """Drive the server at ``url`` as the module docstring says; every violation is in the report."""
    rng = random.Random(seed)
    prompts = make_prompts(distinct, max_prompt, vocab, rng)
    jobs = make_jobs(requests, distinct, max_new, disconnect, burst, bad, rng)
    violations: list[str] = []
    outcomes: list[Outcome] = []
    rss_after_100: int | None = None
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=burst + concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one(job: Job) -> None:
            async with sem:
                if time.monotonic() - t0 > time_limit:
                    return
                outcomes.append(await send(client, url, job, prompts[job.prompt]))

        burst_at = next((k for k, j in enumerate(jobs) if j.burst), len(jobs))
        first = jobs[:burst_at]
        await asyncio.gather(*(one(j) for j in first))
        if rss is not None:
            await asyncio.sleep(0.5)
            rss_after_100 = rss()
        log(f"first {len(first)} done at {time.monotonic() - t0:.0f} s")
        burst_jobs = [j for j in jobs if j.burst]
        results = await asyncio.gather(*(send(client, url, j, prompts[j.prompt]) for j in burst_jobs))
        outcomes += results
        log(f"burst: {sum(o.status == 429 for o in results)} of {len(results)} got 429")
        rest = [j for j in jobs[burst_at:] if not j.burst]
        done = 0

        async def counted(job: Job) -> None:
            nonlocal done
            await one(job)
            done += 1
            if done % 100 == 0:
                log(f"{done + len(first) + len(burst_jobs)} requests at {time.monotonic() - t0:.0f} s")

        await asyncio.gather(*(counted(j) for j in rest))
        skipped = len(jobs) - len(outcomes)
        if skipped:
            log(f"--time-limit: {skipped} requests not sent")

        # Every distinct prompt once more, alone, with the largest max_tokens asked of it.
        want: dict[int, int] = {}
        for o in outcomes:
            if o.status == 200 or o.disconnected:
                want[o.job.prompt] = max(want.get(o.job.prompt, 0), o.job.max_tokens)
        alone: dict[int, Outcome] = {}
        for k, most in sorted(want.items()):
            served = await send(client, url, Job(-1, k, most, False), prompts[k])
            if served.status != 200:
                violations.append(f"prompt {k} served alone: HTTP {served.status} {served.error}")
            alone[k] = served

        running = waiting = None
        for _ in range(100):  # cancelled rows leave at the engine's next step
            gauges = await metrics(client, url)
            running, waiting = gauges.get("infer_requests_running"), gauges.get("infer_requests_waiting")
            if running == 0 and waiting == 0:
                break
            await asyncio.sleep(0.1)
    rss_end = rss() if rss is not None else None

    for o in outcomes:
        j = o.job
        what = f"request {j.index} (prompt {j.prompt}, {len(prompts[j.prompt])} tokens"
        what += f", max_tokens {j.max_tokens}"
        what += f", {'stream' if j.stream else 'whole'}{', burst' if j.burst else ''})"
        if j.bad:
            if o.status != 400:
                violations.append(f"{what}: a bad request got HTTP {o.status}, not 400")
            continue
        if o.status == 429:
            if o.retry_after is None:
                violations.append(f"{what}: 429 without Retry-After")
            continue
        if o.status != 200:
            violations.append(f"{what}: HTTP {o.status} {o.error}")
            continue
        if o.error is not None:
            violations.append(f"{what}: error event {o.error}")
            continue
        ref = alone.get(j.prompt)
        if ref is None or ref.status != 200:
            continue
        if o.disconnected:
            if o.tokens != ref.tokens[: len(o.tokens)]:
                violations.append(
                    f"{what}: disconnected stream's tokens {o.tokens} not a prefix of {ref.tokens}"
                )
            continue
        expect = ref.tokens[: j.max_tokens]
        if o.tokens != expect:
            violations.append(f"{what}: tokens {o.tokens} != served alone {expect}")
        elif o.finish_reason == "length" and len(o.tokens) != j.max_tokens:
            violations.append(f"{what}: finish_reason length after {len(o.tokens)} tokens")
    if running != 0 or waiting != 0:
        violations.append(f"/metrics at the end: running {running}, waiting {waiting} (0 and 0 expected)")
    if rss_after_100 and rss_end and rss_end > rss_after_100 * (1 + rss_tolerance):
        violations.append(
            f"RSS {rss_end / 2**20:.0f} MiB at the end > {1 + rss_tolerance:.2f} x "
            f"{rss_after_100 / 2**20:.0f} MiB after the first {burst_at} requests"
        )
    if not any(o.status == 200 and not o.disconnected for o in outcomes):
        violations.append("no request completed")
    return Report(
        outcomes,
        rss_after_100,
        rss_end,
        running,
        waiting,
        time.monotonic() - t0,
        violations,
        burst_at,
        prompts,
        {k: o.tokens for k, o in alone.items() if o.status == 200},
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint for infer serve (default: the shipped SmolLM2)")
    p.add_argument("--url", default=None, help="drive this running server instead (no RSS check)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--distinct", type=int, default=64, help="distinct prompts")
    p.add_argument("--max-prompt", type=int, default=200, help="prompt tokens at most")
    p.add_argument("--max-new", type=int, default=32, help="max_tokens at most")
    p.add_argument("--concurrency", type=int, default=6, help="requests in flight outside the burst")
    p.add_argument("--burst", type=int, default=24, help="requests sent at once after the first 100")
    p.add_argument("--disconnect", type=float, default=0.1, help="share of streams that hang up")
    p.add_argument("--bad", type=int, default=5, help="deliberately invalid requests (400 expected)")
    p.add_argument("--vocab", type=int, default=30000, help="prompt token ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-tolerance", type=float, default=0.10)
    p.add_argument("--time-limit", type=float, default=3600.0, help="seconds; later requests are not sent")
    p.add_argument("--threads", type=int, default=2, help="the server's OMP_NUM_THREADS")
    p.add_argument("--json", type=Path, default=ROOT / ".bench" / "serve_load.json")
    args = p.parse_args(argv)

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    proc = None
    rss: Callable[[], int] | None = None
    if args.url is None:
        import psutil  # type: ignore[import-untyped]

        model = args.model
        if model is None:
            from infer.realmodels import smollm2_path

            model = str(smollm2_path())
        port = free_port()
        cmd = [
            sys.executable, "-m", "infer", "serve", model, "--port", str(port), "--deterministic",
            "--max-batch", "4", "--max-waiting", "4", "--quiet",
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.Popen(cmd, env=env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                print(f"infer serve exited with {proc.returncode}: {' '.join(cmd)}", file=sys.stderr)
                return 1
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                print("infer serve did not come up in 300 s", file=sys.stderr)
                return 1
            time.sleep(0.25)
        server = psutil.Process(proc.pid)
        rss = lambda: int(server.memory_info().rss)  # noqa: E731
    else:
        url = args.url.rstrip("/")
    try:
        report = asyncio.run(
            run_load(
                url,
                requests=args.requests,
                distinct=args.distinct,
                max_prompt=args.max_prompt,
                max_new=args.max_new,
                vocab=args.vocab,
                concurrency=args.concurrency,
                disconnect=args.disconnect,
                burst=args.burst,
                bad=args.bad,
                seed=args.seed,
                rss=rss,
                rss_tolerance=args.rss_tolerance,
                time_limit=args.time_limit,
                log=log,
            )
        )
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "counts": report.counts(),
                "rss_after_100": report.rss_after_100,
                "rss_end": report.rss_end,
                "running_end": report.running_end,
                "seconds": report.seconds,
                "violations": report.violations,
            },
            indent=2,
        )
    )
    print(report.summary())
    for v in report.violations[:50]:
        print(f"VIOLATION: {v}", file=sys.stderr)
    if report.violations:
        print(f"FAILED: {len(report.violations)} violation(s) (first 50 above)", file=sys.stderr)
        return 1
    print("OK: every check passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
