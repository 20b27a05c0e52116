"""One stream's inter-token latency: `infer serve` against the library's `llm.generate`, same run.

    uv run python benchmarks/serve_itl.py                      # both real models, 6 requests each
    uv run python benchmarks/serve_itl.py --models smollm2 --requests 10

Issue 26's bar: a token streamed through the server (engine -> event loop -> SSE -> socket)
comes within 10% of a token of ``llm.generate`` in one process. For each model, in this order:

* **library**: a fresh process loads the model (``infer.load(path)``, the default), warms up,
  then for each request times ``generate(prompt, 1)`` and ``generate(other prompt of the same
  length, --max-tokens)``: (the second - the first) / (its tokens - 1) is the decode time per
  token with the engine's own per-step work, without the prefill;
* **server**: ``infer serve MODEL --max-batch 16`` (as benchmarks/serving.py starts it), one
  warm-up request, then ``--requests`` streaming ``/v1/completions`` of ``--max-tokens`` greedy
  tokens with ``ignore_eos``, one at a time; the gaps between consecutive token chunks.

Both use the compiled steps' packages if the cache has them for the current source (the server
logs which ran): build them first (any `infer generate` on the model, then wait for the builder:
docs/engine.md, *Compiled steps*), or both run eagerly, which is still a fair comparison.
``OMP_NUM_THREADS=--threads`` for both. Prints medians, p90 and the ratio, with the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import cpu_name, model_path, stream_completion

PROMPT = "Write a short story about a lighthouse keeper, in the style of a fairy tale."

LIBRARY = r"""
import json, statistics, sys, time
import infer
llm = infer.load(sys.argv[1])
n, requests = int(sys.argv[2]), int(sys.argv[3])
base = llm.tokenizer.encode(sys.argv[4])
llm.generate(base, max_new_tokens=n)
per = []
for i in range(requests):
    t = time.perf_counter()
    llm.generate(base + [100 + i], max_new_tokens=1)
    one = time.perf_counter() - t
    t = time.perf_counter()
    out = llm.generate(base + [200 + i], max_new_tokens=n)
    many = time.perf_counter() - t
    if len(out.token_ids) > 1:
        per.append((many - one) / (len(out.token_ids) - 1))
print("RESULT " + json.dumps({"per_token": per, "packaged": llm.execution.packaged_steps}))
"""


def library(path: Path, args: argparse.Namespace, env: dict[str, str]) -> list[float]:
    argv = [sys.executable, "-c", LIBRARY, str(path), str(args.max_tokens), str(args.requests), PROMPT]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"the library run failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    print(f"  library: {result['packaged']} packaged decode steps")
    per: list[float] = result["per_token"]
    return per


async def _server_gaps(url: str, args: argparse.Namespace) -> list[float]:
    async with httpx.AsyncClient(timeout=120) as client:
        body = {"prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        await stream_completion(client, url, body)  # warm-up
        gaps: list[float] = []
        for i in range(args.requests):
            gaps += (await stream_completion(client, url, {**body, "prompt": f"{PROMPT} ({i})"})).gaps
        return gaps


def server(path: Path, args: argparse.Namespace, env: dict[str, str]) -> list[float]:
    argv = [sys.executable, "-m", "infer", "serve", str(path), "--port", "0", "--max-batch", "16"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stderr is not None
        url = None
        for line in proc.stderr:
            match = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line)
            if match:
                url = match.group(1)
                break
        if url is None:
            raise SystemExit(f"infer serve exited ({proc.wait()}) without announcing its address")
        threading.Thread(target=lambda: proc.stderr and proc.stderr.read(), daemon=True).start()
        return asyncio.run(_server_gaps(url, args))
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,gemma3", help="comma-separated: smollm2, gemma3")
    p.add_argument("--requests", type=int, default=6, help="timed requests per runtime")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per request")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of both")
    args = p.parse_args(argv)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    print(f"CPU: {cpu_name()}, {args.threads} threads")
    print("| model | library ms/token (median, p90) | server ITL ms (median, p90) | server / library |")
    rows = []
    for model in args.models.split(","):
        path = model_path(model)
        print(f"{model}: {path}", file=sys.stderr)
        lib = sorted(library(path, args, env))
        gaps = sorted(server(path, args, env))
        lib_med, srv_med = statistics.median(lib), statistics.median(gaps)
        rows.append(
            f"| {model} | {lib_med * 1e3:.2f}, {lib[int(len(lib) * 0.9)] * 1e3:.2f} "
            f"| {srv_med * 1e3:.2f}, {gaps[int(len(gaps) * 0.9)] * 1e3:.2f} | {srv_med / lib_med:.3f}x |"
        )
        print(rows[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
