"""Tensor / pipeline parallelism on one machine: per-rank memory and tokens/s, 1 vs 2 ranks.

    uv run python benchmarks/distributed.py [--device cpu|cuda] [--threads N] [--new 32]

Every configuration runs as separate processes (the environment torchrun sets), on a
generated Llama checkpoint (random weights, float32, `.bench/distributed/`): one process
with all the cores, then 2 ranks with tensor_parallel=2 and with pipeline_parallel=2,
each rank with its share of the cores. Each rank reports its peak anonymous memory
(RssAnon above its own baseline after importing torch) or, on CUDA, max_memory_allocated,
its load time, prefill tokens/s (128 tokens) and decode tokens/s. On CPU the ranks share
the machine's memory bandwidth, so the per-rank memory is the figure that matters; on GPU
(when more than one is available) the speed is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)

CHILD = r"""
import json, os, sys, threading, time
import torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
    return 0

import infer
base = anon()
peak = [base]
stop = False
def sample():
    while not stop:
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
device = args["device"]
if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
t0 = time.perf_counter()
llm = infer.load(
    args["path"], device=device, dtype="float32", tensor_parallel=args["tp"], pipeline_parallel=args["pp"]
)
load_s = time.perf_counter() - t0
if args["micro"] is not None:
    llm.model.executor.micro_batches = args["micro"]
prompts = [[(7 * i + 3 + 11 * b) % 32000 for i in range(args["prompt"])] for b in range(args["batch"])]
llm.generate(prompts, max_new_tokens=2)  # warm-up
g = llm.generate(prompts, max_new_tokens=args["new"])[0]
stop = True
mem = torch.cuda.max_memory_allocated() if device == "cuda" else peak[0] - base
rank = int(os.environ.get("RANK", 0))
print("RESULT " + json.dumps({
    "rank": rank, "load_s": load_s, "peak_bytes": mem,
    "prefill_tok_s": args["batch"] * args["prompt"] / g.prefill_seconds,
    "decode_tok_s": args["batch"] * (len(g.token_ids) - 1) / g.decode_seconds,
    "tokens": g.token_ids,
}))
"""


def checkpoint() -> Path:
    path = ROOT / ".bench" / "distributed" / "llama-260m"
    if not (path / "config.json").exists():
        from infer.testing import build_checkpoint

        build_checkpoint(path, "llama", **SHAPE)  # type: ignore[arg-type]
    return path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run(
    path: Path,
    tp: int,
    pp: int,
    threads: int,
    device: str,
    new: int,
    prompt: int,
    batch: int = 1,
    micro: int | None = None,
) -> list[dict[str, Any]]:
    world = tp * pp
    port = _port()
    job = {
        "path": str(path),
        "tp": tp,
        "pp": pp,
        "threads": threads,
        "device": device,
        "new": new,
        "prompt": prompt,
        "batch": batch,
        "micro": micro,
    }
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT / "src"),
            "OMP_WAIT_POLICY": "PASSIVE",
            "OMP_NUM_THREADS": str(threads),
        }
        if world > 1:
            env |= {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", CHILD, json.dumps(job)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=1800)
        lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(stderr[-3000:])
        out.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores for the 1-rank run")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument(
        "--batch", type=int, default=1, help="prompts per generate call (pipeline micro-batches: > 1)"
    )
    args = parser.parse_args()
    path = checkpoint()
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), cpu)
    print(
        f"checkpoint {path.name}: {json.dumps(SHAPE)}; device {args.device}; CPU {cpu}; "
        f"{args.threads} thread(s) in all; {args.batch} prompt(s) of {args.prompt} tokens, "
        f"{args.new} new tokens; tokens/s count every row of the batch"
    )
    rows = []
    half = max(1, args.threads // 2)
    configs: list[tuple[str, int, int, int, int | None]] = [
        ("1 process", 1, 1, args.threads, None),
        ("tensor_parallel=2", 2, 1, half, None),
        ("pipeline_parallel=2", 1, 2, half, None),
    ]
    if args.batch > 1:  # the default splits the batch into 2 micro-batches; here, without
        configs.append(("pp=2, 1 micro-batch", 1, 2, half, 1))
    single: dict[str, Any] | None = None
    for label, tp, pp, threads, micro in configs:
        results = run(path, tp, pp, threads, args.device, args.new, args.prompt, args.batch, micro)
        if single is None:
            single = results[0]
        same = all(r["tokens"] == single["tokens"] for r in results)
        for r in results:
            rows.append((label, r, same))
    assert single is not None
    header = (
        f"{'configuration':<22} {'rank':>4} {'peak MiB':>9} {'x 1 proc':>8} {'load s':>7} "
        f"{'prefill tok/s':>13} {'decode tok/s':>12} {'x 1 proc':>8} {'tokens = 1 proc':>15}"
    )
    print(header)
    print("-" * len(header))
    for label, r, same in rows:
        memory = r["peak_bytes"] / single["peak_bytes"]
        speed = r["decode_tok_s"] / single["decode_tok_s"]
        print(
            f"{label:<22} {r['rank']:>4} {r['peak_bytes'] / 2**20:>9.1f} {memory:>7.2f}x {r['load_s']:>7.2f} "
            f"{r['prefill_tok_s']:>13.1f} {r['decode_tok_s']:>12.1f} {speed:>7.2f}x {same!s:>15}"
        )


if __name__ == "__main__":
    main()
