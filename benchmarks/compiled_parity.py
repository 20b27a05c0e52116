"""Compiled step vs eager step on the real GGUF models: greedy tokens and logits.

    uv run python benchmarks/compiled_parity.py                    # both models, float32 and default
    uv run python benchmarks/compiled_parity.py --models smollm2 --dtypes float32 --steps 24
    uv run python benchmarks/compiled_parity.py --against package   # the default's packages (infer.aot)

The prompts are submitted together to the engine (a fresh one per run: `infer.testing.trace`,
which keeps the logits each token was drawn from). `infer.execution.model_step` run eagerly
is the reference; the same code compiled with
``torch.compile(fullgraph=True)`` must give identical greedy tokens and logits within
``1e-5 * max |logit|`` (docs/numerics.md; the tests check this on tiny models; compiling
the real ones takes minutes, so it is measured here). ``--against package``: the
ahead-of-time compiled packages the CPU default runs (`infer.aot`), built here, in this
process, into a temporary directory, for the decode shapes a first run noted. Prints, per model and dtype:
tokens equal or the first differing step, and the largest logit difference, absolute and
relative to the largest logit.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PROMPTS = [
    "The history of the city begins in the Roman era, when a small settlement grew up beside the river",
    "def fibonacci(n):",
    "Question: what is the capital of France?\nAnswer:",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--dtypes", default="float32,default")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--against", choices=["compile", "package"], default="compile")
    parser.add_argument(
        "--exact-head", action="store_true",
        help="every logit exact (as for logprobs); by default a greedy head makes only each row's "
        "top candidates exact and the rest approximate, in both paths",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import infer
    import infer.realmodels as rm
    from infer.engine import SamplingParams
    from infer.execution import Execution
    from infer.testing.trace import trace

    # logprobs: the engine computes every logit exactly for the rows that ask for them
    params = SamplingParams(max_tokens=args.steps, ignore_eos=True, logprobs=0 if args.exact_head else None)

    paths = {"smollm2": rm.smollm2_path, "gemma3": rm.gemma3_270m_path}
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            llm = infer.load(paths[name](), dtype=None if dtype == "default" else dtype)
            prompts = [llm.tokenizer.encode(p) for p in PROMPTS]

            def run(
                execution: Execution, llm: infer.LLM = llm, prompts: list[list[int]] = prompts
            ) -> tuple[torch.Tensor, ...]:
                traced = trace(llm, prompts, params, execution=execution)
                return torch.tensor([t.tokens for t in traced]), torch.stack([t.logits for t in traced])

            t0 = time.perf_counter()
            eager_tokens, eager_logits = run(Execution(llm.model))
            t1 = time.perf_counter()
            if args.against == "package":
                compiled = packaged_execution(llm, dtype, run)
                t1 = time.perf_counter()
            else:
                compiled = Execution(llm.model, compile=True)
            tokens, logits = run(compiled)
            t2 = time.perf_counter()
            same = torch.equal(tokens, eager_tokens)
            first = None if same else int((tokens != eager_tokens).any(0).nonzero()[0])
            upto = tokens.shape[1] if first is None else first + 1  # steps fed the same tokens
            margin = ""
            if first is not None:  # how close eager's top two were where the paths parted
                row = int((tokens[:, first] != eager_tokens[:, first]).nonzero()[0])
                top2 = eager_logits[row, first].float().topk(2).values
                gap = (top2[0] - top2[1]).item()
                share = gap / top2[0].abs().item()
                margin = f"; there eager's top two logits were {gap:.2e} apart ({share:.1e})"
            err = (logits[:, :upto] - eager_logits[:, :upto]).abs().max().item()
            rel = err / eager_logits[:, :upto].abs().max().item()
            took = f"eager {t1 - t0:.0f} s, compiled {t2 - t1:.0f} s incl. {compiled.compile_seconds:.0f}"
            if args.against == "package":
                took = f"{compiled.packaged_steps} steps from packages"
            print(
                f"{name} {dtype}: {len(prompts)} prompts x {args.steps} greedy steps: tokens "
                f"{'identical' if same else f'differ from step {first}'}, max |logit diff| "
                f"{'' if same else 'up to that step '}{err:.2e}{margin} "
                f"({rel:.1e} of max |logit|, bound 1e-5) "
                f"({took})",
                flush=True,
            )


def packaged_execution(llm: Any, dtype: str, run: Callable[[Any], Any]) -> Any:
    """A default (``compile="auto"``) execution whose packages exist: a first run notes the decode
    shapes it misses, they are built here (`infer.aot.build`), and the execution is returned."""
    import infer.aot as aot
    from infer.execution import Execution
    from infer.sampling import Sampling

    aot.settings.CACHE_DIR = Path(tempfile.mkdtemp(prefix="infer-parity-aot-"))
    if aot.settings.setting() != "on":  # INFER_AOT as unset: note what is missing; built below, not queued
        os.environ.pop("INFER_AOT", None)
    recipe = aot.Recipe(str(llm.source), None if dtype == "default" else dtype)
    cache = aot.PackageCache(llm.model, recipe, queue_missing=False)
    execution = Execution(llm.model, compile="auto", packages=cache)
    run(execution)
    for request in cache.missing.values():
        t0 = time.perf_counter()
        aot.build(llm.model, request["batch"], Sampling(**request["mode"]), Path(request["out"]))
        print(f"  built {Path(request['out']).name} in {time.perf_counter() - t0:.0f} s", flush=True)
    cache.missing.clear()
    cache._looked.clear()
    execution.packaged_steps = 0
    return execution


if __name__ == "__main__":
    main()
