"""infer (eager and compiled) against transformers and llama.cpp, one invocation, one machine.

    uv run python benchmarks/peers.py                      # both real GGUF models + the bf16 model
    uv run python benchmarks/peers.py --threads 1 --reps 5 --json out.json --chart docs/peers.png

For SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M (`infer.realmodels`) every runtime
runs in its own fresh process (so peak RSS and ready time are honest) and reports:

* ready: seconds from process start to a model ready to generate (imports included);
* prefill: tokens/s of one forward over a 128-token prompt (no cache before it);
* decode: tokens/s of greedy one-token steps at depth 128 (after the 128-token prompt);
* peak RSS of the process.

Runtimes: infer at its GGUF default (float32 activations, bfloat16 packed products), eager
and compiled (`infer.step.Stepper`; the compiled one runs twice, with an empty inductor
cache and then with the cache the first run left: cold and warm compile seconds;
its speeds are the warm run's); transformers (`from_pretrained(gguf_file=...)`, float32);
llama.cpp's ``llama-bench`` (built by ``../shared/peers/llamacpp.sh``: ``-p 128`` and
``-n 64 -d 128``; its "ready" is the wall time of a 1-token run, model load included).
Also the SmolLM2-shaped Llama with random bfloat16 weights from safetensors
(`infer.testing.SMOLLM2_SHAPE`), infer eager / compiled vs transformers at bfloat16.

Speeds are the median of ``--reps`` repetitions after a warm-up. Prints the table with
ratios to llama.cpp (GGUF models) and to transformers (the bf16 model), and the machine.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / ".bench"
PEERS_SCRIPT = ROOT.parent / "shared" / "peers" / "llamacpp.sh"
PROMPT = 128
DECODE = 64
MODELS = {"smollm2": "SmolLM2-135M Q4_1", "gemma3": "Gemma 3 270M Q4_K_M", "bf16": "SmolLM2-shaped bf16"}


def model_path(model: str) -> Path:
    if model == "bf16":
        from infer.testing import SMOLLM2_SHAPE, build_checkpoint

        path = BENCH_DIR / "smol-shaped-llama-bf16"
        if not (path / "config.json").is_file():
            import torch

            build_checkpoint(path, "llama", dtype=torch.bfloat16, **SMOLLM2_SHAPE)
        return path
    import infer.realmodels as rm

    return rm.smollm2_path() if model == "smollm2" else rm.gemma3_270m_path()


def prompt_ids(vocab: int) -> list[int]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(100, min(vocab, 20000), (PROMPT,), generator=gen).tolist()


def median_times(prefill: Any, decode_step: Any, reps: int) -> tuple[float, float]:
    """Median seconds of ``prefill()`` (returns a state) and of one ``decode_step(state)``."""
    pre, dec = [], []
    for _ in range(reps + 1):  # the first repetition warms up
        t0 = time.perf_counter()
        state = prefill()
        t1 = time.perf_counter()
        for _ in range(DECODE):
            state = decode_step(state)
        t2 = time.perf_counter()
        pre.append(t1 - t0)
        dec.append((t2 - t1) / DECODE)
    return statistics.median(pre[1:]), statistics.median(dec[1:])


def run_infer(path: Path, compiled: bool, reps: int) -> dict[str, Any]:
    import torch

    import infer
    from infer.step import Sampling, Stepper

    t_load = time.perf_counter()
    llm = infer.load(path, dtype="bfloat16" if path.is_dir() else None)
    ready = time.perf_counter()
    model = llm.model
    stepper = Stepper(model, compile=compiled)
    ids = torch.tensor([prompt_ids(model.config.vocab_size)])
    n, last = torch.tensor([PROMPT]), torch.tensor([PROMPT - 1])
    ones, zeros = torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    greedy = Sampling()
    capacity = stepper.capacity(PROMPT + DECODE + 1)

    def prefill() -> Any:
        cache = stepper.cache(1, capacity)
        out = stepper(cache, ids, n, last, greedy, None, None)
        out.tokens.tolist()
        return cache, out

    def decode_step(state: Any) -> Any:
        cache, out = state
        out = stepper(cache, out.tokens[:, None], ones, zeros, greedy, None, None)
        out.tokens.tolist()  # the host reads each token, as generation does
        return cache, out

    t0 = time.perf_counter()
    prefill()  # compiles the prefill graph when compiled
    decode_step(prefill())  # ... and the decode graph
    first_call = time.perf_counter() - t0
    prefill_s, decode_s = median_times(prefill, decode_step, reps)
    return {
        "ready_s": ready - T_START,
        "load_s": ready - t_load,
        "compile_s": stepper.compile_seconds if compiled else 0.0,
        "first_call_s": first_call,
        "prefill_tok_s": PROMPT / prefill_s,
        "decode_tok_s": 1 / decode_s,
    }


def run_transformers(path: Path, reps: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    t_load = time.perf_counter()
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    model.eval()  # type: ignore[no-untyped-call]
    ready = time.perf_counter()
    ids = torch.tensor([prompt_ids(model.config.vocab_size)])

    def prefill() -> Any:
        out = model(ids, use_cache=True)
        return out.logits[:, -1:].argmax(-1), out.past_key_values

    def decode_step(state: Any) -> Any:
        nxt, past = state
        out = model(nxt, past_key_values=past, use_cache=True)
        return out.logits[:, -1:].argmax(-1), out.past_key_values

    with torch.inference_mode():
        prefill_s, decode_s = median_times(prefill, decode_step, reps)
    return {
        "ready_s": ready - T_START,
        "load_s": ready - t_load,
        "prefill_tok_s": PROMPT / prefill_s,
        "decode_tok_s": 1 / decode_s,
    }


def child(args: argparse.Namespace) -> None:
    import resource

    import torch

    torch.set_num_threads(args.threads)
    path = model_path(args.model)
    if args.side == "transformers":
        result = run_transformers(path, args.reps)
    else:
        result = run_infer(path, args.side.startswith("compiled"), args.reps)
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(result))


def spawn(
    model: str, side: str, args: argparse.Namespace, env: dict[str, str] | None = None
) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--side", side]
    cmd += ["--reps", str(args.reps), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            data: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return data
    raise RuntimeError(f"{model} / {side} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def run_compiled(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Cold (empty inductor cache) then warm (the cache the cold run left): speeds of the warm run."""
    cache_dir = Path(tempfile.mkdtemp(prefix="infer-peers-inductor-"))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    try:
        cold = spawn(model, "compiled", args, env)
        warm = spawn(model, "compiled", args, env)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    warm["compile_cold_s"] = cold["compile_s"]
    warm["compile_warm_s"] = warm["compile_s"]
    return warm


def llama_bench(bin_dir: Path, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``llama-bench``: prefill ``-p 128``, decode ``-n 64 -d 128``; peak RSS via a wrapper process."""

    def bench(extra: list[str]) -> tuple[list[dict[str, Any]], int, float]:
        cmd = [str(bin_dir / "llama-bench"), "-m", str(path), "-t", str(args.threads), "-o", "json", *extra]
        wrapper = (
            "import resource, subprocess, sys, time; t = time.perf_counter(); "
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print(p.stdout); print('WALL', time.perf_counter() - t); "
            "print('RSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); "
            "sys.exit(p.returncode)"
        )
        proc = subprocess.run(
            [sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, check=True
        )
        out = proc.stdout
        rss = int(out[out.rindex("RSS ") + 4 :].split()[0])
        wall = float(out[out.rindex("WALL ") + 5 :].split()[0])
        return json.loads(out[: out.rindex("WALL ")]), rss, wall

    reps = str(args.reps)
    pre, rss1, _ = bench(["-p", str(PROMPT), "-n", "0", "-r", reps])
    dec, rss2, _ = bench(["-p", "0", "-n", str(DECODE), "-d", str(PROMPT), "-r", reps])
    _, _, ready = bench(["-p", "0", "-n", "1", "-r", "1"])
    return {
        "ready_s": ready,
        "prefill_tok_s": float(pre[0]["avg_ts"]),
        "decode_tok_s": float(dec[0]["avg_ts"]),
        "peak_rss": max(rss1, rss2),
    }


def machine(threads: int) -> str:
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import torch

    load = os.getloadavg()
    return (
        f"{cpu}, {os.cpu_count()} CPUs, {threads} threads, torch {torch.__version__}, "
        f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}"
    )


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def print_table(results: dict[str, dict[str, dict[str, Any]]]) -> None:
    head = f"{'model':<21} {'runtime':<18} {'ready s':>8} {'prefill tok/s':>14} {'decode tok/s':>13}"
    print(head + f" {'peak RSS':>9} {'compile cold/warm s':>20}")
    for model, sides in results.items():
        ref_name = "transformers" if model == "bf16" else "llama.cpp"
        ref = sides.get(ref_name)
        for side, r in sides.items():
            comp = f"{r['compile_cold_s']:.0f} / {r['compile_warm_s']:.1f}" if "compile_cold_s" in r else ""
            print(
                f"{MODELS[model]:<21} {side:<18} {r['ready_s']:>8.2f} {r['prefill_tok_s']:>14.0f} "
                f"{r['decode_tok_s']:>13.1f} {mib(r['peak_rss']):>9} {comp:>20}"
            )
        if ref is None:
            continue
        for side, r in sides.items():
            if side.startswith("infer"):
                pre = r["prefill_tok_s"] / ref["prefill_tok_s"]
                dec = r["decode_tok_s"] / ref["decode_tok_s"]
                print(f"{'':<21} {side} / {ref_name}: prefill {pre:.2f}x, decode {dec:.2f}x")


def chart(results: dict[str, dict[str, dict[str, Any]]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    sides = ["infer eager", "infer compiled", "transformers", "llama.cpp"]
    colors = {
        "infer eager": "#9ecae1",
        "infer compiled": "#3182bd",
        "transformers": "#fdae6b",
        "llama.cpp": "#74c476",
    }
    models = list(results)
    width = 0.2
    panels = [
        (axes[0], "decode_tok_s", "decode tok/s (depth 128)"),
        (axes[1], "prefill_tok_s", "prefill tok/s"),
    ]
    for ax, key, label in panels:
        for j, side in enumerate(sides):
            xs = [i + (j - 1.5) * width for i, m in enumerate(models) if side in results[m]]
            ys = [results[m][side][key] for m in models if side in results[m]]
            bars = ax.bar(xs, ys, width, label=side, color=colors[side])
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(models)), [MODELS[m] for m in models], fontsize=8)
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"chart: {out}")


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", default="", help="runtimes to leave out, comma-separated")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--chart", type=Path, default=ROOT / "docs" / "peers.png")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    skip = set(filter(None, args.skip.split(",")))
    bin_dir = None
    if "llama.cpp" not in skip:
        built = subprocess.run(["bash", str(PEERS_SCRIPT)], capture_output=True, text=True, check=True)
        bin_dir = Path(built.stdout.strip())
    before = machine(args.threads)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for model in args.models.split(","):
        sides: dict[str, dict[str, Any]] = {}
        names = ["infer eager", "infer compiled", "transformers"]
        if model != "bf16" and bin_dir is not None:
            names.append("llama.cpp")
        for side in names:
            if side in skip:
                continue
            print(f"running {MODELS[model]} / {side} ...", flush=True)
            if side == "infer eager":
                sides[side] = spawn(model, "eager", args)
            elif side == "infer compiled":
                sides[side] = run_compiled(model, args)
            elif side == "transformers":
                sides[side] = spawn(model, "transformers", args)
            elif bin_dir is not None:
                sides[side] = llama_bench(bin_dir, model_path(model), args)
        results[model] = sides
    print(f"\nmachine: {before} (before); load after: {os.getloadavg()[0]:.1f}")
    print(f"prompt {PROMPT} tokens, decode {DECODE} greedy steps at depth {PROMPT}, median of {args.reps}\n")
    print_table(results)
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": before, "results": results}, indent=2))
    if args.chart:
        chart(results, args.chart, f"benchmarks/peers.py on {before}")


if __name__ == "__main__":
    main()
