"""Streamed models give the resident model's logits and tokens, bit for bit (T-004, IT-001..003).

Bitwise in the deterministic mode (docs/numerics.md), where it holds by construction: the
resident and the streamed layer run the same modules on the same fixed tiles (no fused
projections), and a head streamed in chunks of whole column tiles computes every logit
in the tile the resident head uses.

For the three tiny architectures (Llama untied; Qwen 3 and Gemma 3 tied), group sizes
1, 2 and one that does not divide the layer count, prefetch on and off: prefill and
KV-cached greedy decoding of a left-padded batch of two prompts, every step's logits
compared with `torch.equal`. Variants: some layers resident, embedding and head
streamed (the head in several chunks), a sharded checkpoint, a dtype conversion on
read, and the public `infer.load(..., streaming=...)` path.
"""

from __future__ import annotations

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
from infer.models.projections import set_deterministic
from infer.streaming import StreamingConfig, build_streamed

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 64, 12, 180, 33], [8, 1, 77, 150]]  # longer than the sliding window (8)
STEPS = 6


def load_resident(path: Path, dtype: torch.dtype = torch.float32) -> DecoderLM:
    model = load_model(ModelBuilder(SafetensorsSource(path), load_config(path), LoadOptions(dtype=dtype)))
    set_deterministic(model)
    return model


def load_streamed(path: Path, dtype: torch.dtype = torch.float32, **kw: Any) -> DecoderLM:
    config = load_config(path)
    settings: dict[str, Any] = dict(
        memory_budget="256MB", max_resident_layers=0, max_batch_size=2, max_context=64
    )
    settings.update(kw)
    model = build_streamed(
        ModelBuilder(
            SafetensorsSource(path),
            config,
            LoadOptions(device=torch.device("cpu"), dtype=dtype, streaming=StreamingConfig(**settings)),
        ),
    )
    set_deterministic(model)
    return model


@torch.inference_mode()
def greedy_trace(model: DecoderLM, steps: int = STEPS) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of the prefill and of every decode step, and the greedy tokens, with a KV cache."""
    ids, pad = left_pad(PROMPTS, pad_id=0)
    cache = model.make_cache(ids.shape[0], ids.shape[1] + steps, pad=pad)
    logits = model(ids, cache)  # [B, T, V]
    all_logits, tokens = [logits], []
    for _ in range(steps):
        nxt = logits[:, -1].argmax(-1)  # [B]
        tokens.append(nxt)
        logits = model(nxt[:, None], cache)  # [B, 1, V]
        all_logits.append(logits)
    return all_logits, tokens


def assert_identical(want: DecoderLM, got: DecoderLM, label: str) -> None:
    want_logits, want_tokens = greedy_trace(want)
    got_logits, got_tokens = greedy_trace(got)
    worst = max((w - g).abs().max().item() for w, g in zip(want_logits, got_logits, strict=True))
    print(f"{label}: max |streamed - resident| over {len(want_logits)} steps = {worst:.3g}")
    for step, (w, g) in enumerate(zip(want_logits, got_logits, strict=True)):
        assert torch.equal(w, g), (
            f"{label}: logits differ at step {step} (max diff {(w - g).abs().max().item():.3g})"
        )
    assert [t.tolist() for t in want_tokens] == [t.tolist() for t in got_tokens], label


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
@pytest.mark.parametrize("group_size", [1, 2, 3])  # 2 does not divide 3 layers, 3 does not divide 4
def test_streamed_equals_resident(tiny_ckpt_factory: Any, arch: str, group_size: int, prefetch: bool) -> None:
    path = tiny_ckpt_factory(arch)
    resident = load_resident(path)
    streamed = load_streamed(path, layer_group_size=group_size, prefetch=prefetch)
    plan = streamed.executor.plan  # type: ignore[attr-defined]
    assert plan.resident_layers == [] and len(plan.layer_units) == -(
        -resident.config.num_hidden_layers // group_size
    )
    assert_identical(resident, streamed, f"{arch} group={group_size} prefetch={prefetch}")
    stats = streamed.executor.stats
    per_forward = sum(u.nbytes for u in plan.units)
    assert stats.forwards == STEPS + 1
    assert stats.bytes_loaded == stats.forwards * per_forward


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
def test_streamed_embedding_and_chunked_head(tmp_path: Path, arch: str, prefetch: bool) -> None:
    """Embedding rows read on demand and lm_head in several chunks (vocabulary larger than a layer)."""
    from infer.testing import build_checkpoint

    path = build_checkpoint(tmp_path / arch, arch, vocab_size=2048)
    resident = load_resident(path)
    streamed = load_streamed(path, layer_group_size=2, prefetch=prefetch, resident_embeddings=False)
    plan = streamed.executor.plan  # type: ignore[attr-defined]
    assert not plan.embed_resident and not plan.head_resident
    assert len(plan.head_unit_list) >= 2, plan.describe()
    assert_identical(
        resident, streamed, f"{arch} streamed embedding + {len(plan.head_unit_list)} head chunks"
    )


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_some_layers_resident(tiny_ckpt_factory: Any, arch: str) -> None:
    path = tiny_ckpt_factory(arch)
    streamed = load_streamed(path, layer_group_size=1, max_resident_layers=2)
    plan = streamed.executor.plan  # type: ignore[attr-defined]
    assert plan.resident_layers == [0, 1] and plan.embed_resident and plan.head_resident
    assert_identical(load_resident(path), streamed, f"{arch} 2 resident layers")


def test_budget_decides_residency(tiny_ckpt_factory: Any) -> None:
    """With room for everything, nothing streams; the executor then never loads a byte."""
    path = tiny_ckpt_factory("qwen3")
    streamed = load_streamed(path, max_resident_layers=None)
    plan = streamed.executor.plan  # type: ignore[attr-defined]
    assert plan.units == [] and plan.num_buffers == 0
    assert_identical(load_resident(path), streamed, "qwen3 all resident")
    assert streamed.executor.stats.bytes_loaded == 0


def test_sharded_checkpoint(tiny_ckpt_factory: Any) -> None:
    path = tiny_ckpt_factory("llama", sharded=True)
    streamed = load_streamed(path, layer_group_size=2)
    assert_identical(load_resident(path), streamed, "llama sharded")


def test_dtype_converted_on_read(tiny_ckpt_factory: Any) -> None:
    """A float32 checkpoint computed in bfloat16: the conversion happens while streaming."""
    path = tiny_ckpt_factory("gemma3")
    streamed = load_streamed(path, torch.bfloat16, layer_group_size=3)
    assert streamed.dtype == torch.bfloat16
    assert_identical(load_resident(path, torch.bfloat16), streamed, "gemma3 float32 -> bfloat16")


def test_forward_without_cache_and_out_of_order_calls(tiny_ckpt_factory: Any) -> None:
    """`forward_hidden` without `head`, then a full forward: the prefetched schedule restarts cleanly."""
    path = tiny_ckpt_factory("qwen3")
    resident = load_resident(path)
    streamed = load_streamed(path, layer_group_size=1, resident_embeddings=False)
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        want = resident(ids)
        streamed.forward_hidden(ids)  # leaves the head chunks unconsumed
        assert torch.equal(streamed(ids), want)
        assert torch.equal(streamed(ids), want)


def test_public_api_generate(tiny_ckpt_factory: Any, arch: str) -> None:
    import infer

    path = tiny_ckpt_factory(arch)
    events: list[Any] = []
    config = StreamingConfig(
        layer_group_size=2,
        memory_budget="64MB",
        max_resident_layers=0,
        max_batch_size=2,
        on_progress=events.append,
    )
    resident = infer.load(path, dtype="float32", deterministic=True)
    streamed = infer.load(path, dtype="float32", streaming=config, deterministic=True)
    assert_identical(resident.model, streamed.model, f"{arch} infer.load deterministic")
    prompts = ["The quick brown fox", "hi"]
    want = resident.generate(prompts, max_new_tokens=8)
    got = streamed.generate(prompts, max_new_tokens=8)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    stats = streamed.streaming_stats
    print(
        f"{arch}: {stats.forwards} forwards, {stats.bytes_loaded} bytes loaded, {len(events)} progress events"
    )
    assert stats.bytes_loaded > 0 and stats.units_computed == stats.units_loaded
    assert {e.kind for e in events} == {"loaded", "computed"}
    assert all(e.group is not None and e.nbytes > 0 for e in events)
