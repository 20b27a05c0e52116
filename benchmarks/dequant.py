"""Dequantization of packed tiles: G weights/s of the eager passes against `infer.quant.tiles`'
compiled one-pass kernels, per packed form, on the running CPU.

    uv run python benchmarks/dequant.py                 # 1 and 2 threads, the 1.5B's shapes
    uv run python benchmarks/dequant.py --threads 2 --reps 50

Each form is a synthetic GGUF matrix of the Qwen2.5-Coder-1.5B shape it appears in (Q4_K one
plane, Q6_K paired, Q5_0 / Q8_0 two planes); a tile is what `QuantizedLinear` dequantizes for one
GEMM (its columns as the product picks them), in bfloat16. Prints the rates, the bytes each tile
moves, and the machine; the compiled tile is checked equal to the eager one.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as T

from infer.quant import QuantizedLinear
from infer.quant.linear import _MIN_TILE_COLUMNS, _TILE_VALUES
from infer.testing import random_gguf

FORMS = [  # (type, out, in): the 1.5B's matrices
    (T.Q4_K, 17920, 1536),  # gate/up (fused): one plane
    (T.Q4_K, 1536, 8960),  # ffn_down: one plane, long K
    (T.Q6_K, 1536, 8960),  # ffn_down: paired
    (T.Q6_K, 256, 1536),  # attn_v: paired
    (T.Q5_0, 2048, 1536),  # two planes side by side (Gemma 3's q/k/v form)
    (T.Q8_0, 2048, 1536),  # two planes
]


def cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_name(info: str) -> str:
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown CPU"


def median_s(fn: Callable[[], object], reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    os.environ["INFER_DEQUANT"] = "compiled"  # the mode measured against the eager default
    info = cpuinfo()
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx2") if f" {f}" in info]
    print(f"CPU: {cpu_name(info)} ({', '.join(isa)}); torch {torch.__version__}")
    print("| form (out x in) | threads | tile | eager G weights/s | compiled G weights/s | compiled/eager |")
    print("|---|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for qtype, n, k in FORMS:
            lin = QuantizedLinear.from_gguf(random_gguf(qtype, n, k, 0), qtype, (n, k))
            cols = min(n, 1 << max(_MIN_TILE_COLUMNS, _TILE_VALUES // (lin.planes * k)).bit_length() - 1)
            eager_tile = functools.partial(lin._dequant_tile_t, 0, cols, torch.bfloat16)
            compiled_tile = functools.partial(lin._compiled_tile, 0, cols, torch.bfloat16)
            with torch.inference_mode():
                fast = compiled_tile()
                os.environ["INFER_DEQUANT"] = "eager"
                try:
                    assert fast is not None and torch.equal(fast, eager_tile()), "compiled != eager"
                    te = median_s(eager_tile, args.reps)
                finally:
                    os.environ["INFER_DEQUANT"] = "compiled"
                tc = median_s(compiled_tile, args.reps)
            w = cols * k / 1e9
            form = "paired" if lin.paired else f"{lin.planes} plane{'s' * (lin.planes > 1)}"
            print(f"| {qtype.name} {form} ({n} x {k}) | {threads} | {k} x {cols} | {w / te:.2f} | "
                  f"{w / tc:.2f} | {te / tc:.1f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
