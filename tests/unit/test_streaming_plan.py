"""Memory planning (FR-005, T-005), buffer layout, strict weight checks and run-time limits."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import infer
from infer.assembly.options import LoadOptions
from infer.kv.cache import KVCache
from infer.loader.config import load_config
from infer.loader.weights import SafetensorsSource
from infer.streaming import BudgetError, StreamingConfig, plan_streamed
from infer.streaming.build import _host_cache_units
from infer.streaming.layout import ALIGN
from infer.streaming.plan import workspace_bytes


def plan_for(path: Path, **kw: Any) -> Any:
    settings: dict[str, Any] = dict(max_context=64)
    settings.update(kw)
    return plan_streamed(
        SafetensorsSource(path),
        load_config(path),
        LoadOptions(streaming=StreamingConfig(**settings), dtype=torch.float32),
    )


def streamed(path: Path, streaming: StreamingConfig) -> Any:
    return infer.load(path, streaming=streaming).model


def test_more_budget_more_resident_layers(tiny_ckpt_factory: Any) -> None:
    path = tiny_ckpt_factory("gemma3")
    smallest = plan_for(
        path, memory_budget=10**9, max_resident_layers=0, layer_group_size=1, resident_embeddings=False
    )
    previous = -1
    for extra in range(0, 2_000_000, 100_000):
        budget = smallest.total + extra
        plan = plan_for(path, memory_budget=budget, layer_group_size=1)
        assert plan.total <= budget, plan.describe()
        resident_bytes = plan.resident_layer_bytes + plan.head_bytes + plan.embed_bytes
        assert resident_bytes >= previous
        previous = resident_bytes
    assert plan.units == [] and plan.resident_layers == [0, 1, 2, 3], plan.describe()
    print(plan.describe())


def test_buffers_and_layout(tiny_ckpt_factory: Any) -> None:
    path = tiny_ckpt_factory("qwen3")
    for prefetch, buffers in ((True, 2), (False, 1)):
        plan = plan_for(
            path, memory_budget="1GB", max_resident_layers=0, layer_group_size=2, prefetch=prefetch
        )
        assert plan.num_buffers == buffers
        assert [u.layers for u in plan.layer_units] == [(0, 1), (2,)]
        for unit in plan.units:
            assert unit.nbytes <= plan.buffer_bytes
            end = 0
            for slot in unit.slots:
                assert slot.offset % ALIGN == 0 and slot.offset >= end
                end = slot.offset + slot.nbytes
            assert end <= unit.nbytes


def test_refusal_says_what_would_fit(tiny_ckpt_factory: Any) -> None:
    path = tiny_ckpt_factory("llama")
    streaming_only: dict[str, Any] = dict(
        memory_budget=10**9,
        max_resident_layers=0,
        resident_embeddings=False,
        prefetch=True,
        max_prefill_tokens=64,
    )
    groups_of_3 = plan_for(path, layer_group_size=3, **streaming_only).total
    groups_of_1 = plan_for(path, layer_group_size=1, **streaming_only).total
    streaming_only["memory_budget"] = (groups_of_1 + groups_of_3) // 2
    with pytest.raises(BudgetError) as info:
        plan_for(path, layer_group_size=3, **streaming_only)
    message = str(info.value)
    print(message)
    assert "too small" in message and "What would fit" in message
    assert "layer_group_size=1 needs" in message and "(fits)" in message and "prefetch=False" in message
    assert "memory_budget of at least" in message
    assert plan_for(path, layer_group_size=1, **streaming_only).total <= streaming_only["memory_budget"]
    with pytest.raises(BudgetError, match="smallest possible configuration") as info:
        plan_for(path, memory_budget="1KB")  # even the settings chosen to fit cannot
    print(info.value)


def test_refusal_suggests_a_shorter_context(tiny_ckpt_factory: Any) -> None:
    path = tiny_ckpt_factory("llama")
    at_64 = plan_for(path, memory_budget=10**9, max_resident_layers=0, max_context=64, max_prefill_tokens=8)
    with pytest.raises(BudgetError, match=r"max_context=\d+ with layer_group_size=4 fits") as info:
        plan_for(
            path, memory_budget=at_64.total, max_resident_layers=0, max_context=4096, max_prefill_tokens=8
        )
    print(info.value)


def test_refused_at_load(tiny_ckpt_factory: Any) -> None:
    path = tiny_ckpt_factory("qwen3")
    with pytest.raises(BudgetError, match="What would fit"):
        streamed(path, StreamingConfig(memory_budget="200KB", layer_group_size=2))


def test_kv_cache_and_workspace_are_budgeted(tiny_ckpt_factory: Any) -> None:
    path = tiny_ckpt_factory("llama")
    short = plan_for(path, memory_budget="1GB", max_context=32)
    long = plan_for(path, memory_budget="1GB", max_context=128)
    config = load_config(path)
    assert short.kv_bytes == KVCache.bytes_needed(config, 1, 32, torch.float32)
    assert long.kv_bytes == KVCache.bytes_needed(config, 1, 128, torch.float32) == 2 * short.kv_bytes
    assert workspace_bytes(config, torch.float32, 1, 64, 64) > workspace_bytes(
        config, torch.float32, 1, 8, 64
    )


def test_host_cache_takes_the_first_units_that_fit(tiny_ckpt_factory: Any) -> None:
    plan = plan_for(
        tiny_ckpt_factory("llama"), memory_budget="1GB", max_resident_layers=0, layer_group_size=1
    )
    size = plan.units[0].nbytes
    assert _host_cache_units(plan, 0) == {}
    assert list(_host_cache_units(plan, 2 * size + 1)) == [0, 1]
    assert len(_host_cache_units(plan, 10**9)) == len(plan.units)


def _rewrite(src: Path, dst: Path, edit: Any) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_strict_weights(tiny_ckpt_factory: Any, tmp_path: Path) -> None:
    path = tiny_ckpt_factory("llama")
    streaming = StreamingConfig(
        memory_budget="64MB", max_resident_layers=0, layer_group_size=2, max_context=64
    )

    def build(p: Path) -> Any:
        return streamed(p, streaming)

    extra = _rewrite(
        path, tmp_path / "extra", lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(2)})
    )
    with pytest.raises(ValueError, match=r"unexpected tensor.*model\.layers\.0\.mlp\.extra\.weight"):
        build(extra)
    missing = _rewrite(path, tmp_path / "missing", lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor.*layers\.2\.mlp\.up_proj\.weight"):
        build(missing)

    def reshape(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.self_attn.q_proj.weight"] = t["model.layers.1.self_attn.q_proj.weight"][:-1].clone()

    bad_shape = _rewrite(path, tmp_path / "shape", reshape)
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight.*shape \[63, 64\].*\[64, 64\]"
    ):
        build(bad_shape)


def test_forward_beyond_the_plan_is_refused(tiny_ckpt_factory: Any) -> None:
    path = tiny_ckpt_factory("llama")
    streaming = StreamingConfig(
        memory_budget="64MB", max_resident_layers=0, max_context=32, max_prefill_tokens=16, max_batch_size=2
    )
    model = streamed(path, streaming)
    with torch.inference_mode():
        model(torch.zeros(2, 16, dtype=torch.long))  # exactly the plan
        model(torch.zeros(4, 8, dtype=torch.long))  # same tokens per forward, more rows: fine
        with pytest.raises(ValueError, match="max_prefill_tokens=16"):
            model(torch.zeros(2, 17, dtype=torch.long))
        with pytest.raises(ValueError, match=r"KV cache of 2 x 64 tokens exceeds the plan"):
            model(torch.zeros(2, 4, dtype=torch.long), model.make_cache(2, 64))
        model(torch.zeros(1, 4, dtype=torch.long), model.make_cache(1, 32))  # still works after refusals
