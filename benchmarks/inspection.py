"""Inspection of a 512-token prompt on SmolLM2: infer against transformers, same weights, same machine.

    uv run python benchmarks/inspection.py         # --tokens 512 --repeats 5 --threads 1

Each side runs in a fresh subprocess on ``--threads`` threads: the model is loaded, one inspection
call warms it up, then ``--repeats`` calls of ``model(ids, output_hidden_states=True,
output_attentions=True)`` are timed (the fastest is reported: the machine may be shared) while a
thread samples the process's anonymous memory (``RssAnon``); freed heap pages are handed back before
each call (``infer.pages.release_freed_memory``), so the extra memory is the peak during a call above
what the process held before it. "asked" is the size of what the call returns (logits, hidden
states, attentions: all float32).

Sides, on the same weights (the shipped SmolLM2 Q4_1 GGUF):

* ``transformers``: ``LlamaForCausalLM`` from a float32 safetensors checkpoint that transformers
  wrote from the GGUF file (``gguf_file=``: dequantized), eager attention (what
  ``output_attentions=True`` needs);
* ``infer float32 ckpt``: ``infer.load`` of that same checkpoint (float32 weights, every product a
  float32 GEMM): the like-for-like comparison;
* ``infer GGUF``: ``infer.load`` of the GGUF file as a notebook does (packed Q4_1 weights, 4.6x less
  memory than float32; a prompt's products dequantize each weight tile by tile on every call).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, threading, time
import torch
from infer.pages import release_freed_memory

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
    return 0

side, path, tokens, repeats, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
torch.set_num_threads(threads)
if side == "transformers":
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    vocab = model.config.vocab_size
    call = lambda ids: model(ids, output_hidden_states=True, output_attentions=True, use_cache=False)
else:
    import infer
    llm = infer.load(path, compile=False)
    vocab = llm.config.vocab_size
    call = lambda ids: llm.model(ids, output_hidden_states=True, output_attentions=True)
ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))

def asked(out):
    ts = [out.logits, *out.hidden_states, *out.attentions]
    return sum(t.numel() * t.element_size() for t in ts)

with torch.inference_mode():
    out = call(ids)
    size = asked(out)
    del out
    times, extra = [], []
    for _ in range(repeats):
        release_freed_memory()
        base = anon()
        peak = [base]
        stop = [False]
        def sample():
            while not stop[0]:
                peak[0] = max(peak[0], anon())
                time.sleep(0.001)
        t = threading.Thread(target=sample, daemon=True)
        t.start()
        t0 = time.perf_counter()
        out = call(ids)
        times.append(time.perf_counter() - t0)
        stop[0] = True
        t.join()
        extra.append(max(peak[0], anon()) - base)
        del out
print(json.dumps({"seconds": min(times), "extra": min(extra), "asked": size}))
"""


def cpu_name() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?"
    )
    return name + (" (AVX-512)" if "avx512f" in info else " (no AVX-512)")


def float32_checkpoint(gguf: Path, out: Path) -> Path:
    """The GGUF's weights dequantized to float32 by transformers, saved as a safetensors checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del (
            config.quantization_config
        )  # a GGUF-loaded model refuses to save; a plain one of its weights does not
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out


def main() -> None:
    from infer.realmodels import smollm2_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    gguf = smollm2_path()
    print(
        f"SmolLM2-135M Q4_1, a {args.tokens}-token prompt, fastest of {args.repeats}, "
        f"{args.threads} thread(s); {cpu_name()}"
    )
    rows = {}
    with tempfile.TemporaryDirectory(prefix="infer-inspect-bench-") as tmp:
        ckpt = str(float32_checkpoint(gguf, Path(tmp) / "smollm2-f32"))
        sides = {"transformers": ckpt, "infer float32 ckpt": ckpt, "infer GGUF": str(gguf)}
        for side, path in sides.items():
            kind = "transformers" if side == "transformers" else "infer"
            cmd = [
                sys.executable,
                "-c",
                CHILD,
                kind,
                path,
                str(args.tokens),
                str(args.repeats),
                str(args.threads),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{side} failed:\n{done.stderr[-3000:]}")
            rows[side] = json.loads(done.stdout.strip().splitlines()[-1])
    base = rows["transformers"]["seconds"]
    print("| side | seconds | vs transformers | extra memory (MiB) | asked (MiB) |")
    print("|---|---|---|---|---|")
    for side, r in rows.items():
        print(
            f"| {side} | {r['seconds']:.3f} | {r['seconds'] / base:.2f}x | {r['extra'] / 2**20:.1f} | "
            f"{r['asked'] / 2**20:.1f} |"
        )


if __name__ == "__main__":
    main()
