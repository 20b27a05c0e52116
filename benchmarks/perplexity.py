"""Perplexity of both real GGUF models: infer's default path vs its float32 path (vs llama.cpp).

    uv run python benchmarks/perplexity.py                     # GPL-3, first 20,000 bytes, N = 256
    uv run python benchmarks/perplexity.py --context 512 --bytes 0 --json out.json

For SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M (`infer.realmodels`), perplexity as
``llama-perplexity -c N -b N`` computes it (`infer.perplexity`) with

* infer default: ``infer.load(path)`` with no flags (float32 activations, the packed matrix
  products in bfloat16);
* infer float32: ``infer.load(path, dtype=torch.float32)`` (every product in float32);
* llama.cpp: ``llama-perplexity -c N -b N`` on the same bytes, when the binary built by
  ``../shared/peers/llamacpp.sh`` is already there (this script never starts a build); if its
  repacked weights crash it is run again with ``--no-repack``, and the table says so.

Prints a Markdown table (perplexity, the default's relative difference to float32, seconds),
the command and the machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS = {"smollm2": "SmolLM2-135M Q4_1", "gemma3": "Gemma 3 270M Q4_K_M"}
PEERS_CACHE = Path(os.environ.get("INFER_PEERS_CACHE", Path.home() / ".cache" / "infer-peers"))


def model_path(model: str) -> Path:
    import infer.realmodels as rm

    return rm.smollm2_path() if model == "smollm2" else rm.gemma3_270m_path()


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def llama_perplexity_bin() -> Path | None:
    """An already-built ``llama-perplexity`` (never builds one)."""
    found = sorted(glob.glob(str(PEERS_CACHE / "llama.cpp-*" / "bin" / "llama-perplexity")))
    return Path(found[0]) if found else None


def run_infer(path: Path, text: str, args: argparse.Namespace, float32: bool) -> dict[str, Any]:
    import torch

    import infer
    from infer.perplexity import perplexity

    t0 = time.perf_counter()
    llm = infer.load(path, dtype=torch.float32 if float32 else None)
    t1 = time.perf_counter()
    result = perplexity(llm, text, args.context, batch=args.batch, max_chunks=args.max_chunks)
    t2 = time.perf_counter()
    return {
        "ppl": result.ppl,
        "ppl_error": result.ppl_error,
        "nll": result.nll,
        "chunks": result.chunks,
        "tokens": result.tokens,
        "text_tokens": result.text_tokens,
        "load_s": t1 - t0,
        "seconds": t2 - t1,
    }


def run_llama_cpp(binary: Path, path: Path, text_file: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``llama-perplexity -c N -b N``; again with ``--no-repack`` if the first run fails."""
    cmd = [str(binary), "-m", str(path), "-f", str(text_file), "-c", str(args.context)]
    cmd += ["-b", str(args.context), "-t", str(args.threads)]
    if args.max_chunks is not None:
        cmd += ["--chunks", str(args.max_chunks)]
    for extra in ([], ["--no-repack"]):
        t0 = time.perf_counter()
        proc = subprocess.run([*cmd, *extra], capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - t0
        log = proc.stdout + proc.stderr
        final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
        if proc.returncode == 0 and final:
            chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
            return {
                "ppl": float(final.group(1)),
                "ppl_error": float(final.group(2)),
                "chunks": int(chunks.group(1)) if chunks else None,
                "seconds": seconds,
                "repack": not extra,
                "command": shlex.join([*cmd, *extra]),
            }
        print(f"llama-perplexity {' '.join(extra) or '(repacked weights)'} failed ({proc.returncode})")
    raise RuntimeError(f"llama-perplexity failed:\n{log[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--file", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    parser.add_argument("--bytes", type=int, default=20_000, help="first bytes of the file (0: all)")
    parser.add_argument("--context", type=int, default=256, help="N: tokens per chunk")
    parser.add_argument("--batch", type=int, default=1, help="chunks per forward pass (infer)")
    parser.add_argument("--max-chunks", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()

    import torch

    from infer.perplexity import read_text

    torch.set_num_threads(args.threads)
    text = read_text(args.file, args.bytes or None)
    binary = None if args.no_llama_cpp else llama_perplexity_bin()
    machine = f"{cpu_name()}, {os.cpu_count()} CPUs, {args.threads} threads, torch {torch.__version__}"
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "text.txt"
        text_file.write_text(text, encoding="utf-8")  # the same bytes llama.cpp reads
        for model in args.models.split(","):
            path = model_path(model)
            row: dict[str, Any] = {}
            for name, float32 in (("default", False), ("float32", True)):
                print(f"{MODELS[model]} / infer {name} ...", flush=True)
                row[name] = run_infer(path, text, args, float32)
                print(f"  {row[name]}", flush=True)
            if binary is not None:
                print(f"{MODELS[model]} / llama.cpp ...", flush=True)
                row["llama.cpp"] = run_llama_cpp(binary, path, text_file, args)
                print(f"  {row['llama.cpp']}", flush=True)
            results[model] = row

    command = "uv run python benchmarks/perplexity.py " + shlex.join(sys.argv[1:])
    size = f"first {args.bytes:,} bytes of" if args.bytes else "all of"
    print(f"\ncommand: {command.strip()}\nmachine: {machine}")
    print(f"text: {size} {args.file}, N = {args.context} (-c {args.context} -b {args.context})\n")
    head = "| model | infer default | infer float32 | default vs float32 |"
    rule = "|---|---|---|---|"
    if binary is not None:
        head += " llama.cpp | float32 vs llama.cpp |"
        rule += "---|---|"
    print(head + " chunks x scored tokens | seconds (default / float32) |")
    print(rule + "---|---|")
    for model, row in results.items():
        d, f = row["default"], row["float32"]
        line = f"| {MODELS[model]} | {d['ppl']:.4f} | {f['ppl']:.4f} | {d['ppl'] / f['ppl'] - 1:+.3%} |"
        if binary is not None:
            c = row["llama.cpp"]
            note = "" if c["repack"] else " (--no-repack)"
            line += f" {c['ppl']:.4f}{note} | {f['ppl'] / c['ppl'] - 1:+.3%} |"
        line += f" {d['chunks']} x {d['tokens'] // d['chunks']} | {d['seconds']:.0f} / {f['seconds']:.0f} |"
        print(line)
    if binary is None and not args.no_llama_cpp:
        print(f"\n(no llama-perplexity under {PEERS_CACHE}/llama.cpp-*/bin: llama.cpp column left out)")
    if args.json is not None:
        record = {"command": command, "machine": machine, "context": args.context, "results": results}
        args.json.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
