"""Prefill of a real GGUF model through `llm.generate` (the engine's chunks, one token out), infer's
settings against each other and llama.cpp's ``llama-bench`` in the same run.

    uv run python benchmarks/prefill.py                                   # the 1.5B, 128/512/2048
    uv run python benchmarks/prefill.py --models smollm2,gemma3-270m --lengths 128,512
    uv run python benchmarks/prefill.py --settings "default;INFER_MALLOC=keep INFER_DEQUANT=compiled"

Each setting (environment variables, ``default`` for none) runs in its own process (peak RSS is
its own): per length, a warm-up prompt then ``--reps`` fresh random prompts (nothing cached), the
best time kept. First a process runs each length once with ``INFER_AOT=on`` and the builder it
starts is waited for (the dequantized tiles' packages, `infer.aot.tiles`: what the
default has once the machine has idled); the measured ones run ``INFER_AOT=use`` (they build
nothing). Prints tok/s per length, the ratio to llama.cpp (``-p`` lengths, ``-n 0``), peak RSS,
and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

from llama_bin import llama_tool


def worker(name: str, lengths: list[int], reps: int) -> None:
    import torch

    import infer

    llm = infer.load(name)
    g = torch.Generator().manual_seed(0)
    speeds = {}
    for n in lengths:
        best = float("inf")
        for rep in range(reps + 1):
            ids = torch.randint(100, 20000, (n,), generator=g).tolist()
            t0 = time.perf_counter()
            llm.generate(ids, max_new_tokens=1)
            if rep:  # the first of each length warms it (routes, compiled tiles)
                best = min(best, time.perf_counter() - t0)
        speeds[n] = n / best
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(json.dumps({"speeds": speeds, "rss_mib": rss}))


def llama_bench(path: str, lengths: list[int], threads: int) -> dict[int, float]:
    tool = llama_tool("llama-bench")
    if not tool.exists():
        return {}
    cmd = [str(tool), "-m", path, "-t", str(threads), "-p", ",".join(map(str, lengths)), "-n", "0", "-r", "2",
           "-o", "json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        out = subprocess.run([*cmd, "--repack", "0"], capture_output=True, text=True)  # (Xeons' SIGILL)
    try:
        return {int(r["n_prompt"]): float(r["avg_ts"]) for r in json.loads(out.stdout)}
    except (ValueError, KeyError):
        return {}


def build_packages(model: str, args: argparse.Namespace) -> None:
    """One prompt per length with builds on, then wait for the builder (at most 30 minutes)."""
    from infer import aot

    cmd = [sys.executable, __file__, "--worker", model, "--lengths", args.lengths, "--reps", "0",
           "--threads", str(args.threads)]  # fmt: skip
    subprocess.run(cmd, env=dict(os.environ, INFER_AOT="on"), capture_output=True)
    t0 = time.perf_counter()
    while aot.building(aot.cache_dir()) and time.perf_counter() - t0 < 1800:
        time.sleep(2)
    print(f"  packages built (waited {time.perf_counter() - t0:.0f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen-coder-1.5b")
    ap.add_argument("--lengths", default="128,512,2048")
    ap.add_argument("--settings", default="default;INFER_MALLOC=keep", help="';'-separated env settings")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        worker(args.worker, lengths, args.reps)
        return
    import infer.realmodels as realmodels

    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""  # noqa: SIM115
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    isa = ",".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in info)
    cpu = f"{names[0] if names else platform.machine()} ({isa})"
    print(f"machine: {cpu}, {os.cpu_count()} CPUs, {args.threads} threads; load {os.getloadavg()[0]:.1f}")
    for model in args.models.split(","):
        path = str(realmodels.by_name(model))
        peer = llama_bench(path, lengths, args.threads)
        print(f"\n{model}: llama.cpp " + ", ".join(f"{n}: {peer.get(n, float('nan')):.0f}" for n in lengths))
        build_packages(model, args)
        for setting in args.settings.split(";"):
            env = dict(os.environ, INFER_AOT="use")
            for kv in setting.split() if setting.strip() != "default" else []:
                key, _, value = kv.partition("=")
                env[key] = value
            cmd = [sys.executable, __file__, "--worker", model, "--lengths", args.lengths,
                   "--reps", str(args.reps), "--threads", str(args.threads)]  # fmt: skip
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode or not lines:
                print(f"  {setting}: failed\n{out.stderr[-2000:]}")
                continue
            got = json.loads(lines[-1])
            speed = {n: got["speeds"][str(n)] for n in lengths}
            cells = [f"{n}: {speed[n]:.0f} tok/s" + (f" ({speed[n] / peer[n]:.2f}x)" if n in peer else "")
                     for n in lengths]  # fmt: skip
            print(f"  {setting}: " + "; ".join(cells) + f"; peak RSS {got['rss_mib']} MiB")
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
