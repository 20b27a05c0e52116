"""torch's packed int4 kernel against inductor's C++ GEMM template for the same op, by rows.

    uv run python benchmarks/woq_template.py                  # 1 and 2 threads, the 1.5B's shapes
    uv run python benchmarks/woq_template.py --threads 2 --rows 1,4,16,64

`aten._weight_int4pack_mm_for_cpu` is what `QuantizedLinear` runs for a one-plane int4 product
of few rows. Under `max_autotune` with the weight a graph constant (`freezing`), inductor can
lower it to its C++ GEMM template instead, whose micro-kernel depends on the CPU: on AMX
(`CppMicroGemmWoQInt4Amx`, from 5 rows) it dequantizes a K x 32 block of the weight to bfloat16
once and multiplies it with AMX tiles; on AVX-512 (`CppMicroGemmWoQInt4Avx512`) it follows the
eager kernel; on AVX2 it has none. This is the measurement issue 51's AMX route starts from:
each shape and row count is compiled with only the template allowed (into a temporary inductor
cache, removed at exit), compared with the eager kernel ("bitwise", or the largest error relative
to the largest output) and timed against it. Prints the micro-kernel inductor generated, the CPU
and its ISA.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

SHAPES = [(8960, 1536), (1536, 8960), (1536, 1536)]  # (out, in): the 1.5B's gate, down, q
GROUP = 32  # Q4_K's sub-block: the group size `QuantizedLinear` packs one-plane Q4_K with
ROUNDS = 3  # best of rounds: a shared machine slows some moments, never speeds one


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def isa() -> str:
    cpu = torch.cpu
    if cpu._is_amx_tile_supported():
        return "AMX"
    if cpu._is_avx512_bf16_supported():
        return "AVX-512 bf16"
    return "AVX-512" if cpu._is_avx512_supported() else "AVX2 or less"


class Int4Product(torch.nn.Module):
    """One packed product, its weight and scales held as buffers so freezing makes them constants."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        q = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        scale_zero = torch.rand(in_features // GROUP, out_features, 2) * 0.02
        self.register_buffer("scale_zero", scale_zero.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, GROUP, self.scale_zero)
        return y


def best_median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    fn()
    best = float("inf")
    for _ in range(ROUNDS):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best = min(best, statistics.median(times))
    return best * 1e3


def compile_template(
    module: torch.nn.Module, x: torch.Tensor, cache: Path
) -> tuple[Callable[..., torch.Tensor], str]:
    """The module compiled with the C++ template as the only choice, and which micro-kernel it
    generated, read from the sources this compile added to the cache ("aten": the eager op kept)."""
    import torch._inductor.config as inductor_config

    def sources() -> set[Path]:
        return {p for p in cache.rglob("*") if p.suffix in (".cpp", ".py")}

    before = sources()
    torch._dynamo.reset()
    with inductor_config.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP"):
        compiled = torch.compile(module, dynamic=False)
        with torch.no_grad():
            compiled(x)
    text = "".join(p.read_text(errors="ignore") for p in sources() - before)
    if "_tile_dpbf16ps" in text:
        return compiled, "AMX"
    return compiled, "AVX-512" if "micro_gemm_convert_int4_to_int8" in text else "aten"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64", help="rows of the activations, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="woq-template-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # read when inductor first needs it
    try:
        run(args, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def compare(module: Int4Product, x: torch.Tensor, cache: Path, reps: int) -> str:
    """The columns after the shape: kernel ms, template ms, their ratio, the error, the micro-kernel."""
    try:
        compiled, micro = compile_template(module, x, cache)
    except Exception as e:  # no template for this CPU's ISA: say so and go on
        compiled, micro = None, f"no template ({type(e).__name__})"
    with torch.no_grad():
        kernel_ms = best_median_ms(lambda: module(x), reps)
        if compiled is None:
            return f"{kernel_ms:9.3f} {'-':>11} {'-':>5}  {'-':<8} {micro}"
        y, ref = compiled(x).float(), module(x).float()
        template_ms = best_median_ms(lambda: compiled(x), reps)
    error = "bitwise" if torch.equal(y, ref) else f"{((y - ref).abs().max() / ref.abs().max()).item():.1e}"
    return f"{kernel_ms:9.3f} {template_ms:11.3f} {kernel_ms / template_ms:5.2f}  {error:<8} {micro}"


def run(args: argparse.Namespace, cache: Path) -> None:
    print(f"{cpu_name()}; {isa()}; torch {torch.__version__}")
    print(f"{'threads':>7} {'out x in':>11} {'rows':>4}  kernel ms template ms ratio  error    micro-kernel")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for out_features, in_features in SHAPES:
            torch.manual_seed(0)
            module = Int4Product(out_features, in_features).eval()
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, in_features).to(torch.bfloat16)
                columns = compare(module, x, cache, args.reps)
                print(f"{threads:>7} {out_features:>5}x{in_features:<5} {rows:>4}  {columns}", flush=True)


if __name__ == "__main__":
    main()
