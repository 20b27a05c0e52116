"""`KVCache`: full and ring buffers, slot bookkeeping, left-padding masks, sizes.

The end-to-end checks run our model on the tiny checkpoints: logits computed step by
step through the cache must equal one no-cache forward over the whole sequence. The
tiny Gemma 3 has a sliding window of 8, shorter than the sequences here, so its ring
buffers wrap several times.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from infer.cache import KVCache, slot_mask
from infer.loader.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, config_from_dict
from infer.testing import SLIDING_WINDOW

ATOL = 1e-4  # logits reach ~40 in magnitude; float32 reorderings give ~1e-5

ModelFactory = Callable[..., Any]


def small_config(window: int = 4, layer_types: list[str] | None = None, **kw: Any) -> ModelConfig:
    layer_types = layer_types or [SLIDING_ATTENTION, FULL_ATTENTION]
    data = {
        "model_type": "gemma3_text",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 100,
        "max_position_embeddings": 128,
        "sliding_window": window,
        "layer_types": layer_types,
    }
    return config_from_dict(data | kw)


def model_for(arch: str, tiny_ckpt_factory: Callable[..., Path], our_model_factory: ModelFactory) -> Any:
    return our_model_factory(tiny_ckpt_factory(arch))


def random_ids(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("arch", ["gemma3", "llama", "qwen3"])
def test_decode_matches_full_forward(
    arch: str, tiny_ckpt_factory: Callable[..., Path], our_model_factory: ModelFactory
) -> None:
    model = model_for(arch, tiny_ckpt_factory, our_model_factory)
    ids = random_ids(24, seed=1)  # 24 > 3 * sliding window: the Gemma rings wrap
    with torch.no_grad():
        full = model(ids)  # [1, 24, V]
        cache = model.make_cache(1, 32)
        steps = [model(ids[:, :5], cache)]
        for t in range(5, 24):
            steps.append(model(ids[:, t : t + 1], cache))
    assert cache.length == 24
    errs = []
    for t in range(5, 24):
        errs.append((steps[t - 4][:, 0] - full[:, t]).abs().max().item())
    prefill_err = (steps[0] - full[:, :5]).abs().max().item()
    print(f"{arch}: prefill max abs err {prefill_err:.2e}; decode steps max abs err {max(errs):.2e}")
    assert prefill_err < ATOL
    assert max(errs) < ATOL
    assert torch.equal(torch.cat(steps, 1).argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("chunks", [[3, 6, 1, 7, 3, 2], [2, 11, 1, 6], [10, 10]], ids=str)
def test_chunked_prefill_matches_full_forward(
    chunks: list[int], tiny_ckpt_factory: Callable[..., Path], our_model_factory: ModelFactory
) -> None:
    """Multi-token steps on a partly filled ring (chunks shorter and longer than the window)."""
    model = model_for("gemma3", tiny_ckpt_factory, our_model_factory)
    n = sum(chunks)
    ids = random_ids(n, seed=2)
    with torch.no_grad():
        full = model(ids)
        cache = model.make_cache(1, n)
        outs, start = [], 0
        for c in chunks:
            outs.append(model(ids[:, start : start + c], cache))
            start += c
    err = (torch.cat(outs, 1) - full).abs().max().item()
    print(f"gemma3 chunks {chunks}: max abs err {err:.2e}")
    assert err < ATOL


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_left_padded_batch_matches_single_rows(
    arch: str, tiny_ckpt_factory: Callable[..., Path], our_model_factory: ModelFactory
) -> None:
    """A left-padded batch gives each row the logits it gets alone, with and without cache."""
    model = model_for(arch, tiny_ckpt_factory, our_model_factory)
    lengths = [5, 12, 9]
    T, new = max(lengths), 10
    prompts = [random_ids(n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    continuations = random_ids(new, seed=20, batch=len(lengths))
    pad = torch.tensor([T - n for n in lengths])
    batch = torch.full((len(lengths), T), 259)  # pad id; any id must do since it is masked
    for b, p in enumerate(prompts):
        batch[b, T - len(p) :] = p
    attention_mask = (torch.arange(T)[None] >= pad[:, None]).long()

    with torch.no_grad():
        no_cache = model(batch, attention_mask=attention_mask)  # [B, T, V]
        cache = model.make_cache(len(lengths), T + new, pad=pad)
        prefill = model(batch, cache)
        decoded = [model(continuations[:, t : t + 1], cache) for t in range(new)]
        worst = 0.0
        for b, p in enumerate(prompts):
            alone = model(torch.cat((p, continuations[b]))[None])  # [1, n + new, V]
            n = len(p)
            errs = [
                (no_cache[b, T - n :] - alone[0, :n]).abs().max().item(),
                (prefill[b, T - n :] - alone[0, :n]).abs().max().item(),
                max((decoded[t][b, 0] - alone[0, n + t]).abs().max().item() for t in range(new)),
            ]
            assert all(torch.isfinite(x).all() for x in (no_cache[b], prefill[b]))
            worst = max(worst, *errs)
    print(f"{arch}: left-padded batch vs rows alone: max abs err {worst:.2e}")
    assert worst < ATOL


def test_cache_overflow_is_an_error(
    tiny_ckpt_factory: Callable[..., Path], our_model_factory: ModelFactory
) -> None:
    model = model_for("llama", tiny_ckpt_factory, our_model_factory)
    cache = model.make_cache(1, 6)
    with torch.no_grad():
        model(random_ids(6, seed=3), cache)
        with pytest.raises(RuntimeError, match="capacity 6"):
            model(random_ids(1, seed=4), cache)


# --------------------------------------------------------------------------- slots and rings


def test_key_slots_hand_checked() -> None:
    cache = KVCache(small_config(window=4), 1, 32, dtype=torch.float32)
    # full layers attend to every slot so far
    assert cache.key_slots(FULL_ATTENTION, 3).tolist() == [0, 1, 2]
    cache.advance(2)
    assert cache.key_slots(SLIDING_ATTENTION, 1).tolist() == [0, 1, 2]  # ring not yet full
    cache.advance(4)  # length 6
    # decode at slot 6: ring index s holds the newest slot = s (mod 4)
    assert cache.key_slots(SLIDING_ATTENTION, 1).tolist() == [4, 5, 6, 3]
    # 3-token step at slots 6..8: the old ring (slots 2..5), then the new tokens
    assert cache.key_slots(SLIDING_ATTENTION, 3).tolist() == [4, 5, 2, 3, 6, 7, 8]
    assert cache.key_slots(FULL_ATTENTION, 1).tolist() == list(range(7))


@pytest.mark.parametrize("window", [3, 4, 8])
def test_ring_contents_match_key_slots(window: int) -> None:
    """What `LayerKV.update` returns is exactly the keys `key_slots` describes, step after step."""
    config = small_config(window=window)
    cache = KVCache(config, 2, 64, dtype=torch.float32)
    Hkv, D = config.num_key_value_heads, config.computed_head_dim
    for T in [1, 2, 1, 5, 1, 1, 9, 1, 3, 1, 1, 1, 7]:
        new_slots = torch.arange(cache.length, cache.length + T, dtype=torch.float32)
        k = new_slots.view(1, 1, T, 1).expand(2, Hkv, T, D).clone()  # each key carries its slot number
        for i, lt in enumerate([SLIDING_ATTENTION, FULL_ATTENTION]):
            expected = cache.key_slots(lt, T)
            keys, values = cache.layers[i].update(k, -k)
            assert keys.shape == (2, Hkv, len(expected), D)
            assert keys[0, 0, :, 0].tolist() == expected.tolist(), (lt, cache.length, T)
            assert torch.equal(values, -keys)
            if lt == SLIDING_ATTENTION:
                assert cache.layers[i].capacity == window and cache.layers[i].ring
        cache.advance(T)


def test_slot_mask_left_padding_hand_checked() -> None:
    pad = torch.tensor([2, 0])
    mask = slot_mask(0, 4, torch.arange(4), pad, None)  # [B, 1, T, S]
    assert mask.shape == (2, 1, 4, 4) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0],  # padding query: sees only itself
        [0, 1, 0, 0],
        [0, 0, 1, 0],  # first real token: no pad keys
        [0, 0, 1, 1],
    ]
    assert mask[1, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    windowed = slot_mask(0, 4, torch.arange(4), torch.tensor([0]), 2)
    assert windowed[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


@pytest.mark.parametrize("layer_type", [FULL_ATTENTION, SLIDING_ATTENTION])
def test_padded_rows_never_see_pad_keys_and_no_row_is_empty(layer_type: str) -> None:
    pad = torch.tensor([0, 3, 7, 1])
    cache = KVCache(small_config(window=4), 4, 64, dtype=torch.float32, pad=pad)
    assert cache.has_padding
    for T in [9, 1, 1, 4, 1, 6, 1]:
        mask = cache.mask(layer_type, T)
        assert mask is not None  # with padding, even decode steps need a mask
        slots = cache.key_slots(layer_type, T)
        q = torch.arange(cache.length, cache.length + T)
        assert mask.any(-1).all()  # no fully masked row (it would write NaN into the cache)
        for b in range(4):
            real_query = q >= pad[b]  # [T]
            sees_pad = (mask[b, 0] & (slots < pad[b])[None]).any(-1)  # [T]
            assert not (sees_pad & real_query).any()
            if layer_type == SLIDING_ATTENTION:
                dist = q[:, None] - slots[None]
                assert not (mask[b, 0] & (dist >= 4)).any()
        assert torch.equal(cache.positions(T), (q[None] - pad[:, None]).clamp_min(0))
        cache.advance(T)


def test_decode_without_padding_needs_no_mask() -> None:
    cache = KVCache(small_config(window=4), 2, 16, dtype=torch.float32)
    assert not cache.has_padding
    cache.advance(6)
    assert cache.mask(SLIDING_ATTENTION, 1) is None
    assert cache.mask(FULL_ATTENTION, 1) is None
    prefill_mask = cache.mask(SLIDING_ATTENTION, 3)
    assert prefill_mask is not None and prefill_mask.shape == (2, 1, 3, 4 + 3)


def test_positions_start_at_zero_after_padding() -> None:
    cache = KVCache(small_config(), 2, 16, dtype=torch.float32, pad=torch.tensor([3, 0]))
    assert cache.positions(5).tolist() == [[0, 0, 0, 0, 1], [0, 1, 2, 3, 4]]
    cache.advance(5)
    assert cache.positions(1).tolist() == [[2], [5]]


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("max_len", [3, 8, 50])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_bytes_needed_equals_allocation(max_len: int, dtype: torch.dtype, batch: int) -> None:
    config = small_config(
        window=SLIDING_WINDOW, layer_types=[SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION]
    )
    cache = KVCache(config, batch, max_len, dtype=dtype)
    allocated = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.k, layer.v))
    assert cache.nbytes == allocated == KVCache.bytes_needed(config, batch, max_len, dtype)
    per_slot = 2 * batch * config.num_key_value_heads * config.computed_head_dim * dtype.itemsize
    assert allocated == per_slot * (2 * min(SLIDING_WINDOW, max_len) + max_len)
    assert [layer.capacity for layer in cache.layers] == [
        min(SLIDING_WINDOW, max_len),
        max_len,
        min(8, max_len),
    ]


def test_bytes_needed_for_tiny_checkpoints(
    tiny_ckpt_factory: Callable[..., Path], our_model_factory: ModelFactory, arch: str
) -> None:
    model = model_for(arch, tiny_ckpt_factory, our_model_factory)
    cache = model.make_cache(2, 40)
    assert cache.nbytes == KVCache.bytes_needed(model.config, 2, 40, model.dtype)
    assert all(layer.k.dtype == model.dtype for layer in cache.layers)
