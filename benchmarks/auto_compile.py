"""The default ``compile="auto"`` over a long generation: tokens/s as it goes, against ``compile=False``.

    uv run python benchmarks/auto_compile.py smol 1500

Loads the model twice (the default, then ``compile=False``), streams ``N`` greedy tokens after a
128-token prompt with each (EOS ignored), and prints the decode rate per 100 tokens, when the
background compile started and ended, and the total time of each. Wall-clock: run it on a
quiet machine. ``--after S`` sets the eager decode seconds before the compile (default: infer's).
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", choices=["smol", "gemma"])
    parser.add_argument("tokens", type=int)
    parser.add_argument("--after", type=float, default=None, help="eager decode seconds before compiling")
    args = parser.parse_args()

    import infer
    from infer.engine import SamplingParams
    from infer.realmodels import gemma3_270m_path, smollm2_path

    path = smollm2_path() if args.model == "smol" else gemma3_270m_path()
    prompt = [(i * 7919) % 30000 + 100 for i in range(128)]
    totals = {}
    for label, compile_ in (("default (auto)", None), ("compile=False", False)):
        llm = infer.load(str(path), compile=compile_)
        if args.after is not None:
            llm.stepper.auto_after_s = args.after
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        start = time.perf_counter()
        (handle,) = llm.engine._submit([prompt], [params], text=False, wait=True, drive=True)
        stamps: list[float] = []
        started = ended = None
        for delta in handle:
            now = time.perf_counter()
            stamps += [now] * len(delta.token_ids)
            worker = llm.stepper._worker
            if worker is not None and started is None:
                started = len(stamps)
            if started is not None and ended is None and not llm.stepper.compiling:
                ended = len(stamps)
        totals[label] = time.perf_counter() - start
        if handle.finish_detail != "length":
            print(f"{label}: ended early: {handle.finish_detail} {handle.exception!r}")
        rates = [100 / (stamps[i + 100] - stamps[i]) for i in range(1, len(stamps) - 100, 100)]
        print(f"{label}: {len(stamps)} tokens in {totals[label]:.1f} s; tok/s per 100 tokens: "
              + " ".join(f"{r:.0f}" for r in rates))  # fmt: skip
        if started is not None:
            print(f"  background compile: from token {started} to token {ended} "
                  f"({llm.stepper.compile_seconds:.1f} s)")  # fmt: skip
        del llm
    print(f"threads {torch.get_num_threads()}; default / compile=False time: "
          f"{totals['default (auto)'] / totals['compile=False']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
