"""What the deterministic mode costs: decode speed at batch 1 and 16, default vs deterministic.

    uv run python benchmarks/deterministic.py                  # both real models, 2 threads
    uv run python benchmarks/deterministic.py --models smollm2 --steps 16

For each model and mode: greedy decode of ``--steps`` tokens after a 64-token prompt, at
batch 1 and at batch 16 (16 different prompts submitted together to a fresh engine: they are
prefilled in one forward, then decode in lockstep), median of ``--reps``. Prints tokens per
second per row and in total, the deterministic / default ratio at batch 1, and the time of
a batch-16 step over a batch-1 step: a step that reads each weight once for the whole batch
costs far less than 16 batch-1 steps. Wall time and process CPU time are both printed (CPU
time is steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def step_times(llm: object, batch: int, steps: int, reps: int) -> tuple[float, float]:
    """Median (wall, cpu) seconds per decode step of a batch of ``batch`` rows, through the engine."""
    from infer.api import LLM
    from infer.engine import Engine, SamplingParams

    assert isinstance(llm, LLM)
    text = "The history of the city begins in the Roman era when a small settlement grew"
    words = text.split()
    prompts = [llm.tokenizer.encode(" ".join(words[i % 5 :] * 8))[:64] for i in range(batch)]
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    walls, cpus = [], []
    for _ in range(reps + 1):
        engine = Engine(llm, max_batch=batch)  # a fresh one: nothing of the last run's prompts kept
        try:
            handles = engine.submit_many(prompts, [params] * batch, text=False, wait=True, drive=True)
            next(iter(handles[0]))  # the prefill: every row's first token (one forward)
            w0, c0 = time.perf_counter(), time.process_time()
            for h in handles:
                for _ in h:
                    pass
                assert len(h.token_ids) == steps + 1
            walls.append((time.perf_counter() - w0) / steps)
            cpus.append((time.process_time() - c0) / steps)
        finally:
            engine.close(drain=False)
    return statistics.median(walls[1:]), statistics.median(cpus[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import infer
    import infer.realmodels as rm

    paths = {"smollm2": rm.smollm2_path, "gemma3": rm.gemma3_270m_path}
    print(f"{cpu_name()}, {args.threads} threads, torch {torch.__version__}")
    print("| model | mode | batch 1 tok/s | batch 16 tok/s (total) | batch-16 step / batch-1 step |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        base: dict[str, float] = {}
        for mode in ("default", "deterministic"):
            llm = infer.load(paths[name](), deterministic=mode == "deterministic")
            w1, c1 = step_times(llm, 1, args.steps, args.reps)
            w16, c16 = step_times(llm, 16, args.steps, args.reps)
            base.setdefault("w1", w1)
            base.setdefault("c1", c1)
            print(
                f"| {name} | {mode} | {1 / w1:.1f} (cpu {1 / c1:.1f}) | "
                f"{16 / w16:.1f} (cpu {16 / c16:.1f}) | {w16 / w1:.2f}x (cpu {c16 / c1:.2f}x) |",
                flush=True,
            )
        ratio = f"{base['w1'] / w1:.2f}x (cpu {base['c1'] / c1:.2f}x)"
        print(f"| {name} | deterministic / default speed at batch 1 | {ratio} | | |")


if __name__ == "__main__":
    main()
