"""Prefill and decode of the default path in tokens per CPU-second, one thread: steady under load.

    uv run python benchmarks/cpu_time.py smol 128      # SmolLM2-135M Q4_1, a 128-token prompt
    uv run python benchmarks/cpu_time.py gemma 2048    # Gemma 3 270M Q4_K_M, 2,048 tokens

Wall-clock speed on a shared 2-core machine swings with the other jobs; the process's CPU
time at one thread (`torch.set_num_threads(1)`) barely does, so this compares two commits
(copy it into a checkout of each) where `benchmarks/peers.py` cannot. It loads the model with
``infer.load(path)`` (no flags: what a user gets), then times ``llm.generate`` of a fresh
prompt each run (no prefix-cache reuse): 1 new token (prefill) and 33 (prefill + 32 decode
steps), best of 2 after a warm-up. The decode rate is ``32 / (t33 - t1)``. CPU time counts
every thread of the process, the engine's loop included.
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
    args = parser.parse_args()
    torch.set_num_threads(1)

    import infer
    from infer.realmodels import gemma3_270m_path, smollm2_path

    path = smollm2_path() if args.model == "smol" else gemma3_270m_path()
    llm = infer.load(str(path))
    runs = [0]

    def run(steps: int) -> float:
        runs[0] += 1  # a new prompt every run: nothing is reused from an earlier one
        ids = [(i * 7919 + runs[0] * 104729) % 30000 + 100 for i in range(args.prompt)]
        start = time.process_time()
        out = llm.generate(ids, max_new_tokens=steps)
        seconds = time.process_time() - start
        if len(out.token_ids) != steps:
            raise SystemExit(f"generated {len(out.token_ids)} tokens, not {steps} (EOS): try another prompt")
        return seconds

    best: Callable[[int], float] = lambda steps: min(run(steps) for _ in range(2))  # noqa: E731
    run(4)  # warm-up
    t1, t33 = best(1), best(33)
    print(
        f"{args.model} prompt {args.prompt}: prefill {args.prompt / t1:.1f} tok/cpu-s, "
        f"decode {32 / (t33 - t1):.1f} tok/cpu-s"
    )


if __name__ == "__main__":
    main()
