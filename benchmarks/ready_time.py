"""Ready time of the real GGUF models: a fresh process, ``import torch`` -> `infer.load` returned.

Each run is a new Python process that imports torch, then times (wall and the process's
CPU time) ``import infer`` + ``infer.load(path)``. Three modes per model, ``--runs``
runs each: ``off`` (``cache=False``: convert, write nothing), ``cold`` (the model's
repack cache file deleted first: convert and write it) and ``warm`` (map it). The
cache file's size is printed. Usage::

    uv run python benchmarks/ready_time.py [--runs 3] [--models smollm2 gemma3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, sys, time
import torch
t0, c0 = time.perf_counter(), time.process_time()
import infer
infer.load(sys.argv[1], cache=sys.argv[2] != "off")
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}))
"""


def model_path(name: str) -> Path:
    from infer import realmodels

    return realmodels.smollm2_path() if name == "smollm2" else realmodels.gemma3_270m_path()


def cache_files(path: Path) -> list[Path]:
    from infer.gguf.tokenizer import cache_root

    return sorted((cache_root() / "repack").glob(f"{path.resolve().stem[:80]}-*.safetensors"))


def run(path: Path, mode: str) -> dict[str, float]:
    if mode == "cold":
        for f in cache_files(path):
            f.unlink()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), mode], check=True, capture_output=True, text=True
    ).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"], choices=["smollm2", "gemma3"])
    args = parser.parse_args()
    for name in args.models:
        path = model_path(name)
        for mode in ("off", "cold", "warm"):
            runs = [run(path, mode) for _ in range(args.runs)]
            walls = [r["wall"] for r in runs]
            cpus = [r["cpu"] for r in runs]
            print(
                f"{name} {mode:4s}: wall {', '.join(f'{w:.2f}' for w in walls)} s "
                f"(median {statistics.median(walls):.2f}); "
                f"CPU {', '.join(f'{c:.2f}' for c in cpus)} s (median {statistics.median(cpus):.2f})",
                flush=True,
            )
        sizes = [f.stat().st_size for f in cache_files(path)]
        print(f"{name}: cache file {sum(sizes) / 2**20:.1f} MiB; GGUF {path.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
