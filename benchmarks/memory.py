"""Peak memory of each load path, measured in a fresh subprocess per path.

    uv run python benchmarks/memory.py

For each path: peak RSS (VmHWM) and peak anonymous memory above the process's
baseline after importing torch and infer, next to the size of the weights on disk.
Uses the SmolLM2-shaped checkpoint that benchmarks/generate.py builds (random weights,
bfloat16 on disk) and the shipped SmolLM2 GGUF.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, threading, time
import torch, infer, transformers  # transformers: the tokenizer classes, counted in the baseline

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0

base_rss, base_anon = status("VmRSS"), status("RssAnon")
peak_anon = [base_anon]
stop = False
def sample():
    while not stop:
        peak_anon[0] = max(peak_anon[0], status("RssAnon"))
        time.sleep(0.002)
t = threading.Thread(target=sample, daemon=True); t.start()
path, kwargs = sys.argv[1], json.loads(sys.argv[2])
if "dtype" in kwargs:
    kwargs["dtype"] = getattr(torch, kwargs["dtype"])
if "streaming" in kwargs:
    kwargs["streaming"] = infer.StreamingConfig(**kwargs["streaming"])
llm = infer.load(path, **kwargs)
llm.generate("Hello", max_new_tokens=4)
stop = True; t.join()
print(json.dumps({"peak_rss": status("VmHWM") - base_rss, "peak_anon": peak_anon[0] - base_anon}))
"""


def measure(path: Path, **kwargs: object) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), json.dumps(kwargs)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{path} {kwargs}: {out.stderr.strip().splitlines()[-1]}")
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    import torch

    from infer.realmodels import smollm2_path
    from infer.testing import SMOLLM2_SHAPE, build_checkpoint

    smol = ROOT / ".bench" / "smol-shaped-llama-bf16"
    if not (smol / "config.json").is_file():
        build_checkpoint(smol, "llama", dtype=torch.bfloat16, **SMOLLM2_SHAPE)
    disk = sum(f.stat().st_size for f in smol.glob("*.safetensors"))
    gguf = smollm2_path()
    rows: list[tuple[str, Path, dict[str, object], int]] = [
        ("safetensors bf16 -> float32", smol, {"dtype": "float32"}, disk),
        ("safetensors bf16 -> bfloat16", smol, {"dtype": "bfloat16"}, disk),
        ("safetensors, quantize=int8", smol, {"dtype": "bfloat16", "quantize": "int8"}, disk),
        ("safetensors, quantize=q4_0", smol, {"dtype": "bfloat16", "quantize": "q4_0"}, disk),
        (
            "safetensors, streaming 96MB",
            smol,
            {
                "dtype": "bfloat16",
                "streaming": {
                    "memory_budget": "96MB",
                    "layer_group_size": 2,
                    "max_context": 256,
                    "max_prefill_tokens": 64,
                },
            },
            disk,
        ),
        ("GGUF Q4_1 (SmolLM2-135M)", gguf, {}, gguf.stat().st_size),
    ]
    print(
        f"{'path':<32} {'on disk':>10} {'peak anon':>10} {'peak RSS':>10}  (MiB, above the import baseline)"
    )
    for name, path, kwargs, size in rows:
        m = measure(path, **kwargs)
        mib = 2**20
        print(f"{name:<32} {size / mib:>10.1f} {m['peak_anon'] / mib:>10.1f} {m['peak_rss'] / mib:>10.1f}")


if __name__ == "__main__":
    main()
