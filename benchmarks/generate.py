"""Prefill and decode throughput: infer vs transformers, same checkpoint, dtype and threads.

    uv run python benchmarks/generate.py                       # builds the default checkpoints
    uv run python benchmarks/generate.py --path DIR --dtype bfloat16

Without ``--path`` it builds (once, under .bench/) the tiny test checkpoints and a
SmolLM2-135M-shaped Llama with random weights, so the numbers cover both the
overhead-bound and the compute-bound regime. infer generates through its engine (what
`LLM.generate` runs: its prefill is the time from admission to the first token, its decode the
time from there to the last over the tokens after the first); each repetition's prompt starts
with a token of its own, so none reuses an earlier one's KV. Prints tokens/s for both and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / ".bench"


def default_checkpoints() -> list[Path]:
    from infer.testing import SMOLLM2_SHAPE, build_checkpoint

    paths = []
    for arch in ("llama", "qwen3", "gemma3"):
        path = BENCH_DIR / f"tiny-{arch}"
        if not (path / "config.json").is_file():
            build_checkpoint(path, arch)
        paths.append(path)
    smol = BENCH_DIR / "smol-shaped-llama"
    if not (smol / "config.json").is_file():
        build_checkpoint(smol, "llama", **SMOLLM2_SHAPE)
    paths.append(smol)
    return paths


def bench_infer(
    path: Path, dtype: torch.dtype, prompt: list[int], new: int, reps: int
) -> tuple[float, float]:
    import infer
    from infer.engine import SamplingParams, collect

    llm = infer.load(path, dtype=dtype)
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    prefill, decode = [], []
    for rep in range(reps + 1):  # the first run warms up
        ids = [rep % llm.config.vocab_size, *prompt[1:]]  # no prefix in common with the last run
        (handle,) = llm.engine.submit_many([ids], [params], text=False, wait=True, drive=True)
        tokens, _ = collect(handle)
        assert len(tokens) == new
        prefill.append(handle.prefill_seconds)
        decode.append(handle.decode_seconds / (new - 1))
    return statistics.median(prefill[1:]), statistics.median(decode[1:])


def bench_transformers(
    path: Path, dtype: torch.dtype, prompt: list[int], new: int, reps: int
) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()  # type: ignore[no-untyped-call]
    ids = torch.tensor([prompt])
    prefill, decode = [], []
    with torch.inference_mode():
        for _ in range(reps + 1):
            t = time.perf_counter()
            model(ids, use_cache=True)
            p = time.perf_counter() - t
            t = time.perf_counter()
            out = model.generate(
                ids,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                eos_token_id=None,
                pad_token_id=0,
            )
            total = time.perf_counter() - t
            assert out.shape[1] == len(prompt) + new
            prefill.append(p)
            decode.append(max(total - p, 0.0) / (new - 1))
    return statistics.median(prefill[1:]), statistics.median(decode[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--path", type=Path, action="append", help="checkpoint directory (repeatable)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    paths = args.path or default_checkpoints()
    print(
        f"torch {torch.__version__}, {args.threads} threads, dtype {args.dtype}, "
        f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, median of {args.reps}"
    )
    header = f"{'checkpoint':<22} {'':>12} {'prefill tok/s':>14} {'decode tok/s':>13}"
    print(header)
    print("-" * len(header))
    for path in paths:
        gen = torch.Generator().manual_seed(0)
        import infer.models  # noqa: F401  (registers the architectures load_config reads)
        from infer.loader.config import load_config

        vocab = min(load_config(path).vocab_size, 256)
        prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=gen).tolist()
        ip, idec = bench_infer(path, dtype, prompt, args.new_tokens, args.reps)
        tp, tdec = bench_transformers(path, dtype, prompt, args.new_tokens, args.reps)
        n = args.prompt_tokens
        print(f"{path.name:<22} {'infer':>12} {n / ip:>14.0f} {1 / idec:>13.1f}")
        print(f"{'':<22} {'transformers':>12} {n / tp:>14.0f} {1 / tdec:>13.1f}")
        print(f"{'':<22} {'ratio':>12} {tp / ip:>13.2f}x {tdec / idec:>12.2f}x")


if __name__ == "__main__":
    main()
