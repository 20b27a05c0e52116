"""``compile="auto"`` over a long generation: tokens/s as it goes, against ``compile=False``.

    uv run python benchmarks/auto_compile.py smol 1500
    PYTHONPATH=src python3 benchmarks/auto_compile.py shape 1500 --device cuda   # a GPU machine

Loads the model twice (``compile="auto"``, then ``compile=False``), streams ``N`` greedy tokens after a
128-token prompt with each (EOS ignored), and prints the decode rate per 100 tokens, when the
background compile started and ended, and the total time of each. Wall-clock: run it on a
quiet machine. ``--after S`` sets the eager decode seconds before the compile (default: infer's).
``shape``: a Llama with SmolLM2-135M's shape and random bfloat16 weights (no model package needed).
"""

from __future__ import annotations

import argparse
import time
from typing import Literal

import torch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", choices=["smol", "gemma", "shape"])
    parser.add_argument("tokens", type=int)
    parser.add_argument("--after", type=float, default=None, help="eager decode seconds before compiling")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    import infer
    from infer.engine import SamplingParams
    from infer.realmodels import gemma3_270m_path, smollm2_path

    if args.model == "shape":
        import tempfile

        from infer.testing import SMOLLM2_SHAPE, build_checkpoint

        path = build_checkpoint(tempfile.mkdtemp(), "llama", dtype=torch.bfloat16, **SMOLLM2_SHAPE)
    else:
        path = smollm2_path() if args.model == "smol" else gemma3_270m_path()
    prompt = [(i * 7919) % 30000 + 100 for i in range(128)]
    totals = {}
    modes: tuple[tuple[str, bool | Literal["auto"]], ...] = (("auto", "auto"), ("compile=False", False))
    for label, compile_ in modes:
        llm = infer.load(str(path), compile=compile_, device=args.device)
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
    print(f"{args.device}, threads {torch.get_num_threads()}; auto / compile=False time: "
          f"{totals['auto'] / totals['compile=False']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
