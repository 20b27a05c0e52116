"""Preallocated KV cache: one buffer per layer, ring buffers for sliding-window layers.

Sequences in a batch are left-padded and advance in lock-step, so the cache works in
*slots*: slot ``s`` holds the token written at step ``s`` for every row. Row ``b``'s
real tokens start at slot ``pad[b]``; its RoPE position is ``slot - pad[b]``. Masks
are built once per forward and per layer type from the slots each layer will attend
to (`KVCache.key_slots`), so the attention kernels never see padding logic.

Full-attention layers keep ``max_len`` slots. Sliding-window layers keep
``min(window, max_len)`` slots in a ring: a decode step writes its token into slot
``pos % window`` and then attends over the ring (every entry is inside the window);
a multi-token step attends over ``ring + new`` and then writes the newest entries.
"""

from __future__ import annotations

import torch

from infer.config import SLIDING_ATTENTION, ModelConfig


class LayerKV:
    """K/V storage of one layer: ``[B, Hkv, capacity, hd]`` each."""

    def __init__(
        self, cache: KVCache, capacity: int, ring: bool, shape: tuple[int, int, int], **kw: object
    ) -> None:
        B, H, D = shape
        self.cache = cache
        self.capacity = capacity
        self.ring = ring
        self.k = torch.zeros(B, H, capacity, D, **kw)  # type: ignore[call-overload]
        self.v = torch.zeros(B, H, capacity, D, **kw)  # type: ignore[call-overload]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.cache.length
        T = k.shape[2]
        if not self.ring:
            end = start + T
            if end > self.capacity:
                raise RuntimeError(f"KV cache overflow: {end} positions, capacity {self.capacity}")
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
            return self.k[:, :, :end], self.v[:, :, :end]
        W = self.capacity
        if T == 1:
            slot = start % W
            self.k[:, :, slot : slot + 1] = k
            self.v[:, :, slot : slot + 1] = v
            n = min(start + 1, W)
            return self.k[:, :, :n], self.v[:, :, :n]
        n_old = min(start, W)
        k_all = torch.cat((self.k[:, :, :n_old], k), dim=2)  # [B, Hkv, n_old + T, hd]
        v_all = torch.cat((self.v[:, :, :n_old], v), dim=2)
        keep = min(T, W)
        slots = torch.arange(start + T - keep, start + T, device=self.k.device) % W
        self.k[:, :, slots] = k[:, :, T - keep :]
        self.v[:, :, slots] = v[:, :, T - keep :]
        return k_all, v_all

    @property
    def nbytes(self) -> int:
        return int(self.k.numel() * self.k.element_size() * 2)


class KVCache:
    """The KV cache of a whole model for one batch.

    ``pad[b]`` is the number of left-padding slots of row ``b``. ``length`` is the
    number of slots written so far; `advance` moves it after a forward.
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pad: torch.Tensor | None = None,
    ) -> None:
        self.config = config
        self.max_len = max_len
        self.batch_size = batch_size
        self.length = 0
        self.device = torch.device(device)
        if pad is None:
            pad = torch.zeros(batch_size, dtype=torch.long)
        self.pad = pad.to(device=self.device, dtype=torch.long)
        self.has_padding = bool((pad > 0).any())
        self.window = config.sliding_window
        shape = (batch_size, config.num_key_value_heads, config.computed_head_dim)
        self.layers: list[LayerKV] = []
        for i in range(config.num_hidden_layers):
            ring = config.layer_type(i) == SLIDING_ATTENTION and self.window is not None
            capacity = min(self.window, max_len) if ring and self.window is not None else max_len
            self.layers.append(LayerKV(self, capacity, ring, shape, dtype=dtype, device=self.device))

    @staticmethod
    def bytes_needed(config: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype) -> int:
        """Bytes the cache will take, without allocating it."""
        per_slot = 2 * batch_size * config.num_key_value_heads * config.computed_head_dim
        per_slot *= torch.empty((), dtype=dtype).element_size()
        total = 0
        for i in range(config.num_hidden_layers):
            sliding = config.layer_type(i) == SLIDING_ATTENTION and config.sliding_window is not None
            slots = min(config.sliding_window, max_len) if sliding and config.sliding_window else max_len
            total += slots * per_slot
        return total

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def positions(self, T: int) -> torch.Tensor:
        """RoPE / position-embedding positions ``[B, T]`` of the next ``T`` tokens."""
        slots = torch.arange(self.length, self.length + T, device=self.device)
        return (slots[None, :] - self.pad[:, None]).clamp_min(0)

    def key_slots(self, layer_type: str, T: int) -> torch.Tensor:
        """Slot index of every key a ``layer_type`` layer attends to in the next ``T``-token step."""
        start = self.length
        if layer_type != SLIDING_ATTENTION or self.window is None:
            return torch.arange(start + T, device=self.device)
        W = min(self.window, self.max_len)
        if T == 1:
            n = min(start + 1, W)
            s = torch.arange(n, device=self.device)
            return start - (start - s) % W  # slot s of the ring holds the newest slot index = s mod W
        n_old = min(start, W)
        s = torch.arange(n_old, device=self.device)
        old = (start - 1) - (start - 1 - s) % W
        return torch.cat((old, torch.arange(start, start + T, device=self.device)))

    def mask(self, layer_type: str, T: int) -> torch.Tensor | None:
        """Boolean mask ``[B, 1, T, S]`` (True = attend) for the next step; None when every key is visible."""
        if T == 1 and not self.has_padding:
            return None  # decode: every stored key is causal and (ring) inside the window
        window = self.window if layer_type == SLIDING_ATTENTION else None
        return slot_mask(self.length, T, self.key_slots(layer_type, T), self.pad, window)

    def advance(self, T: int) -> None:
        self.length += T


def slot_mask(
    start: int, T: int, key_slots: torch.Tensor, pad: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Mask ``[B, 1, T, S]`` for queries at slots ``start..start+T-1`` over ``key_slots [S]``.

    A query sees a key if the key is causal, inside the sliding window (if any) and
    not left padding. A padding query sees itself, so no row is fully masked (a fully
    masked row would put NaN into the cache and poison later steps).
    """
    q = torch.arange(start, start + T, device=key_slots.device)[:, None]  # [T, 1]
    k = key_slots[None, :]  # [1, S]
    visible = (k <= q) & (k >= 0)  # [T, S]
    if window is not None:
        visible &= (q - k) < window
    not_pad = k[None] >= pad[:, None, None]  # [B, 1, S]
    itself = (k == q)[None]  # [1, T, S]
    return (visible[None] & (not_pad | itself))[:, None]  # [B, 1, T, S]
