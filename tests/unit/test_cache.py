"""`KVCache`: full and ring buffers, per-row slots, ring bookkeeping, padding masks, sizes.

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

import infer.models  # noqa: F401  (registers the architectures' config rules: small_config builds gemma3_text)
from infer.kv.cache import KEY_CHUNK, KVCache, StepKV, StepPlan, slot_mask
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


def step(cache: KVCache, T: int, n_new: list[int] | None = None) -> StepPlan:
    plan = cache.make_plan(T, None if n_new is None else torch.tensor(n_new))
    cache.plan = plan
    return plan


def test_key_slots_hand_checked() -> None:
    cache = KVCache(small_config(window=4), 1, 32, dtype=torch.float32)
    assert cache.capacity == KEY_CHUNK  # rounded up to whole attention chunks
    plan = step(cache, 3)
    assert cache.key_slots(FULL_ATTENTION, plan).tolist() == list(range(KEY_CHUNK))  # masked past the query
    assert cache.key_slots(SLIDING_ATTENTION, plan).tolist() == [[0, 1, 2, -1, -1, -1, -1]]  # new, then ring
    cache.advance(plan)
    assert cache.ring_slots is not None and cache.ring_slots.tolist() == [[0, 1, 2, -1]]
    cache.advance(step(cache, 3))  # slots 3..5
    assert cache.ring_slots.tolist() == [[4, 5, 2, 3]]
    plan = step(cache, 1)  # decode at slot 6 writes ring slot 6 % 4 first
    assert cache.key_slots(SLIDING_ATTENTION, plan).tolist() == [[4, 5, 6, 3]]
    cache.advance(plan)
    plan = step(cache, 3)  # slots 7..9 over the old ring (slots 4, 5, 6, 3)
    assert cache.key_slots(SLIDING_ATTENTION, plan).tolist() == [[7, 8, 9, 4, 5, 6, 3]]
    cache.advance(plan)
    assert cache.ring_slots.tolist() == [[8, 9, 6, 7]]
    assert cache.slot.tolist() == [10]


def test_rows_advance_by_their_own_token_counts() -> None:
    """A right-padded step: each row writes its real tokens; the padding never enters a ring."""
    cache = KVCache(small_config(window=4), 2, 32, dtype=torch.float32)
    cache.advance(step(cache, 6, [2, 6]))
    assert cache.slot.tolist() == [2, 6]
    assert cache.ring_slots is not None and cache.ring_slots.tolist() == [[0, 1, -1, -1], [4, 5, 2, 3]]
    plan = step(cache, 1)
    assert plan.positions.tolist() == [[2], [6]]
    cache.advance(plan)
    assert cache.ring_slots.tolist() == [[0, 1, 2, -1], [4, 5, 6, 3]]
    cache.advance(step(cache, 3, [0, 3]))  # a row with nothing to add keeps its ring
    assert cache.slot.tolist() == [3, 10]
    assert cache.ring_slots.tolist() == [[0, 1, 2, -1], [8, 9, 6, 7]]


@pytest.mark.parametrize("window", [3, 4, 8])
def test_ring_contents_match_key_slots(window: int) -> None:
    """What `StepKV.update` returns holds, at every written key, the slot `key_slots` lists for it."""
    config = small_config(window=window)
    cache = KVCache(config, 2, 64, dtype=torch.float32)
    Hkv, D = config.num_key_value_heads, config.computed_head_dim
    counts = [([1, 2], 2), ([1, 1], 1), ([5, 3], 5), ([1, 1], 1), ([0, 9], 9), ([1, 1], 1), ([3, 2], 3)]
    for n_new, T in counts * 2:
        plan = step(cache, T, n_new)
        k = plan.slots.float()[:, None, :, None].expand(2, Hkv, T, D).clone()  # each key carries its slot
        for i, lt in enumerate([SLIDING_ATTENTION, FULL_ATTENTION]):
            expected = cache.key_slots(lt, plan).expand(2, -1)  # [B, S]
            kv = cache.layers[i]
            bound = StepKV(kv.k, kv.v, kv.ring, plan.slots, plan.n_new, plan.ring_write, plan.ring_src)
            keys, values = bound.update(k, -k)
            assert keys.shape == (2, Hkv, expected.shape[1], D)
            for b in range(2):
                seen = plan.slots[b, -1]  # keys up to the newest query matter; later ones are masked
                written = (expected[b] >= 0) & (expected[b] <= seen)
                assert keys[b, 0, written, 0].tolist() == expected[b, written].float().tolist(), (lt, T)
            assert torch.equal(values, -keys)
            if lt == SLIDING_ATTENTION:
                assert cache.layers[i].capacity == window and cache.layers[i].ring
        cache.advance(plan)


def test_slot_mask_left_padding_hand_checked() -> None:
    pad = torch.tensor([2, 0])
    mask = slot_mask(torch.arange(4), torch.arange(4), pad, None)  # [B, 1, T, S]
    assert mask.shape == (2, 1, 4, 4) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0],  # padding query: sees only itself
        [0, 1, 0, 0],
        [0, 0, 1, 0],  # first real token: no pad keys
        [0, 0, 1, 1],
    ]
    assert mask[1, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    windowed = slot_mask(torch.arange(4), torch.arange(4), torch.tensor([0]), 2)
    assert windowed[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    empty = slot_mask(torch.tensor([[5]]), torch.tensor([[3, -1, 5, 4]]), torch.tensor([0]), None)
    assert empty[0, 0].int().tolist() == [[1, 0, 1, 1]]  # -1: an empty ring slot


@pytest.mark.parametrize("layer_type", [FULL_ATTENTION, SLIDING_ATTENTION])
def test_padded_rows_never_see_pad_keys_and_no_row_is_empty(layer_type: str) -> None:
    pad = torch.tensor([0, 3, 7, 1])
    cache = KVCache(small_config(window=4), 4, 64, dtype=torch.float32, pad=pad)
    for T in [9, 1, 1, 4, 1, 6, 1]:
        plan = step(cache, T)
        mask = cache.mask(layer_type, plan)
        slots = cache.key_slots(layer_type, plan).expand(4, -1)  # [B, S]
        assert mask.any(-1).all()  # no fully masked row (it would write NaN into the cache)
        for b in range(4):
            q = plan.slots[b]  # [T]
            real_query = q >= pad[b]
            sees_pad = (mask[b, 0] & (slots[b] < pad[b])[None]).any(-1)  # [T]
            assert not (sees_pad & real_query).any()
            assert not (mask[b, 0] & (slots[b][None] > q[:, None])).any()  # causal
            if layer_type == SLIDING_ATTENTION:
                dist = q[:, None] - slots[b][None]
                assert not (mask[b, 0] & (dist >= 4)).any()
        assert torch.equal(plan.positions, (plan.slots - pad[:, None]).clamp_min(0))
        cache.advance(plan)


def test_positions_start_at_zero_after_padding() -> None:
    cache = KVCache(small_config(), 2, 16, dtype=torch.float32, pad=torch.tensor([3, 0]))
    plan = step(cache, 5)
    assert plan.positions.tolist() == [[0, 0, 0, 0, 1], [0, 1, 2, 3, 4]]
    cache.advance(plan)
    assert step(cache, 1).positions.tolist() == [[2], [5]]


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("max_len", [3, 8, 50, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_bytes_needed_equals_allocation(max_len: int, dtype: torch.dtype, batch: int) -> None:
    config = small_config(
        window=SLIDING_WINDOW, layer_types=[SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION]
    )
    cache = KVCache(config, batch, max_len, dtype=dtype)
    allocated = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.k, layer.v))
    assert cache.nbytes == allocated == KVCache.bytes_needed(config, batch, max_len, dtype)
    capacity = -(-max_len // KEY_CHUNK) * KEY_CHUNK
    per_slot = 2 * batch * config.num_key_value_heads * config.computed_head_dim * dtype.itemsize
    assert allocated == per_slot * (2 * SLIDING_WINDOW + capacity)
    assert [layer.capacity for layer in cache.layers] == [SLIDING_WINDOW, capacity, SLIDING_WINDOW]


def test_bytes_needed_for_tiny_checkpoints(
    tiny_ckpt_factory: Callable[..., Path], our_model_factory: ModelFactory, arch: str
) -> None:
    model = model_for(arch, tiny_ckpt_factory, our_model_factory)
    cache = model.make_cache(2, 40)
    assert cache.nbytes == KVCache.bytes_needed(model.config, 2, 40, model.dtype)
    assert all(layer.k.dtype == model.dtype for layer in cache.layers)
