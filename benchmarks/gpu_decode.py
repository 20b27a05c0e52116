"""Decode latency on CUDA: infer vs transformers, same checkpoint and dtype (needs a GPU).

    PYTHONPATH=src python3 benchmarks/gpu_decode.py

Builds a Llama with SmolLM2-135M's shape (random weights), prefills 128 tokens and
times 50 one-token decode steps for float32 and bfloat16, then prints the top host-side
ops of infer's step (decode of a small model on a big GPU is bound by the host). Then the
product end to end: `LLM.generate` (the engine) of 64 tokens after a 128-token prompt,
eager (the default) and ``compile=True``, against transformers' ``generate``, bfloat16.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

import infer
from infer.engine import SamplingParams, collect
from infer.testing import SMOLLM2_SHAPE, build_checkpoint


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_decode.py needs a CUDA device")
    path = build_checkpoint(tempfile.mkdtemp(), "llama", dtype=torch.bfloat16, **SMOLLM2_SHAPE)
    ids = torch.randint(0, 250, (1, 128)).cuda()
    for dtype in (torch.float32, torch.bfloat16):
        model = infer.load(path, device="cuda", dtype=dtype).model
        with torch.inference_mode():
            cache = model.make_cache(1, 256)
            model.forward_hidden(ids, cache)
            x = ids[:, :1]
            for _ in range(5):
                model.head(model.forward_hidden(x, cache))
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(50):
                model.head(model.forward_hidden(x, cache))
            torch.cuda.synchronize()
            ours = (time.perf_counter() - t) / 50
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    model.head(model.forward_hidden(x, cache))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()  # type: ignore[call-arg]
        with torch.inference_mode():
            out = hf(ids, use_cache=True)
            past = out.past_key_values
            for _ in range(5):
                hf(x, past_key_values=past, use_cache=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(50):
                hf(x, past_key_values=past, use_cache=True)
            torch.cuda.synchronize()
            theirs = (time.perf_counter() - t) / 50
        print(
            f"{dtype}: infer {ours * 1e3:.2f} ms/token, transformers {theirs * 1e3:.2f} ms/token, "
            f"ratio {theirs / ours:.2f}x"
        )
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    end_to_end(path, ids)


def end_to_end(path: Path, ids: torch.Tensor, new: int = 64) -> None:
    """Decode tok/s of `LLM.generate`: (tokens after the first) / (time of 1 + ``new`` - time of 1)."""
    prompt = ids[0].tolist()

    def rate(run: Callable[[int], object]) -> float:
        run(new)  # warm-up (and, compiled, the compile)
        best = 0.0
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            run(1)
            t1 = time.perf_counter() - t
            t = time.perf_counter()
            run(1 + new)
            tn = time.perf_counter() - t
            best = max(best, new / (tn - t1))
        return best

    rates = {}
    for name, compile_ in (("infer default (eager)", False), ("infer compile=True", True)):
        llm = infer.load(path, device="cuda", dtype=torch.bfloat16, compile=compile_)

        def run(n: int, llm: infer.LLM = llm) -> object:  # LLM.generate's path, EOS ignored (random weights)
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            (handle,) = llm.engine.submit_many([prompt], [params], text=False, wait=True, drive=True)
            return collect(handle)

        rates[name] = rate(run)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()  # type: ignore[call-arg]
    hf_ids = ids[:, :128]

    def hf_run(n: int) -> object:
        with torch.inference_mode():
            return hf.generate(hf_ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    rates["transformers generate"] = rate(hf_run)
    for name, r in rates.items():
        print(f"bfloat16 generate, 128-token prompt: {name} {r:.1f} tok/s")


if __name__ == "__main__":
    main()
