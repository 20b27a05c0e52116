"""What the KV cache holds (``infer.load(..., kv_dtype=...)``, CLI ``--kv-dtype``): float32,
bfloat16, float16 or int8 (with a float32 scale per token and head).

A narrower KV changes only the rounding of the keys and values attention reads: the logits stay
close to a float32 cache's (errors printed), memory shrinks by the bytes per element, and
perplexity runs through a cache of that dtype so the figure carries the cost.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import infer
from infer.api import resolve_kv_dtype
from infer.kv.cache import dequantize_int8, quantize_int8

PROMPT = [5, 9, 200, 31, 7, 64, 3, 18, 77, 101, 42, 250, 6]


def _prefill_logits(llm: infer.LLM) -> torch.Tensor:
    """Logits of every prompt position through a KV cache of the model's KV dtype: ``[T, V]``."""
    model = llm.model
    cache = model.make_cache(1, 64)
    with torch.inference_mode():
        logits: torch.Tensor = model(torch.tensor([PROMPT]), cache)[0].float()
    return logits


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_narrow_kv_stays_close_and_takes_less_memory(
    tiny_ckpt_factory: Callable[..., Path], arch: str
) -> None:
    path = tiny_ckpt_factory(arch)
    ref_llm = infer.load(path, dtype=torch.float32, kv_dtype="float32")
    ref = _prefill_logits(ref_llm)
    scale = ref.abs().max().item()
    ref_bytes = ref_llm.engine.slots.bytes_per_token
    bound = {"bfloat16": 2e-2, "float16": 4e-3, "int8": 5e-2}  # of max |logit|
    for kv in ("bfloat16", "float16", "int8"):
        llm = infer.load(path, dtype=torch.float32, kv_dtype=kv)
        assert llm.model.cache_dtype == getattr(torch, kv)
        err = (_prefill_logits(llm) - ref).abs().max().item() / scale
        per_token = llm.engine.slots.bytes_per_token
        hd = llm.config.computed_head_dim
        want = ref_bytes * (2 if kv != "int8" else (hd + 4)) // (4 * (1 if kv != "int8" else hd))
        print(f"\n{arch} kv {kv}: logits within {err:.2e} of max |logit|; {per_token} vs {ref_bytes} B/token")
        assert err < bound[kv]
        assert per_token == want
        # Generation runs on it (the engine's KV slots hold that dtype).
        out = llm.generate(PROMPT, 8)
        assert len(out.token_ids) >= 1
        assert llm.engine.slots.cache is not None and llm.engine.slots.cache.dtype == getattr(torch, kv)


def test_int8_round_trip_is_within_half_a_step() -> None:
    x = torch.randn(2, 3, 5, 64) * torch.tensor([0.01, 1.0, 300.0])[None, :, None, None]
    x[0, 0, 0] = 0.0  # an all-zero vector: scale 0, values 0
    q, scale = quantize_int8(x)
    back = dequantize_int8(q, scale, torch.float32)
    assert q.dtype == torch.int8 and scale.shape == x.shape[:-1]
    assert torch.equal(back[0, 0, 0], torch.zeros(64))
    err = (back - x).abs() / scale[..., None].clamp_min(1e-30)
    print(f"\nint8 round trip: at most {err.max().item():.3f} of a step")
    assert err.max().item() <= 0.5 + 1e-4


def test_perplexity_carries_the_kv_rounding(tiny_ckpt_factory: Callable[..., Path]) -> None:
    path = tiny_ckpt_factory("llama")
    text = "".join(chr(97 + (i * 7) % 26) for i in range(600))
    plain = infer.load(path, dtype=torch.float32).perplexity(text, context=64, max_chunks=4)
    same = infer.load(path, dtype=torch.float32, kv_dtype="float32").perplexity(
        text, context=64, max_chunks=4
    )
    narrow = infer.load(path, dtype=torch.float32, kv_dtype="int8").perplexity(text, context=64, max_chunks=4)
    print(f"\nppl float32 KV {plain.ppl:.6f}, int8 KV {narrow.ppl:.6f}")
    assert same.ppl == plain.ppl  # a KV of the model's own dtype: the plain forward
    assert narrow.ppl != plain.ppl  # the int8 rounding is in the figure ...
    assert abs(narrow.ppl / plain.ppl - 1) < 0.05  # ... and small


def test_bad_kv_dtype_is_named() -> None:
    with pytest.raises(ValueError, match=r"kv_dtype must be one of float32, bfloat16, float16, int8.*'int4'"):
        resolve_kv_dtype("int4")
    with pytest.raises(TypeError, match=r"kv_dtype must be a string or a torch\.dtype, got int"):
        resolve_kv_dtype(8)  # type: ignore[arg-type]
    assert resolve_kv_dtype(torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype(None) is None and resolve_kv_dtype("auto") is None


def test_default_kv_dtype_on_cpu_is_the_models() -> None:
    """On CPU the default keeps the activations' dtype (torch's fused attention is slower on
    bfloat16 inputs there: `infer.api.default_kv_dtype`), also for the packed GGUF models."""
    from infer.realmodels import smollm2_path

    llm = infer.load(smollm2_path())
    assert llm.model.cache_dtype == llm.model.dtype == torch.float32
