"""A GGUF load's peak is its run's: no second copy of any weight at load (issue 34).

A subprocess loads a generated GGUF of ~110M parameters (Q4_0: ~62 MB packed, far above the
conversion's own temporaries) while a thread samples its anonymous memory (``RssAnon``: the
heap, where converted weights live) and its whole resident set every few milliseconds. The
peak above the memory held once loaded must stay under a bound well below the weights' own
size: a second copy of them at any moment of the load would break it. Run with the repack cache
off (every matrix converted in place) and then on, twice (written, then mapped: the fused q/k/v
and gate/up copies must not keep the mapped originals resident beside them). Figures printed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import json, re, sys, threading, time

def mem():
    with open("/proc/self/status") as f:
        s = f.read()
    kib = lambda key: int(re.search(key + r":\s+(\d+) kB", s).group(1)) * 1024
    return kib("RssAnon"), kib("VmRSS")

import torch
import infer
(torch.randn(256, 256) @ torch.randn(256, 256)).sum()  # thread pools up
path, cache, warm = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
infer.load(warm, cache=False).generate([5, 6, 7], max_new_tokens=2)  # what a load imports, once
import gc; gc.collect()
peak = [0, 0]
running = True

def sample():
    while running:
        a, r = mem()
        peak[0], peak[1] = max(peak[0], a), max(peak[1], r)
        time.sleep(0.002)

base = mem()
t = threading.Thread(target=sample, daemon=True)
t.start()
llm = infer.load(path, cache=cache)
held = sum(b.numel() * b.element_size() for b in llm.model.buffers())
time.sleep(0.05)
running = False
t.join()
after = mem()
llm.generate([5, 6, 7], max_new_tokens=2)
print(json.dumps({"base": base, "peak": peak, "after": after, "held": held}))
"""


@pytest.fixture(scope="module")
def big_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from infer.gguf.writer import write_gguf
    from infer.testing import build_tokenizer, tiny_hf_model

    root = tmp_path_factory.mktemp("load-memory")
    tok = build_tokenizer(root / "tok")
    write_gguf(root / "warm.gguf", tiny_hf_model("llama", tie_word_embeddings=False), tok, qtype="Q4_0")
    hf = tiny_hf_model(
        "llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, vocab_size=8192, tie_word_embeddings=False,
    )  # fmt: skip
    return write_gguf(root / "big.gguf", hf, tok, qtype="Q4_0")


def _load(path: Path, cache: bool, xdg: Path) -> dict[str, list[int] | int]:
    src = Path(__file__).resolve().parents[2] / "src"
    env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "XDG_CACHE_HOME": str(xdg), "INFER_AOT": "off"}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), "1" if cache else "0", str(path.with_name("warm.gguf"))],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, list[int] | int] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_a_load_holds_no_second_copy_of_the_weights(big_gguf: Path, tmp_path: Path) -> None:
    mib = 1 << 20
    runs = {
        "converted, no cache": _load(big_gguf, False, tmp_path / "a"),
        "converted, cache written": _load(big_gguf, True, tmp_path / "b"),
        "cache mapped": _load(big_gguf, True, tmp_path / "b"),
    }
    for label, r in runs.items():
        base, peak, after, held = r["base"], r["peak"], r["after"], r["held"]
        assert isinstance(base, list) and isinstance(peak, list) and isinstance(after, list)
        assert isinstance(held, int)
        anon_over = peak[0] - after[0]  # the load's transient heap beyond what it keeps
        rss_over = peak[1] - after[1]
        rss_held = after[1] - base[1]
        print(
            f"\n{label}: weights held {held / mib:.0f} MiB; resident after load +{rss_held / mib:.0f} MiB "
            f"over torch; peak above it: heap +{anon_over / mib:.1f} MiB, resident +{rss_over / mib:.1f} MiB"
        )
        # A second copy of the weights would be ~held; the conversion's chunk temporaries are far less.
        assert anon_over < 0.5 * held and rss_over < 0.5 * held
        # What stays resident is the weights once, with torch's allocator slack, not twice.
        assert rss_held < 1.75 * held
