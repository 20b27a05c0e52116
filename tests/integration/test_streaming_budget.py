"""The memory budget holds (FR-005, T-005, IT-004): a model several times larger than the budget runs in it.

A subprocess imports torch and infer and measures its fixed overhead (after starting its thread
pools and its lazily imported meta-device machinery, which any model build pulls in), loads a ~335 MB
generated checkpoint with a budget about 4x smaller (`infer.load(..., streaming=...)`), generates
through its engine, and samples its anonymous memory (``RssAnon`` in
``/proc/self/status``: on CPU that is the device memory) every few milliseconds.
The peak must stay under the overhead plus the budget. A budget that cannot work
is refused at load with a message saying what would fit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import infer
from infer.assembly.build import ModelBuilder
from infer.assembly.options import LoadOptions
from infer.engine import SamplingParams
from infer.loader.config import load_config
from infer.loader.weights import SafetensorsSource
from infer.streaming import BudgetError, StreamingConfig, StreamingExecutor, build_streamed
from infer.testing import build_tokenizer
from infer.testing.synthetic import SyntheticSpec, write_synthetic_checkpoint
from infer.testing.trace import trace

SPEC = SyntheticSpec(hidden_size=512, intermediate_size=1536, num_hidden_layers=24, vocab_size=8192)
BUDGET = 80 * 10**6

CHILD = r"""
import json, re, sys, threading, time

def anon_bytes():
    with open("/proc/self/status") as f:
        return int(re.search(r"RssAnon:\s+(\d+) kB", f.read()).group(1)) * 1024

import dataclasses
import tokenizers  # what infer.load imports on its way: part of the fixed overhead
import torch
import infer.api
from infer.engine import SamplingParams, collect
from infer.assembly.build import build_empty
from infer.loader.config import load_config
from infer.streaming import StreamingConfig

path, budget, prefetch = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
config = load_config(path)
# Fixed overhead: torch's thread pools and the meta-device machinery it imports lazily
# (sympy, mpmath: ~80 MB) the first time any model is built on the meta device.
(torch.randn(256, 256) @ torch.randn(256, 256)).sum()
tiny = dataclasses.replace(config, hidden_size=64, intermediate_size=64, num_hidden_layers=1, vocab_size=16)
build_empty(tiny)
base = anon_bytes()
peak = base
running = True

def sample():
    global peak
    while running:
        peak = max(peak, anon_bytes())
        time.sleep(0.002)

sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
streaming = StreamingConfig(
    layer_group_size=2, memory_budget=budget, prefetch=prefetch, max_context=128, max_prefill_tokens=64
)
llm = infer.api.load(path, dtype=torch.float32, streaming=streaming)
prompt = [(7 * i + 3) % config.vocab_size for i in range(48)]
params = SamplingParams(max_tokens=16, ignore_eos=True)
(handle,) = llm.engine.submit_many([prompt], [params], wait=True, drive=True)
tokens, _ = collect(handle)
running = False
sampler.join()
peak = max(peak, anon_bytes())
model = llm.model
stats = model.executor.stats
print(json.dumps({
    "base": base, "peak": peak, "tokens": len(tokens), "planned": stats.planned_bytes,
    "bytes_loaded": stats.bytes_loaded, "resident_layers": stats.resident_layers,
    "plan": model.executor.plan.describe(),
}))
"""


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("synthetic-335MB"), SPEC)
    build_tokenizer(path)  # `infer.load` needs one (ids past its 262 tokens decode to nothing)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
def test_peak_memory_stays_within_budget(big_checkpoint: Path, prefetch: bool) -> None:
    src = Path(__file__).resolve().parents[2] / "src"
    env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(big_checkpoint), str(BUDGET), "1" if prefetch else "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    size = SPEC.nbytes(torch.float32)
    used = result["peak"] - result["base"]
    print(
        f"\ncheckpoint {size / 1e6:.0f} MB, budget {BUDGET / 1e6:.0f} MB, "
        f"planned {result['planned'] / 1e6:.1f} MB; "
        f"torch overhead {result['base'] / 1e6:.0f} MB, peak anonymous memory {result['peak'] / 1e6:.0f} MB "
        f"= overhead + {used / 1e6:.1f} MB; {result['bytes_loaded'] / 1e6:.0f} MB streamed for "
        f"{result['tokens']} tokens\n{result['plan']}"
    )
    assert size > 4 * BUDGET
    assert result["tokens"] == 16
    assert result["planned"] <= BUDGET
    assert result["peak"] <= result["base"] + BUDGET


def test_impossible_budget_refused_at_load(big_checkpoint: Path) -> None:
    streaming = StreamingConfig(layer_group_size=4, memory_budget="40MB", max_context=2048, prefetch=True)
    with pytest.raises(BudgetError) as info:
        build_streamed(
            ModelBuilder(
                SafetensorsSource(big_checkpoint),
                load_config(big_checkpoint),
                LoadOptions(device=torch.device("cpu"), dtype=torch.float32, streaming=streaming),
            ),
        )
    message = str(info.value)
    print(message)
    assert str(big_checkpoint) in message and "40.00 MB" not in message  # sizes are shown in MiB
    assert "layer_group_size=1 needs" in message and "max_context=" in message


def test_default_settings_find_a_way(big_checkpoint: Path) -> None:
    """Only a budget, a quarter of the model: the plan chooses group size, prefetch, prefill chunk."""
    size = SPEC.nbytes(torch.float32)
    budget = size // 4
    llm = infer.load(big_checkpoint, dtype=torch.float32, streaming=StreamingConfig(memory_budget=budget))
    model = llm.model
    assert isinstance(model.executor, StreamingExecutor)
    plan = model.executor.plan
    print(
        f"\n{size / 1e6:.0f} MB model, budget {budget / 1e6:.0f} MB: {plan.describe()}; notes: {plan.notes}"
    )
    assert plan.total <= budget and plan.units
    prompt = [(5 * i + 1) % SPEC.vocab_size for i in range(40)]
    (traced,) = trace(llm, [prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(traced.tokens) == 4
