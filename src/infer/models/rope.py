"""Rotary position embeddings: inverse frequencies (vanilla, linear, llama3, per-frequency
factors), the per-layer-type tables, and the rotation in HF's ``rotate_half`` layout (so HF
checkpoints need no Q/K permutation)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from infer.loader.config import FREQ_FACTORS, FULL_ATTENTION, ROPE_TYPES, SLIDING_ATTENTION, ModelConfig


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32) for vanilla, llama3- or linear-scaled RoPE."""
    # Explicit device: also computed on the CPU inside a meta-device context (model skeletons),
    # where meta arithmetic would pull in sympy and cost ~1 s per process.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = "default" if scaling is None else scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if scaling is None:  # unreachable; narrows the type
        raise AssertionError
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == FREQ_FACTORS:  # llama.cpp's rope_freqs tensor: a divisor per frequency
        factors = torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"RoPE frequency factors have {factors.numel()} entries, expected {inv_freq.numel()}"
            )
        return inv_freq / factors
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported RoPE type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")


class RotaryEmbedding(nn.Module):
    """Computes ``(cos, sin)`` of shape ``[B, T, head_dim]`` for given positions ``[B, T]``."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        # Computed on the CPU whatever the default device; in a meta skeleton only its shape
        # exists until `reset_buffers` (after the weights were checked against the config).
        inv_freq = torch.empty(head_dim // 2)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if not inv_freq.is_meta:
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` on the CPU (after construction on the meta device)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, hd/2], float32 like transformers
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_tables(
    config: ModelConfig, max_positions: int | None = None, device: torch.device | str | None = None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The RoPE factory: float32 ``(cos, sin)`` tables ``[max_positions, rotary_dim]`` per layer type.

    Full-attention layers use ``rope_theta`` with ``rope_scaling``; sliding-window
    layers use ``rope_local_base_freq`` (unscaled) when the config sets it (Gemma 3).
    """
    n = max_positions if max_positions is not None else config.max_position_embeddings
    positions = torch.arange(n, device=device)[None]
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer_type, rope in make_rotary_embeddings(config).items():
        cos, sin = rope.to(device)(positions, torch.float32)
        tables[layer_type] = (cos[0], sin[0])
    return tables


def make_rotary_embeddings(config: ModelConfig) -> dict[str, RotaryEmbedding]:
    """One `RotaryEmbedding` per layer type the config uses (over the rotated dimensions of a head)."""
    head_dim = config.rotary_dim
    types = set(config.layer_types) if config.layer_types is not None else {FULL_ATTENTION}
    ropes: dict[str, RotaryEmbedding] = {}
    for layer_type in sorted(types):
        if layer_type == SLIDING_ATTENTION and config.rope_local_base_freq is not None:
            ropes[layer_type] = RotaryEmbedding(head_dim, config.rope_local_base_freq, None)
        elif layer_type in (FULL_ATTENTION, SLIDING_ATTENTION):
            ropes[layer_type] = RotaryEmbedding(head_dim, config.rope_theta, config.rope_scaling)
        else:
            raise ValueError(f"unsupported layer type {layer_type!r}")
    return ropes


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, hd]`` by ``cos/sin [B, T, rd]`` (broadcast over heads).

    With partial RoPE (``rd < hd``, Phi-3 family) only the first ``rd`` dimensions rotate.
    """
    cos = cos.unsqueeze(1)  # [B, 1, T, rd]
    sin = sin.unsqueeze(1)
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        rot, rest = x[..., :rd], x[..., rd:]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
    return x * cos + rotate_half(x) * sin
