"""Prefill and decode of the default path in tokens per CPU-second, one thread: steady under load.

    uv run python benchmarks/cpu_time.py smol 128      # SmolLM2-135M Q4_1, a 128-token prompt
    uv run python benchmarks/cpu_time.py gemma 2048    # Gemma 3 270M Q4_K_M, 2,048 tokens
    uv run python benchmarks/cpu_time.py smol 128 --wall   # wall-clock tok/s, torch's threads

Wall-clock speed on a shared 2-core machine swings with the other jobs; the process's CPU
time at one thread (`torch.set_num_threads(1)`) barely does, so this compares two commits
(copy it into a checkout of each) where `benchmarks/peers.py` cannot. It loads the model with
``infer.load(path)`` (no flags: what a user gets), then times ``llm.generate`` of a fresh
prompt each run (no prefix-cache reuse): 1 new token (prefill) and 33 (prefill + 32 decode
steps), best of 2 after a warm-up. The decode rate is ``32 / (t33 - t1)``. CPU time counts
every thread of the process. ``--wall`` times wall-clock seconds at torch's default thread
count instead (what a user sees; only meaningful on a quiet machine), best of 3.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("model", choices=["smol", "gemma"])
    parser.add_argument("prompt", type=int, help="prompt tokens")
    parser.add_argument("--wall", action="store_true", help="wall-clock seconds, default threads")
    args = parser.parse_args()
    if not args.wall:
        torch.set_num_threads(1)
    clock = time.perf_counter if args.wall else time.process_time

    import infer
    from infer.realmodels import gemma3_270m_path, smollm2_path

    path = smollm2_path() if args.model == "smol" else gemma3_270m_path()
    llm = infer.load(str(path))
    runs = [0]

    def run(steps: int) -> float:
        runs[0] += 1  # a new prompt every run: nothing is reused from an earlier one
        ids = [(i * 7919 + runs[0] * 104729) % 30000 + 100 for i in range(args.prompt)]
        start = clock()
        out = llm.generate(ids, max_new_tokens=steps)
        seconds = clock() - start
        if len(out.token_ids) != steps:
            raise SystemExit(f"generated {len(out.token_ids)} tokens, not {steps} (EOS): try another prompt")
        return seconds

    reps = 3 if args.wall else 2
    best: Callable[[int], float] = lambda steps: min(run(steps) for _ in range(reps))  # noqa: E731
    run(4)  # warm-up
    t1, t33 = best(1), best(33)
    unit = f"tok/s ({torch.get_num_threads()} threads, wall)" if args.wall else "tok/cpu-s"
    prefill, decode = args.prompt / t1, 32 / (t33 - t1)
    print(f"{args.model} prompt {args.prompt}: prefill {prefill:.1f} {unit}, decode {decode:.1f} {unit}")


if __name__ == "__main__":
    main()
