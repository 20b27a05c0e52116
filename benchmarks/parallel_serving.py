"""`infer serve` under torchrun (2 ranks): one stream against 16 concurrent streams.

    uv run python benchmarks/parallel_serving.py                      # both configurations, both modes
    uv run python benchmarks/parallel_serving.py --configs gemma3-tp2 --modes deterministic

Configurations (issue 35): Gemma 3 270M Q4_K_M with ``--tensor-parallel 2`` (4 heads, 1 KV head)
and SmolLM2-135M Q4_1 with ``--pipeline-parallel 2`` (its 9 heads do not split in two), each
served by ``torchrun --nproc-per-node 2 -m infer serve MODEL ...`` on a free 127.0.0.1 port, one
thread per rank (``OMP_NUM_THREADS=1``), ``--deterministic`` or the default mode. Per server:
a warm-up request, then ``--rounds`` rounds of: one streaming client alone (``--max-tokens``
greedy tokens, ``ignore_eos``), then 16 concurrent streaming clients (different prompts, the
same length); total output tokens/s of each (completion tokens / wall time), best round. In the
deterministic mode every one of the 16 streams' texts is compared with the same request sent
alone on the same server (the contract: bitwise the same). Prints the CPU and a Markdown table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"gemma3-tp2": ("gemma3", "--tensor-parallel"), "smollm2-pp2": ("smollm2", "--pipeline-parallel")}
WORDS = ["Once upon a time", "The capital of France", "def fibonacci(n):", "In the beginning",
         "My favourite food", "The weather today", "Dear diary,", "Here is a list"]  # fmt: skip


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def model_path(name: str) -> Path:
    sys.path.insert(0, str(ROOT / "src"))
    import infer.realmodels as rm

    return rm.smollm2_path() if name == "smollm2" else rm.gemma3_270m_path()


def stream(base: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    text, tokens = "", 0
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text += chunk["choices"][0]["text"]
            usage = chunk.get("usage")
            if usage:
                tokens = usage["completion_tokens"]
    return text, tokens or max_tokens


def run_server(model: Path, flag: str, deterministic: bool, args: argparse.Namespace) -> dict[str, object]:
    log_dir = Path(tempfile.mkdtemp(prefix="infer-parallel-bench-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(free_port()), "--log-dir", str(log_dir), "-m", "infer", "serve", str(model), "--port", "0",
            "--quiet", flag, "2", *(["--deterministic"] if deterministic else [])]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        match = None
        deadline = time.monotonic() + args.start_timeout
        for line in proc.stderr:
            lines.append(line)
            match = re.search(r"serving .* on http://127\.0\.0\.1:(\d+)", line)
            if match or time.monotonic() > deadline:
                break
        if not match:
            raise RuntimeError("the server did not come up:\n" + "".join(lines)[-3000:])
        threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True).start()
        base = f"http://127.0.0.1:{match.group(1)}"
        stream(base, "Hello", 8)  # warm-up
        prompts = [WORDS[i % len(WORDS)] + " " * (i // len(WORDS)) for i in range(16)]
        one_best, many_best, same = 0.0, 0.0, True
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            _, n = stream(base, prompts[0], args.max_tokens)
            one_best = max(one_best, n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                together = list(pool.map(lambda p: stream(base, p, args.max_tokens), prompts))
            many_best = max(many_best, sum(n for _, n in together) / (time.perf_counter() - t0))
            if deterministic:
                alone = [stream(base, p, args.max_tokens)[0] for p in prompts]
                same = same and all(a == t for a, (t, _) in zip(alone, together, strict=True))
        return {"one": one_best, "sixteen": many_best, "same": same if deterministic else None}
    finally:
        for pid, rank in _children(proc.pid):
            if rank == "0":
                os.kill(pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        subprocess.run(["rm", "-rf", str(log_dir)], check=False)


def _children(pid: int) -> list[tuple[int, str | None]]:
    """``(pid, RANK)`` of torchrun's workers."""
    import psutil  # type: ignore[import-untyped]

    out: list[tuple[int, str | None]] = []
    for c in psutil.Process(pid).children():
        with contextlib.suppress(psutil.Error):
            out.append((c.pid, c.environ().get("RANK")))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    p.add_argument("--modes", default="deterministic,default")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--json", type=Path, default=ROOT / ".bench" / "parallel_serving.json")
    args = p.parse_args()
    print(f"{cpu_name()}, {os.cpu_count()} cores; 2 ranks x 1 thread; {args.max_tokens} tokens a request\n")
    print("| configuration | mode | 1 stream, tok/s | 16 streams, tok/s | 16 / 1 | 16 each as alone |")
    print("|---|---|---|---|---|---|")
    results = []
    for config in args.configs.split(","):
        name, flag = CONFIGS[config]
        for mode in args.modes.split(","):
            r = run_server(model_path(name), flag, mode == "deterministic", args)
            same = "-" if r["same"] is None else ("yes" if r["same"] else "**no**")
            one, many = float(r["one"]), float(r["sixteen"])  # type: ignore[arg-type]
            print(f"| {config} | {mode} | {one:.1f} | {many:.1f} | {many / one:.2f}x | {same} |", flush=True)
            results.append({"config": config, "mode": mode, **r})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"cpu": cpu_name(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
