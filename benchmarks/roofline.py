"""Where each packed product stands against this CPU's limits: bytes per token and GB/s at one row,
FLOP/s of multi-row products against the measured float32 / bfloat16 GEMM peaks.

    uv run python benchmarks/roofline.py                                  # Qwen2.5-Coder-1.5B (fetched once)
    uv run python benchmarks/roofline.py --model smollm2 --rows 1,4,16,64,128,512 --json out.json

The machine's limits, measured here: memory read bandwidth (a sum over a 1 GiB float32 tensor:
every byte read once, from DRAM), the float32 GEMM peak (a 2048^3 product through MKL's matmul and
through oneDNN's linear, the faster kept) and the bfloat16 one (emulated where the CPU has no
bfloat16 arithmetic: then the dequantized tiles multiply in float32, `native_bf16_gemm`).

The model's products: every packed product one decode step runs (recorded by wrapping
`QuantizedLinear.forward` for one eager step: the fused q/k/v and gate/up, not their parts), grouped
by shape and form. At one row, each group's bytes (packed weights and scales) over its kernel time
is its GB/s, against the memory bandwidth: how far one-row decode is from reading the weights at
the memory's speed. At more rows, each route (the packed kernel; dequantized tiles into the GEMM)
gives FLOP/s = 2 x rows x K x N / time, against the GEMM peak of the tiles' dtype: how far
prefill, verify passes and batched rows are from the compute limit, and which route the measured
table (`infer.quant.routes`) takes there.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import infer
from infer.execution import StepFeed, model_step
from infer.quant import QuantizedLinear, routes
from infer.quant.linear import native_bf16_gemm
from infer.sampling import Sampling


def timed(fn: Callable[[], object], reps: int = 5, budget_s: float = 3.0) -> float:
    """Median seconds of ``fn`` (after a warm-up), fewer repetitions past ``budget_s``."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps and (len(times) < 2 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine_limits() -> dict[str, float]:
    """Memory read GB/s, float32 and bfloat16 GEMM GFLOP/s (2048^3)."""
    big = torch.ones(1 << 28)  # 1 GiB
    read = timed(big.sum)
    del big
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    f32 = timed(lambda: a @ b)
    if routes.onednn_available():
        f32 = min(f32, timed(lambda: routes.gemm(a, b, "onednn")))
    ab, bb = a.bfloat16(), b.bfloat16()
    bf16 = timed(lambda: ab @ bb, reps=2, budget_s=5.0)
    flop = 2 * n**3
    return {
        "read_gb_s": (1 << 30) / read / 1e9,
        "f32_gflop_s": flop / f32 / 1e9,
        "bf16_gflop_s": flop / bf16 / 1e9,
    }


GREEDY: set[int] = set()  # the modules a greedy step calls through `QuantizedLinear.greedy` (a head)


def step_products(llm: infer.LLM) -> list[QuantizedLinear]:
    """The packed products one eager decode step runs, in order (each module once)."""
    seen: dict[int, QuantizedLinear] = {}
    forward, greedy = QuantizedLinear.forward, QuantizedLinear.greedy

    def recording(self: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        seen.setdefault(id(self), self)
        return forward(self, x)

    def recording_greedy(self: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        seen.setdefault(id(self), self)
        GREEDY.add(id(self))
        return greedy(self, x)

    model = llm.model
    cache = model.make_cache(1, 64)
    feed = StepFeed(torch.tensor([[1]]), torch.tensor([1]), torch.tensor([0]), Sampling(), None, None)
    QuantizedLinear.forward = recording  # type: ignore[method-assign]
    QuantizedLinear.greedy = recording_greedy  # type: ignore[method-assign]
    try:
        with torch.inference_mode():
            model_step(model, cache, feed)
    finally:
        QuantizedLinear.forward = forward  # type: ignore[method-assign]
        QuantizedLinear.greedy = greedy  # type: ignore[method-assign]
    return [m for m in seen.values() if m.fmt != "dense"]


def product(m: QuantizedLinear, x: torch.Tensor, how: str | None) -> Callable[[], object]:
    """``m`` on ``x`` as shipped (None), by the packed kernel, or by tiles through the GEMM ``how``."""
    if how is None:
        return (lambda: m.greedy(x)) if id(m) in GREEDY else (lambda: m(x))
    if how == "kernel":
        return lambda: m._product(x, True, 0)
    return lambda: m._product(x, False, 0, how)


def group_key(m: QuantizedLinear) -> str:
    head = ", the head's greedy scan at one row" if id(m) in GREEDY else ""
    return f"{m.in_features}x{m.out_features} {m.source} ({m.route_form().split('-k')[0]}{head})"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="qwen-coder-1.5b", help="a known name (infer.load) or a path")
    parser.add_argument("--rows", default="1,4,16,64,128,512")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    limits = machine_limits()
    llm = infer.load(args.model)
    products = step_products(llm)
    groups: dict[str, list[QuantizedLinear]] = {}
    for m in products:
        groups.setdefault(group_key(m), []).append(m)
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    tile_peak = limits["bf16_gflop_s"] if native_bf16_gemm() else limits["f32_gflop_s"]
    print(f"CPU: {cpu or platform.processor()}, {torch.get_num_threads()} threads; torch {torch.__version__}")
    native, tiles_in = ("native", "bfloat16") if native_bf16_gemm() else ("emulated", "float32")
    print(f"memory read {limits['read_gb_s']:.1f} GB/s; GEMM peak float32 {limits['f32_gflop_s']:.0f} "
          f"GFLOP/s, bfloat16 {limits['bf16_gflop_s']:.1f} GFLOP/s ({native}: tiles multiply in "
          f"{tiles_in})\n")  # fmt: skip
    record: dict[str, Any] = {"cpu": cpu, "threads": torch.get_num_threads(), "limits": limits, "groups": {}}
    print(
        "| product (K x N, type, form) | count | MiB each | 1 row: ms, GB/s (% of read) | "
        + " | ".join(f"{r} rows: kernel / tiles GFLOP/s (route)" for r in rows if r > 1)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * sum(r > 1 for r in rows))
    token_bytes, token_s = 0, 0.0
    with torch.inference_mode():
        for key, mods in groups.items():
            m = mods[0]
            nbytes = m.packed_nbytes()
            x1 = torch.randn(1, m.in_features)
            one = timed(product(m, x1, None))
            token_bytes += nbytes * len(mods)
            token_s += one * len(mods)
            gbs = nbytes / one / 1e9
            cells = [f"{one * 1e3:.2f}, {gbs:.1f} ({gbs / limits['read_gb_s']:.0%})"]
            entry: dict[str, Any] = {"count": len(mods), "bytes": nbytes, "one_row_s": one, "rows": {}}
            route = m.route()
            for r in rows:
                if r == 1:
                    continue
                x = torch.randn(r, m.in_features).to(m.compute_dtype)
                flop = 2 * r * m.in_features * m.out_features
                k = timed(product(m, x, "kernel")) if m.use_kernel else float("nan")
                gemm = route.gemm if route is not None else "matmul"
                t = timed(product(m, x, gemm))
                limit = route.kernel_max_rows if route is not None else m.kernel_max_rows
                taken = "kernel" if r <= max(limit, routes.ROUTE_FLOOR) and m.use_kernel else f"tiles/{gemm}"
                cells.append(f"{flop / k / 1e9:.0f} / {flop / t / 1e9:.0f} ({taken})")
                entry["rows"][r] = {"kernel_s": k, "tiles_s": t, "route": taken}
            record["groups"][key] = entry
            print(f"| {key} | {len(mods)} | {nbytes / 2**20:.1f} | " + " | ".join(cells) + " |", flush=True)
    print(f"\none token reads {token_bytes / 2**20:.0f} MiB of packed weights in {token_s * 1e3:.0f} ms of "
          f"products at one row ({token_bytes / token_s / 1e9:.1f} GB/s, "
          f"{token_bytes / token_s / 1e9 / limits['read_gb_s']:.0%} of the memory's read bandwidth); "
          f"tiles' GEMM peak here {tile_peak:.0f} GFLOP/s")  # fmt: skip
    record.update(token_bytes=token_bytes, token_products_s=token_s)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
