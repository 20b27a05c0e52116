"""The default ``compile="auto"`` (`infer.aot`): a first-ever process, the next one, and eager.

    uv run python benchmarks/auto_compile.py smol          # SmolLM2-135M Q4_1
    uv run python benchmarks/auto_compile.py gemma --tokens 128

Each run is a fresh process (``python -c``), so imports and loading count as a user sees
them; packages go to a temporary directory (empty at the start, so the first process finds
none). Four processes, one after the other:

1. **cold**: the default load (no flags, no environment); the generation runs eagerly; at its
   exit the process starts the package's build (`infer.aot.idle` running ``python -m infer.aot``).
2. **beside the build**: at once, an eager process (``compile=False``) while that build is
   under way: `infer.aot.idle` must stop the build while this process works, so its speed must
   be that of row 4. The benchmark then waits for the build.
3. **warm**: the default load again: the package is there.
4. **eager**: ``compile=False``, nothing else running.

Each process reports ready (process start -> ``infer.load`` returned, and the part after
``import torch``), first token (the prefill of a 128-token prompt) and decode tok/s over
``--tokens`` greedy tokens. Wall-clock, torch's default threads: quiet machines only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infer.aot import building

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter()
import infer, infer.aot as aot
from infer.realmodels import gemma3_270m_path, smollm2_path
from pathlib import Path
model, tokens, cache_dir, compile_arg = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
aot.settings.CACHE_DIR = Path(cache_dir)
path = smollm2_path() if model == "smol" else gemma3_270m_path()
llm = infer.load(str(path), compile=None if compile_arg == "default" else False)
t_ready = time.perf_counter()
ids = [(i * 7919) % 30000 + 100 for i in range(128)]
first = llm.generate(ids, max_new_tokens=1)
t_first = time.perf_counter()
out = llm.generate([i + 1 for i in ids], max_new_tokens=tokens)
t_end = time.perf_counter()
pcache = llm.execution.packages
builds = [p.pid for p in pcache.builds] if pcache is not None else []
print(json.dumps({
    "ready_s": t_ready - t0, "ready_after_torch_s": t_ready - t_torch,
    "first_token_s": t_first - t_ready,
    "decode_tok_s": (len(out.token_ids) - 1) / max(1e-9, out.decode_seconds),
    "tokens": len(out.token_ids), "packaged_steps": llm.execution.packaged_steps, "builds": builds,
}))
"""


def _child(model: str, tokens: int, cache: Path, mode: str) -> dict[str, float]:
    cmd = [sys.executable, "-c", CHILD, model, str(tokens), str(cache), mode]
    env = {k: v for k, v in os.environ.items() if k != "INFER_AOT"}  # the default
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("model", choices=["smol", "gemma"])
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens to decode (default 128)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        cold = _child(args.model, args.tokens, cache, "default")
        beside = _child(args.model, args.tokens, cache, "eager")
        under_way = bool(building(cache))
        t0 = time.perf_counter()
        while building(cache):  # the build the cold process started
            time.sleep(0.5)
        waited = time.perf_counter() - t0
        built = sorted(p.name for p in cache.glob("*.pt2"))
        logs = [p.read_text().strip().splitlines()[-1] for p in cache.glob("*.log") if p.stem != "builder"]
        warm = _child(args.model, args.tokens, cache, "default")
        eager = _child(args.model, args.tokens, cache, "eager")
    print(f"{args.model}: {args.tokens} tokens after a 128-token prompt; packages built: {built} ({logs})")
    state = "still" if under_way else "no longer"
    print(
        f"(the build was {state} under way when the eager process beside it ended; "
        f"it went on for {waited:.1f} s after that)"
    )
    print("| process | ready s (after import torch) | first token s | decode tok/s | packaged steps |")
    print("|---|---|---|---|---|")
    rows = (
        ("cold (default, empty cache)", cold),
        ("eager beside the cold process's build", beside),
        ("warm (default)", warm),
        ("eager (compile=False)", eager),
    )
    for name, r in rows:
        print(f"| {name} | {r['ready_s']:.2f} ({r['ready_after_torch_s']:.2f}) | {r['first_token_s']:.2f} | "
              f"{r['decode_tok_s']:.1f} | {int(r['packaged_steps'])} |")  # fmt: skip
    print(
        f"warm / eager decode: {warm['decode_tok_s'] / eager['decode_tok_s']:.2f}x; "
        f"eager beside the build / eager alone: {beside['decode_tok_s'] / eager['decode_tok_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
