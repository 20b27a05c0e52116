"""Inspection of a 512-token prompt on SmolLM2: infer against transformers, same weights, same machine.

    uv run python benchmarks/inspection.py     # --tokens 512 --rounds 3 --repeats 3 --threads 1

Each side runs in a fresh subprocess on ``--threads`` threads, ``--rounds`` times (the sides
interleaved), and the least of all its rounds is reported: the model is loaded, one inspection
call warms it up, then ``--repeats`` calls of ``model(ids, output_hidden_states=True,
output_attentions=True)`` are timed in the process's CPU seconds (at one thread, steady on a shared
machine where wall-clock time is not: benchmarks/cpu_time.py), and two more run while a thread
samples the process's anonymous memory (``RssAnon``); freed heap pages are handed back before each
(``infer.host.pages.release_freed_memory``), so the extra memory is the peak during a call above what the
process held before it. "asked" is the size of what the call returns (logits, hidden
states, attentions: all float32). The plain forward (logits only) is measured the same way: the
inspection's own cost is the difference.

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
from infer.host.pages import release_freed_memory

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

def measure(fn, repeats):
    # (least CPU seconds of `repeats` calls, least extra RssAnon bytes during a call of 2 more)
    seconds = []
    for _ in range(repeats):
        t0 = time.process_time()
        out = fn()
        seconds.append(time.process_time() - t0)
        del out
    extra = []
    for _ in range(2):  # the memory runs apart: the sampler's reads cost CPU time
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
        out = fn()
        stop[0] = True
        t.join()
        extra.append(max(peak[0], anon()) - base)
        del out
    return min(seconds), min(extra)

with torch.inference_mode():
    out = call(ids)
    size = asked(out)
    del out
    seconds, extra = measure(lambda: call(ids), repeats)
    if side == "transformers":
        plain = lambda: model(ids, use_cache=False).logits
    else:
        plain = lambda: llm.model(ids)
    plain_seconds, plain_extra = measure(plain, repeats)
print(json.dumps({"seconds": seconds, "extra": extra, "asked": size, "plain_seconds": plain_seconds,
                  "plain_extra": plain_extra}))
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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    gguf = smollm2_path()
    print(
        f"SmolLM2-135M Q4_1, a {args.tokens}-token prompt, fastest of {args.rounds} x {args.repeats}, "
        f"{args.threads} thread(s); {cpu_name()}"
    )
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="infer-inspect-bench-") as tmp:
        ckpt = str(float32_checkpoint(gguf, Path(tmp) / "smollm2-f32"))
        sides = {"transformers": ckpt, "infer float32 ckpt": ckpt, "infer GGUF": str(gguf)}
        for _ in range(args.rounds):  # sides interleaved: a busy spell of the machine hits them all
            for side, path in sides.items():
                kind = "transformers" if side == "transformers" else "infer"
                cmd = [
                    sys.executable,
                    "-c",
                    CHILD,
                    kind,
                    path,
                    *map(str, (args.tokens, args.repeats, args.threads)),
                ]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    sys.exit(f"{side} failed:\n{done.stderr[-3000:]}")
                got = json.loads(done.stdout.strip().splitlines()[-1])
                rows[side] = {k: min(v, rows.get(side, got)[k]) for k, v in got.items()}
    base = rows["transformers"]["seconds"]
    print(
        "| side | inspection CPU s | vs transformers | extra memory MiB | asked MiB | plain forward CPU s "
        "| plain forward extra MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for side, r in rows.items():
        print(
            f"| {side} | {r['seconds']:.3f} | {r['seconds'] / base:.2f}x | {r['extra'] / 2**20:.1f} | "
            f"{r['asked'] / 2**20:.1f} | {r['plain_seconds']:.3f} | {r['plain_extra'] / 2**20:.1f} |"
        )


if __name__ == "__main__":
    main()
