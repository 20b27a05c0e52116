"""lm-eval loglikelihood requests per second: ``model="infer"`` against ``model="hf"``, same model, same run.

    uv run python benchmarks/evaluation.py                     # SmolLM2, a synthetic 100-document task
    uv run python benchmarks/evaluation.py --models smollm2 gemma3 --docs 200 --json out.json
    uv run python benchmarks/evaluation.py --task tiny_choices --num-fewshot 2   # the tests' task
    uv run python benchmarks/evaluation.py --task arc_easy --include-path none --limit 100

For each real model (`infer.realmodels`: the shipped SmolLM2-135M Q4_1 and Gemma 3 270M Q4_K_M; the
Qwen2.5-Coder 1.5B with ``--models qwen-coder-1.5b``, fetched once), one multiple-choice task (by
default a synthetic one written to a temporary directory, ``--docs`` documents of 4 choices: no
network; ``--task`` names another, in tests/data/eval_tasks or ``--include-path``) runs through

* hf: lm-eval's transformers backend, the GGUF file through transformers' GGUF loader (weights
  dequantized to float32), ``batch_size`` requests per forward;
* infer float32: ``InferLM(infer.load(path, dtype=torch.float32))`` (every product in float32);
* infer default: ``InferLM(infer.load(path))`` (float32 activations, packed products in bfloat16);
* infer float32, safetensors: the weights transformers dequantized, saved
  as safetensors and loaded by infer (dense float32 matrices: no packed weights to expand in each forward).

Each model object is built and run once on a batch of 64-token rows before the clock starts (for
infer's packed products that includes measuring their routes once per CPU); the clock covers
``simple_evaluate`` (task building, tokenization, scoring). Prints a Markdown table (requests/s,
speed-up over hf, the largest per-sample loglikelihood difference to hf, the share of the time
spent in the model's forward), the command and the machine (CPU, threads, load average: another
process on the CPU shows there).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TASKS_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "eval_tasks"
WORDS = tuple(
    [
        "red",
        "green",
        "blue",
        "river",
        "stone",
        "cloud",
        "music",
        "winter",
        "garden",
        "window",
        "bread",
        "horse",
        "candle",
        "paper",
        "mountain",
        "silver",
        "engine",
        "forest",
        "letter",
        "market",
        "island",
        "doctor",
        "ocean",
        "planet",
    ]
)


def synthetic_task(directory: Path, docs: int) -> str:
    """Write a multiple-choice task of ``docs`` documents (4 choices each, shipped nowhere: made
    from `WORDS` with a fixed seed) and its YAML into ``directory``; its name."""
    import random

    rng = random.Random(0)
    lines = []
    for _ in range(docs):
        a, b, c = rng.sample(WORDS, 3)
        question = (
            f"In the story about the {a} and the {b}, what did the {c} see near the {rng.choice(WORDS)}?"
        )
        choices = [" ".join(rng.sample(WORDS, rng.randint(1, 4))) for _ in range(4)]
        lines.append(json.dumps({"question": question, "choices": choices, "gold": rng.randrange(4)}))
    (directory / "bench.jsonl").write_text("\n".join(lines) + "\n")
    (directory / "bench_tasks.py").write_text(
        "import datasets, json, pathlib\n"
        "def load(**kwargs):\n"
        "    text = (pathlib.Path(__file__).parent / 'bench.jsonl').read_text()\n"
        "    rows = [json.loads(line) for line in text.splitlines()]\n"
        "    return datasets.DatasetDict({'test': datasets.Dataset.from_list(rows)})\n"
    )
    yaml = (TASKS_DIR / "tiny_choices.yaml").read_text()
    yaml = yaml.replace("task: tiny_choices", "task: bench_choices").replace(
        "tasks.choices", "bench_tasks.load"
    )
    yaml = "\n".join(
        line for line in yaml.splitlines() if "training_split" not in line and "fewshot" not in line
    )
    (directory / "bench_choices.yaml").write_text(yaml + "\n")
    return "bench_choices"


MODELS = {
    "smollm2": "SmolLM2-135M Q4_1",
    "gemma3": "Gemma 3 270M Q4_K_M",
    "qwen-coder-1.5b": "Qwen2.5-Coder-1.5B Q4_K_M",
}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Timer:
    """Seconds spent inside a wrapped function."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def run(lm: Any, args: argparse.Namespace) -> tuple[float, dict[str, Any]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    include = None if args.include_path == "none" else args.include_path
    start = time.perf_counter()
    result = lm_eval.simple_evaluate(
        model=lm, tasks=[args.task], num_fewshot=args.num_fewshot, limit=args.limit, log_samples=True,
        task_manager=TaskManager(include_path=include), batch_size=args.batch_size,
    )  # fmt: skip
    return time.perf_counter() - start, result


def scores(result: dict[str, Any], task: str) -> list[float]:
    out = []
    for s in sorted(result["samples"][task], key=lambda s: s["doc_id"]):
        out += [float(r[0][0]) for r in s["resps"]]
    return out


def bench_model(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import lm_eval.models.huggingface as hf_backend

    import infer
    import infer.evaluation as ev
    from infer.realmodels import by_name

    path = by_name(name)
    rows = []
    hf_timer = Timer()
    hf_lm = hf_backend.HFLM(
        pretrained=str(path.parent), gguf_file=path.name, dtype="float32", device="cpu",
        batch_size=args.batch_size, max_length=args.max_length,
    )  # fmt: skip
    hf_lm._model_call(torch.ones(args.batch_size, 64, dtype=torch.long))  # warm-up, before the clock
    hf_lm._model_call = hf_timer.wrap(hf_lm._model_call)
    seconds, result = run(hf_lm, args)
    reference = scores(result, args.task)
    n = len(reference)
    rows.append({"model": MODELS[name], "backend": "hf (float32)", "requests": n, "seconds": seconds,
                 "model_share": hf_timer.seconds / seconds, "max_err": 0.0,
                 "acc": result["results"][args.task].get("acc,none")})  # fmt: skip
    dense = Path(tempfile.mkdtemp(prefix="eval-bench-"))  # transformers' dequantized weights, saved
    atexit.register(shutil.rmtree, dense, True)  # removed however the run ends
    from safetensors.torch import save_file  # transformers refuses to save a model read from GGUF

    weights = {k: v.contiguous() for k, v in hf_lm.model.state_dict().items()}
    if hf_lm.model.config.tie_word_embeddings:
        weights.pop("lm_head.weight")
    save_file(weights, str(dense / "model.safetensors"))
    config = hf_lm.model.config.to_dict()
    config.pop("quantization_config", None)
    (dense / "config.json").write_text(json.dumps(config))
    hf_lm.tokenizer.save_pretrained(str(dense))
    del hf_lm
    runs = (("infer float32", path, torch.float32), ("infer default", path, None),
            ("infer float32, safetensors", dense, torch.float32))  # fmt: skip
    for label, source, dtype in runs:
        llm = infer.load(source, dtype=dtype, compile=False)
        timer = Timer()
        lm: Any = ev.InferLM(llm, batch_size=args.batch_size, max_length=args.max_length)
        lm.score([(list(range(1, 65)), 32)] * args.batch_size)  # warm-up (routes measured once)
        lm.score = timer.wrap(lm.score)
        seconds, result = run(lm, args)
        ours = scores(result, args.task)
        del llm, lm
        rows.append({"model": MODELS[name], "backend": label, "requests": n, "seconds": seconds,
                     "model_share": timer.seconds / seconds,
                     "max_err": max(abs(a - b) for a, b in zip(ours, reference, strict=True)),
                     "acc": result["results"][args.task].get("acc,none")})  # fmt: skip
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=["smollm2"])
    p.add_argument(
        "--task", default=None, help="default: a synthetic multiple-choice task of --docs documents"
    )
    p.add_argument("--docs", type=int, default=100, help="documents of the synthetic task")
    p.add_argument(
        "--include-path", default=str(TASKS_DIR), help="task YAML directory ('none': lm-eval's own)"
    )
    p.add_argument("--num-fewshot", type=int, default=0)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the rows as JSON")
    args = p.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="eval-bench-task-"))
    atexit.register(shutil.rmtree, scratch, True)
    if args.task is None:
        args.task, args.include_path = synthetic_task(scratch, args.docs), str(scratch)
    rows = []
    for name in args.models:
        rows += bench_model(name, args)
    print("| model | backend | requests | seconds | requests/s | vs hf | max diff | forward share | acc |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    base: dict[str, float] = {}
    for r in rows:
        rate = r["requests"] / r["seconds"]
        base.setdefault(r["model"], rate)
        print(f"| {r['model']} | {r['backend']} | {r['requests']} | {r['seconds']:.2f} | {rate:.1f} | "
              f"{rate / base[r['model']]:.2f}x | {r['max_err']:.1e} | {100 * r['model_share']:.0f}% | "
              f"{r['acc']} |")  # fmt: skip
    print(f"\ncommand: uv run python benchmarks/evaluation.py {shlex.join(sys.argv[1:])}")
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f} before the end, torch {torch.__version__}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
