"""Dequantization of packed tiles: G weights/s of the eager passes against `infer.quant.tiles`'
one-pass kernels, compiled in the process and as packages (`infer.aot.tiles`, the
default: built here first, into a temporary cache), per packed form, on the running CPU.

    uv run python benchmarks/dequant.py                 # 1 and 2 threads, the 1.5B's shapes
    uv run python benchmarks/dequant.py --threads 2 --reps 50

Each form is a synthetic GGUF matrix of the Qwen2.5-Coder-1.5B shape it appears in (Q4_K one
plane, Q6_K paired, Q5_0 / Q8_0 two planes); a tile is what `QuantizedLinear` dequantizes for one
GEMM (its columns as the product picks them), in bfloat16. Prints the rates and the machine; the
compiled and packaged tiles are checked equal to the eager one. Each rate is the best of `ROUNDS`
rounds' medians, the modes interleaved (a shared machine slows some moments, never speeds one).
The same tile again and again finds its bytes in cache; "packaged, cold" sweeps every tile of
copies of the matrix larger than any L3, so each tile's bytes come from memory, as in a prefill.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

from infer.aot import settings
from infer.aot import tiles as tile_packages
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
ROUNDS = 3  # the machine varies between moments: each mode's figure is its fastest round's median
SWEEP_BYTES = 512 << 20  # the cold sweep's copies of a matrix: more packed bytes than any CPU's L3


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
    info = cpuinfo()
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx2") if f" {f}" in info]
    print(f"CPU: {cpu_name(info)} ({', '.join(isa)}); torch {torch.__version__}")
    columns = ["form (out x in)", "threads", "tile", "eager", "compiled", "packaged", "packaged/eager",
               "packaged, cold"]  # fmt: skip
    print(f"| {' | '.join(columns)} |")
    print("|---|---|---|---|---|---|---|---|")
    os.environ["INFER_AOT"] = "use"  # packages used, none queued (this process builds them)
    with tempfile.TemporaryDirectory(prefix="infer-dequant-") as cache:
        settings.CACHE_DIR = Path(cache)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for qtype, n, k in FORMS:
                row(qtype, n, k, threads, args.reps)


def rate(lin: QuantizedLinear, cols: int, mode: str, reps: int) -> tuple[float, torch.Tensor]:
    """Seconds per tile (median) in ``mode`` (``INFER_DEQUANT``), and the tile."""
    os.environ["INFER_DEQUANT"] = mode
    tile = functools.partial(lin._compiled_tile if mode != "eager" else lin._dequant_tile_t, 0, cols,
                             torch.bfloat16)  # fmt: skip
    with torch.inference_mode():
        out = tile()
        assert out is not None, f"no {mode} tile"
        return median_s(tile, reps), out


def row(qtype: T, n: int, k: int, threads: int, reps: int) -> None:
    tiles: dict[str, torch.Tensor] = {}
    lin = QuantizedLinear.from_gguf(random_gguf(qtype, n, k, 0), qtype, (n, k))
    cols = min(n, 1 << max(_MIN_TILE_COLUMNS, _TILE_VALUES // (lin.planes * k)).bit_length() - 1)
    call = lin._tile_call(0, cols, torch.bfloat16)
    assert call is not None
    spec = tile_packages.spec_of(call[0], call[1])
    assert spec is not None
    tile_packages.build(spec, tile_packages.directory() / f"{spec.key}.pt2")
    best: dict[str, float] = {}
    for _ in range(ROUNDS):  # the modes interleaved; each one's least disturbed round
        for mode in ("eager", "compiled", "packaged"):
            t, tiles[mode] = rate(lin, cols, mode, reps)
            best[mode] = min(best.get(mode, t), t)
    te, tc, tp = best["eager"], best["compiled"], best["packaged"]
    eager, compiled, packaged = tiles["eager"], tiles["compiled"], tiles["packaged"]
    assert torch.equal(compiled, eager) and torch.equal(packaged, eager), "a one-pass tile != the eager tile"
    w = cols * k / 1e9
    form = "paired" if lin.paired else f"{lin.planes} plane{'s' * (lin.planes > 1)}"
    print(f"| {qtype.name} {form} ({n} x {k}) | {threads} | {k} x {cols} | {w / te:.2f} | {w / tc:.2f} | "
          f"{w / tp:.2f} | {te / tp:.1f}x | {cold_rate(lin, cols):.2f} |", flush=True)  # fmt: skip


def cold_rate(lin: QuantizedLinear, cols: int) -> float:
    """G weights/s of packaged tiles over every whole tile of copies of ``lin`` holding
    `SWEEP_BYTES` in all, as a prefill meets them: each tile's bytes come from memory, not cache."""
    os.environ["INFER_DEQUANT"] = "packaged"
    size = sum(t.numel() * t.element_size() for t in (lin.packed, lin.scale_zero))
    copies = [copy.deepcopy(lin) for _ in range(max(1, SWEEP_BYTES // size))]
    spans = [(a, a + cols) for a in range(0, lin.packed.shape[0] - cols + 1, cols)]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            for m in copies:
                for a, b in spans:
                    m._compiled_tile(a, b, torch.bfloat16)
            best = min(best, time.perf_counter() - t0)
    return len(copies) * len(spans) * cols * lin.in_features / 1e9 / best


if __name__ == "__main__":
    main()
