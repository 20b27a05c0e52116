"""Decode latency on CUDA: infer vs transformers, same checkpoint and dtype (needs a GPU).

    PYTHONPATH=src python3 benchmarks/gpu_decode.py

Builds a Llama with SmolLM2-135M's shape (random weights), prefills 128 tokens and
times 50 one-token decode steps for float32 and bfloat16, then prints the top host-side
ops of infer's step (decode of a small model on a big GPU is bound by the host).
"""

from __future__ import annotations

import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

import infer
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


if __name__ == "__main__":
    main()
