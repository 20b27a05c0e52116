"""Layer streaming on CUDA: equivalence, the memory budget and copy/compute overlap (skips without a GPU).

* Streamed logits and greedy tokens equal the resident model's on the same GPU,
  bit for bit, for the three tiny architectures, group sizes 1, 2, 3, prefetch on
  and off, with and without the pinned host cache.
* ``torch.cuda.max_memory_allocated`` stays within the budget (above what was
  allocated before loading, after cuBLAS has made its workspace).
* With prefetch, the host-to-device copies (side stream) overlap the compute
  (default stream), measured on the CUDA-event timeline; reading from disk every
  time, prefetch hides the compute behind the reads (wall time near max, not sum).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from model_checks import left_pad

from infer.assembly.build import ModelBuilder, load_model
from infer.assembly.options import LoadOptions
from infer.loader.config import load_config
from infer.loader.weights import SafetensorsSource
from infer.models.base import DecoderLM
from infer.streaming import StreamingConfig, build_streamed
from infer.streaming.stats import TimelineEntry
from infer.testing import build_tokenizer
from infer.testing.synthetic import SyntheticSpec, write_synthetic_checkpoint


def build_streaming_model(
    path: Path, streaming: StreamingConfig, dtype: torch.dtype = torch.bfloat16
) -> DecoderLM:
    """``path`` streamed to the GPU under ``streaming``."""
    return build_streamed(
        ModelBuilder(
            SafetensorsSource(path),
            load_config(path),
            LoadOptions(device=torch.device("cuda"), dtype=dtype, streaming=streaming),
        ),
    )


def load_resident(path: Path, dtype: torch.dtype) -> DecoderLM:
    return load_model(
        ModelBuilder(
            SafetensorsSource(path), load_config(path), LoadOptions(dtype=dtype, device=torch.device("cuda"))
        )
    )


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 64, 12, 180, 33], [8, 1, 77, 150]]
STEPS = 6
BIG = SyntheticSpec(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=24, vocab_size=16384
)  # 671 MB bf16


def streamed(path: Path, dtype: torch.dtype = torch.float32, **kw: Any) -> DecoderLM:
    settings: dict[str, Any] = dict(
        memory_budget="256MB", max_resident_layers=0, max_batch_size=2, max_context=64
    )
    settings.update(kw)
    return build_streaming_model(path, StreamingConfig(**settings), dtype)


@torch.inference_mode()
def greedy_trace(model: DecoderLM) -> tuple[list[torch.Tensor], list[list[int]]]:
    ids, pad = left_pad(PROMPTS, pad_id=0)
    ids, pad = ids.cuda(), pad.cuda()
    cache = model.make_cache(ids.shape[0], ids.shape[1] + STEPS, pad=pad)
    logits = model(ids, cache)
    all_logits, tokens = [logits], []
    for _ in range(STEPS):
        nxt = logits[:, -1].argmax(-1)
        tokens.append(nxt.tolist())
        logits = model(nxt[:, None], cache)
        all_logits.append(logits)
    return all_logits, tokens


@pytest.mark.parametrize("host_cache", [0, "64MB"], ids=["disk", "host-cache"])
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
@pytest.mark.parametrize("group_size", [1, 2, 3])
def test_cuda_streamed_equals_resident(
    tiny_ckpt_factory: Any, arch: str, group_size: int, prefetch: bool, host_cache: int | str
) -> None:
    path = tiny_ckpt_factory(arch)
    resident = load_resident(path, torch.float32)
    model = streamed(path, layer_group_size=group_size, prefetch=prefetch, host_memory_budget=host_cache)
    want_logits, want_tokens = greedy_trace(resident)
    for rep in range(2):  # the second pass reads from the host cache when there is one
        got_logits, got_tokens = greedy_trace(model)
        worst = max((w - g).abs().max().item() for w, g in zip(want_logits, got_logits, strict=True))
        print(
            f"{arch} group={group_size} prefetch={prefetch} host={host_cache} pass {rep}: "
            f"max diff {worst:.3g}"
        )
        assert all(torch.equal(w, g) for w, g in zip(want_logits, got_logits, strict=True))
        assert got_tokens == want_tokens
    stats = model.executor.stats
    if host_cache:
        assert stats.bytes_read < stats.bytes_loaded  # later passes came from pinned host memory


def test_cuda_streamed_head_and_bfloat16(tiny_ckpt_factory: Any, tmp_path: Path) -> None:
    from infer.testing import build_checkpoint

    path = build_checkpoint(tmp_path / "qwen3", "qwen3", vocab_size=2048)
    resident = load_resident(path, torch.bfloat16)
    model = streamed(path, torch.bfloat16, layer_group_size=2, resident_embeddings=False)
    assert len(model.executor.plan.head_unit_list) >= 2  # type: ignore[attr-defined]
    want, got = greedy_trace(resident), greedy_trace(model)
    assert all(torch.equal(w, g) for w, g in zip(want[0], got[0], strict=True)) and want[1] == got[1]


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("synthetic-cuda"), BIG, dtype=torch.bfloat16)
    build_tokenizer(path)  # `infer.load` needs one (ids past its 262 tokens decode to nothing)
    return path


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
def test_cuda_memory_within_budget(big_checkpoint: Path, prefetch: bool) -> None:
    import infer
    from infer.engine import SamplingParams
    from infer.testing.trace import trace

    budget = 160 * 10**6
    size = BIG.nbytes(torch.bfloat16)
    torch.cuda.synchronize()
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)  # cuBLAS(Lt) workspaces: fixed overhead
    torch.nn.functional.linear(x, x).sum().item()
    (x.float() @ x.float().T).sum().item()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    streaming = StreamingConfig(
        layer_group_size=2, memory_budget=budget, prefetch=prefetch, max_context=256, max_prefill_tokens=128
    )
    llm = infer.load(big_checkpoint, device="cuda", dtype=torch.bfloat16, streaming=streaming)
    model = llm.model
    prompt = [(7 * i + 3) % BIG.vocab_size for i in range(100)]
    (traced,) = trace(llm, [prompt], SamplingParams(max_tokens=32, ignore_eos=True))  # through the engine
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    stats = model.executor.stats
    print(
        f"\ncheckpoint {size / 1e6:.0f} MB bf16, budget {budget / 1e6:.0f} MB, "
        f"planned {stats.planned_bytes / 1e6:.1f} MB,"
        f" max_memory_allocated {peak / 1e6:.1f} MB above the {base / 1e6:.1f} MB before loading; "
        f"{stats.bytes_loaded / 1e6:.0f} MB streamed for {len(traced.tokens)} tokens\n"
        f"{model.executor.plan.describe()}"  # type: ignore[attr-defined]
    )
    assert size > 4 * budget and len(traced.tokens) == 32
    assert peak <= budget


def _overlap(timeline: list[TimelineEntry]) -> tuple[float, float]:
    """Seconds of copy, and of copy that overlaps some compute interval."""
    copies = [(e.start, e.end) for e in timeline if e.lane == "copy"]
    computes = sorted((e.start, e.end) for e in timeline if e.lane == "compute")
    total = sum(b - a for a, b in copies)
    covered = 0.0
    for a, b in copies:
        for c, d in computes:
            covered += max(0.0, min(b, d) - max(a, c))
    return total, covered


def test_cuda_copies_overlap_compute(big_checkpoint: Path) -> None:
    """Prefill-sized forwards: each group's compute outlasts the next group's copy, so copies hide."""
    model = build_streaming_model(
        big_checkpoint,
        StreamingConfig(
            layer_group_size=1,
            memory_budget="8GB",
            max_resident_layers=0,
            host_memory_budget="2GB",  # after the first forward, copies come from pinned host memory
            max_batch_size=8,
            max_context=1024,
            max_prefill_tokens=1024,
            trace=True,
        ),
    )
    ids = torch.randint(0, BIG.vocab_size, (8, 1024), device="cuda")
    with torch.inference_mode():
        model(ids)  # fills the host cache
        model.executor.reset_stats()  # type: ignore[attr-defined]
        for _ in range(3):
            model(ids)
    stats = model.executor.stats
    copy, covered = _overlap(stats.timeline)
    print(
        f"\ncopy {copy * 1e3:.1f} ms, of which {covered * 1e3:.1f} ms under compute "
        f"({100 * covered / copy:.0f}%); compute {stats.compute_seconds * 1e3:.1f} ms, "
        f"GPU waited {stats.wait_seconds * 1e3:.1f} ms for weights; {stats.bytes_loaded / 1e6:.0f} MB moved, "
        f"{stats.bytes_read / 1e6:.0f} MB of it read from disk"
    )
    assert stats.bytes_read == 0  # all from the pinned host cache
    assert covered >= 0.5 * copy
    assert stats.wait_seconds <= 0.5 * stats.load_seconds


def _time_forwards(model: DecoderLM, ids: torch.Tensor, n: int) -> float:
    with torch.inference_mode():
        model(ids)
        torch.cuda.synchronize()
        model.executor.reset_stats()  # type: ignore[attr-defined]
        start = time.perf_counter()
        for _ in range(n):
            model(ids)
        torch.cuda.synchronize()
        return time.perf_counter() - start


def test_cuda_prefetch_wall_time(big_checkpoint: Path) -> None:
    """Reading from disk every time (no host cache): prefetch hides the compute behind the reads."""
    ids = torch.randint(0, BIG.vocab_size, (16, 1024), device="cuda")
    walls = {}
    stats = {}
    for prefetch in (False, True):
        model = build_streaming_model(
            big_checkpoint,
            StreamingConfig(
                layer_group_size=2,
                memory_budget="16GB",
                prefetch=prefetch,
                max_resident_layers=0,
                max_batch_size=16,
                max_context=1024,
                max_prefill_tokens=1024,
            ),
        )
        walls[prefetch] = _time_forwards(model, ids, 4)
        stats[prefetch] = model.executor.stats
    s, p = stats[False], stats[True]
    print(
        f"\nsync: wall {walls[False]:.3f}s (load {s.load_seconds:.3f}s, compute {s.compute_seconds:.3f}s); "
        f"prefetch: wall {walls[True]:.3f}s (load {p.load_seconds:.3f}s, compute {p.compute_seconds:.3f}s, "
        f"GPU waited {p.wait_seconds:.3f}s)"
    )
    c, t = s.compute_seconds, s.load_seconds
    assert walls[False] >= 0.9 * (c + t)  # sync mode is serial: read, copy, compute, read...
    assert walls[True] <= walls[False] - 0.5 * min(c, t)
