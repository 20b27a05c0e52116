"""Time the matmul paths of `QuantizedLinear` per GGUF type and phase.

For each type, weight shape and number of input rows (T=1: a decode step; T=128: a
prefill chunk) it times:

- ``chosen``: ``QuantizedLinear.forward`` as shipped on a step of that shape (T=1: a decode
  step, the packed kernel; T>1: a prefill chunk of one sequence, tile-wise dequantize + bf16
  matmul over whole 16-row groups; the path is keyed on the step's shape, never the row count);
- ``kernel``: the packed kernel forced (``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm``,
  bfloat16 activations);
- ``tiles``: tile-wise dequantize + bf16 matmul forced;
- ``deq+mm``: the naive path: `infer.quant.dequantize` the whole GGUF tensor to float32
  on every call, then ``F.linear``;
- ``f32``/``bf16``: ``F.linear`` with a dense float32 / bfloat16 weight (no quantization).

GB/s is the bytes of the weight as that path stores it, read once per call, divided by
the time. Run::

    uv run --frozen python benchmarks/quant_kernels.py            # all types, default shapes
    uv run --frozen python benchmarks/quant_kernels.py --threads 1 --types Q4_1,Q8_0 --rows 1,16,64,128

Timings are medians of interleaved repeats; on a shared machine, pin ``--threads``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from infer.quant import QuantizedLinear, dequantize

T = GGMLQuantizationType
FP16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.MXFP4: [],
}  # fmt: skip
DEFAULT_TYPES = "Q4_0,Q4_1,Q4_K,Q5_0,Q8_0,Q6_K,int8"
# in_features x out_features: SmolLM2's gate/up and down projections, a 1B model's gate/up.
# K-quants (256-value blocks) skip shapes whose in_features is not a multiple of 256.
DEFAULT_SHAPES = "576x1536,1536x576,2048x8192"


def random_gguf(qtype: T, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random GGUF bytes ``[rows, row_bytes]`` with small finite fp16 scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        raw[:, off : off + 2] = (rng.random(n) * 0.01).astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype == T.MXFP4:
        raw[:, 0] = 120
    return torch.from_numpy(raw.reshape(rows, -1))


def time_calls(fns: dict[str, Callable[[], object]], budget_s: float) -> dict[str, float]:
    """Median seconds per call of each function, repeats interleaved so load hits all alike."""
    for fn in fns.values():
        fn()
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    one_round = time.perf_counter() - t0
    repeats = max(3, min(200, int(budget_s / max(one_round, 1e-6))))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in samples.items()}


def bench_case(
    type_name: str, in_f: int, out_f: int, rows: int, budget_s: float, naive: bool, cdt: torch.dtype
) -> list[tuple[str, float, int]]:
    """``(path, seconds, bytes)`` for one type / shape / row count."""
    gen = torch.Generator().manual_seed(0)
    w32 = torch.randn(out_f, in_f, generator=gen) * 0.02
    raw: torch.Tensor | None = None
    if type_name == "int8":
        lin = QuantizedLinear.from_int8(w32, compute_dtype=cdt)
    else:
        qtype = GGMLQuantizationType[type_name]
        raw = random_gguf(qtype, out_f, in_f)
        lin = QuantizedLinear.from_gguf(raw, qtype, (out_f, in_f), compute_dtype=cdt)
        w32 = dequantize(raw, qtype, (out_f, in_f))
    wbf = w32.to(torch.bfloat16)
    x = torch.randn(rows, in_f, generator=gen)
    xbf = x.to(torch.bfloat16)

    shipped = lin.use_kernel

    def forced(kernel: bool, shape: str) -> Callable[[], object]:
        xs = x[:, None] if shape == "decode" else x[None]  # [T, 1, K] rows one by one, or [1, T, K]

        def run() -> object:
            lin.use_kernel = kernel
            return lin(xs)

        return run

    fns: dict[str, Callable[[], object]] = {
        "chosen": forced(shipped, "decode" if rows == 1 else "prefill"),
        "f32": lambda: F.linear(x, w32),
        "bf16": lambda: F.linear(xbf, wbf),
    }
    if lin.fmt != "dense":
        fns["kernel"] = forced(True, "decode")  # decode rows: the kernel takes any row count
        fns["tiles"] = forced(False, "prefill")
    if naive and raw is not None:
        qt = GGMLQuantizationType[type_name]
        fns["deq+mm"] = lambda: F.linear(x, dequantize(raw, qt, (out_f, in_f)))
    times = time_calls(fns, budget_s)
    packed = lin.packed_nbytes()
    nbytes = {
        "f32": 4 * out_f * in_f,
        "bf16": 2 * out_f * in_f,
        "deq+mm": raw.numel() if raw is not None else 0,
    }
    return [(k, times[k], nbytes.get(k, packed)) for k in fns]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--types", default=DEFAULT_TYPES, help=f"comma-separated GGUF types or 'int8' ({DEFAULT_TYPES})"
    )
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated in x out shapes")
    ap.add_argument("--rows", default="1,128", help="comma-separated input row counts (T)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timing per case")
    ap.add_argument("--no-naive", action="store_true", help="skip the whole-tensor dequantize per call path")
    ap.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cdt = getattr(torch, args.compute_dtype)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), compute dtype {args.compute_dtype}"
    )
    header = (
        f"{'type':6s} {'shape':>11s} {'T':>4s}  {'path':7s} {'ms':>9s} {'GB/s':>7s} {'vs f32':>7s} "
        f"{'vs chosen':>9s}"
    )
    print(header)
    print("-" * len(header))
    for type_name in args.types.split(","):
        for shape in args.shapes.split(","):
            in_f, out_f = (int(s) for s in shape.split("x"))
            if type_name != "int8" and in_f % GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]:
                print(f"{type_name:6s} {shape:>11s}  skipped: {in_f} is not a multiple of the block size\n")
                continue
            for rows in (int(r) for r in args.rows.split(",")):
                results = bench_case(type_name, in_f, out_f, rows, args.budget, not args.no_naive, cdt)
                by = {k: t for k, t, _ in results}
                for path, secs, nbytes in results:
                    print(
                        f"{type_name:6s} {shape:>11s} {rows:4d}  {path:7s} {secs * 1e3:9.3f} "
                        f"{nbytes / secs / 1e9:7.2f} {by['f32'] / secs:6.2f}x {by['chosen'] / secs:8.2f}x"
                    )
                print()


if __name__ == "__main__":
    main()
