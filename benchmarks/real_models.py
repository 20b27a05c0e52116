"""GGUF end to end: infer vs transformers on the two shipped real models, one run.

    uv run python benchmarks/real_models.py                    # both models, both libraries
    uv run python benchmarks/real_models.py --threads 1 --decode 32 --json out.json

For SmolLM2-135M-Instruct (Q4_1) and Gemma 3 270M (Q4_K_M), each library runs in its own
fresh subprocess (so peak RSS is honest and nothing is shared) and reports:

* ready: seconds from the start of the process to a model and tokenizer ready to
  generate (imports included), and the load call alone;
* prefill tokens/s on a ``--prompt``-token prompt, decode tokens/s over ``--decode``
  greedy steps with a KV cache (median of ``--reps`` runs after a warm-up);
* peak RSS of the process (``ru_maxrss``), and for infer the bytes its modules hold.

infer runs at its GGUF default (float32 activations, packed matrix products in bfloat16)
and, with ``--infer-dtypes default,float32,bfloat16``, at the others; transformers runs
at float32 (its GGUF path dequantizes everything to float). Machine facts (CPU, threads, load average)
are printed with the table.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
from typing import Any  # noqa: E402

MODELS = {"smollm2": "smollm2_path", "gemma3-270m": "gemma3_270m_path"}


def _model_path(name: str) -> Path:
    import infer.realmodels as rm

    path: Path = getattr(rm, MODELS[name])()
    return path


def _time_steps(forward: Any, prompt: Any, steps: int, reps: int) -> tuple[float, float]:
    """Median prefill and decode seconds of ``forward(ids, state) -> (next_id, state)``."""
    prefill, decode = [], []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        nxt, state = forward(prompt, None)
        t1 = time.perf_counter()
        for _ in range(steps):
            nxt, state = forward(nxt, state)
        t2 = time.perf_counter()
        prefill.append(t1 - t0)
        decode.append(t2 - t1)
    return statistics.median(prefill[1:]), statistics.median(decode[1:])


def run_infer(path: Path, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import infer

    t_load = time.perf_counter()
    llm = infer.load(path, dtype=None if dtype == "default" else dtype)
    ready = time.perf_counter()
    model = llm.model
    ids = torch.tensor([llm.tokenizer.encode(PROMPT_TEXT)[: args.prompt]])

    def forward(x: Any, cache: Any) -> tuple[Any, Any]:
        if cache is None:
            cache = model.make_cache(1, args.prompt + args.decode + 1)
        logits = model(x, cache=cache)
        return logits[:, -1:].argmax(-1), cache

    with torch.inference_mode():
        prefill_s, decode_s = _time_steps(forward, ids, args.decode, args.reps)
    return _result(model, ready, t_load, ids.shape[1], prefill_s, decode_s, args.decode)


def _result(
    model: Any, ready: float, t_load: float, prompt: int, prefill_s: float, decode_s: float, decode: int
) -> dict[str, Any]:
    nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return {
        "ready_s": ready - T_START,
        "load_s": ready - t_load,
        "prefill_tok_s": prompt / prefill_s,
        "decode_tok_s": decode / decode_s,
        "model_bytes": nbytes,
        "prompt_tokens": prompt,
    }


def run_transformers(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_load = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    ready = time.perf_counter()
    ids = torch.tensor([tok.encode(PROMPT_TEXT)[: args.prompt]])

    def forward(x: Any, past: Any) -> tuple[Any, Any]:
        out = model(x, past_key_values=past, use_cache=True)
        return out.logits[:, -1:].argmax(-1), out.past_key_values

    with torch.inference_mode():
        prefill_s, decode_s = _time_steps(forward, ids, args.decode, args.reps)
    return _result(model, ready, t_load, ids.shape[1], prefill_s, decode_s, args.decode)


PROMPT_TEXT = " ".join(
    [
        "The history of the city begins in the Roman era, when a small settlement grew up beside the river",
        "crossing. Over the following centuries it became a center of trade, art and learning, drawing",
        "merchants, scholars and travelers from across the continent. Its cathedral took two hundred years",
        "to build, and its university, founded in the thirteenth century, is still one of the oldest in",
        "Europe. Today the museums, libraries and markets attract millions of visitors every year, and the",
        "old harbour, once the busiest on the coast, has become a quarter of restaurants, galleries and",
        "small workshops where boats are still built by hand in the traditional way.",
    ]
    * 4
)


def child(args: argparse.Namespace) -> None:
    import resource

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    path = _model_path(args.model)
    result = run_transformers(path, args) if args.side == "transformers" else run_infer(path, args.side, args)
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["threads"] = torch.get_num_threads()
    result["file_bytes"] = path.stat().st_size
    print("RESULT " + json.dumps(result))


def _spawn(model: str, side: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--side", side]
    cmd += ["--prompt", str(args.prompt), "--decode", str(args.decode), "--reps", str(args.reps)]
    cmd += ["--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            data: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return data
    raise RuntimeError(f"{model} / {side} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument(
        "--infer-dtypes",
        default="default",
        help="infer dtypes to run, comma-separated: default (float32 activations, bfloat16 packed "
        "products), float32, bfloat16",
    )
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens for prefill")
    parser.add_argument("--decode", type=int, default=32, help="greedy decode steps")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    results: dict[str, dict[str, Any]] = {}
    for model in args.models.split(","):
        for side in [*args.infer_dtypes.split(","), "transformers"]:
            print(f"running {model} / {'infer ' + side if side != 'transformers' else side} ...", flush=True)
            results[f"{model}/{side}"] = _spawn(model, side, args)
    load = os.getloadavg()
    print(
        f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch threads {next(iter(results.values()))['threads']}, load average {load[0]:.1f} {load[1]:.1f}"
    )
    print(f"prompt {args.prompt} tokens, {args.decode} decode steps, median of {args.reps}\n")
    header = f"{'model':<12} {'runtime':<20} {'ready s':>8} {'load s':>7} {'prefill t/s':>12}"
    print(header + f" {'decode t/s':>11} {'peak RSS':>10} {'weights':>10}")
    for model in args.models.split(","):
        ref = results[f"{model}/transformers"]
        for side in [*args.infer_dtypes.split(","), "transformers"]:
            r = results[f"{model}/{side}"]
            name = f"infer {side}" if side != "transformers" else "transformers fp32"
            print(
                f"{model:<12} {name:<20} {r['ready_s']:>8.2f} {r['load_s']:>7.2f} "
                f"{r['prefill_tok_s']:>12.1f} {r['decode_tok_s']:>11.1f} "
                f"{_mib(r['peak_rss']):>10} {_mib(r['model_bytes']):>10}"
            )
        for side in args.infer_dtypes.split(","):
            r = results[f"{model}/{side}"]
            print(
                f"{'':<12} infer {side} / transformers: ready {ref['ready_s'] / r['ready_s']:.1f}x faster, "
                f"prefill {r['prefill_tok_s'] / ref['prefill_tok_s']:.2f}x, "
                f"decode {r['decode_tok_s'] / ref['decode_tok_s']:.2f}x, "
                f"peak RSS {r['peak_rss'] / ref['peak_rss']:.2f}x; "
                f"weights {r['model_bytes'] / r['file_bytes']:.2f}x the file ({_mib(r['file_bytes'])})"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
