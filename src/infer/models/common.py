"""The pieces every architecture shares: `RMSNorm`, RoPE (tables and rotation), `Attention` and
`GatedMLP`, each built from a config (`attention_from_config`, `mlp_from_config`).

The attention products they call are `infer.models.attend`; their projections are
`infer.models.projections.Linear`. Activations are ``[B, T, D]``; attention works on
``[B, H, T, hd]``. Masks are float additive (``0`` attend, ``-inf`` masked) or boolean (``True``
attend), broadcastable to ``[B, 1, T, S]``; ``None`` means every key is visible (the models build
boolean ones from the cache's slots: `infer.kv.cache`). RoPE uses HF's ``rotate_half`` layout, so
HF checkpoints need no Q/K permutation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from infer.loader.config import FREQ_FACTORS, FULL_ATTENTION, ROPE_TYPES, SLIDING_ATTENTION, ModelConfig
from infer.models.attend import attend_any, attend_shared
from infer.models.projections import Fusable, Linear

# ---- norms ----------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in float32 (as transformers does).

    ``unit_offset=True`` is Gemma's variant: the stored weight is a delta and the
    scale is ``(1 + weight)``, applied before casting back (transformers does the
    same: Llama casts then multiplies, Gemma multiplies then casts).
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, unit_offset={self.unit_offset}"


# ---- rotary position embeddings -------------------------------------------------------------


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


# ---- attention -------------------------------------------------------------------------------


class KVStore(Protocol):
    """What attention needs from a per-layer KV cache (see `infer.kv.cache`)."""

    key_limit: int | None  # keys at or past ``key_limit + T`` are masked for every query (None: unknown)
    key_start: int | None  # query ``t`` sees no key before ``key_start + t`` (None: no such bound)
    # A shared prefix (`infer.kv.prefix`): keys/values ``[1, Hkv, R, hd]`` every row may read, and the
    # mask ``[B, 1, T, R]`` of what each row's queries see of them.
    shared_k: torch.Tensor | None
    shared_v: torch.Tensor | None
    shared_mask: torch.Tensor | None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [B, Hkv, T, hd]``; return the keys/values to attend to ``[B, Hkv, S, hd]``."""
        ...


class Attention(Fusable):
    """Multi-head attention with GQA, decoupled ``head_dim``, optional QK-norm.

    Projections are named as in HF checkpoints (``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj``, ``q_norm``, ``k_norm``); a subclass with fused projections overrides
    `project_qkv` (Phi-3's ``qkv_proj``). ``deterministic`` (`set_deterministic`) selects
    `attend_tiled`; otherwise `attend` runs scaled-dot-product attention.
    """

    deterministic: bool = False
    output_projection = "o_proj"  # the module whose input is the heads' outputs [B, T, H * hd]

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        norm_unit_offset: bool = False,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.softcap = softcap
        self.make_qkv(hidden_size, qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, norm_eps, unit_offset=norm_unit_offset)
            self.k_norm = RMSNorm(head_dim, norm_eps, unit_offset=norm_unit_offset)

    def make_qkv(self, hidden_size: int, bias: bool) -> None:
        self.q_proj = Linear(hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden_size, self.num_kv_heads * self.head_dim, bias=bias)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, T, D]`` -> q ``[B, T, H, hd]``, k and v ``[B, T, Hkv, hd]``."""
        B, T, _ = x.shape
        H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if self._fused:
            q, k, v = self._fused[0](x).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.reshape(B, T, H, hd), k.reshape(B, T, Hkv, hd), v.reshape(B, T, Hkv, hd)

    def fusable(self) -> list[nn.Module]:
        return [self.q_proj, self.k_proj, self.v_proj]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVStore | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)  # [B, H, T, hd]
        k = apply_rotary(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, hd]
        v = v.transpose(1, 2)  # [B, Hkv, T, hd]
        key_limit = key_start = None
        shared = None
        if cache is not None:
            k, v = cache.update(k, v)  # [B, Hkv, S, hd]
            key_limit, key_start = cache.key_limit, cache.key_start
            if cache.shared_k is not None:
                shared = (cache.shared_k, cache.shared_v, cache.shared_mask)
        if shared is not None:  # a prefix stored once for the rows that share it (`infer.kv.prefix`)
            sk, sv, smask = shared
            assert sv is not None and smask is not None and mask is not None
            out = attend_shared(q, k, v, mask, sk, sv, smask, self.scale, self.softcap, key_limit, key_start)
        else:  # [B, H, T, hd]
            out = attend_any(
                q, k, v, mask, self.scale, self.softcap, key_limit, self.deterministic, key_start
            )
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # [B, T, H*hd]
        projected: torch.Tensor = self.o_proj(out)
        return projected


def attention_from_config(
    config: ModelConfig,
    *,
    qk_norm: bool,
    norm_unit_offset: bool = False,
    qkv_bias: bool | None = None,
    cls: type[Attention] = Attention,
) -> Attention:
    """The config's attention; ``qkv_bias`` overrides ``attention_bias`` for Q/K/V only (Qwen 2)."""
    return cls(
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.computed_head_dim,
        qkv_bias=config.attention_bias if qkv_bias is None else qkv_bias,
        o_bias=config.attention_bias,
        qk_norm=qk_norm,
        norm_eps=config.rms_norm_eps,
        norm_unit_offset=norm_unit_offset,
        scale=config.attention_scale,
        softcap=config.attn_logit_softcapping,
    )


# ---- feed-forward ----------------------------------------------------------------------------


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh-GELU, written out as OpenAI (and transformers' ``gelu_new``) compute it.

    Mathematically `F.gelu(approximate="tanh")`; the fused kernel rounds differently
    (logits differ by ~1e-5 on a tiny GPT-2), so the checkpoint's own formula is used.
    """
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": gelu_new,
    "gelu": F.gelu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}") from None


class GatedMLP(Fusable):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: SwiGLU (silu) or GeGLU (gelu_pytorch_tanh)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = activation(act)

    def fusable(self) -> list[nn.Module]:
        return [self.gate_proj, self.up_proj]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused:
            gate, up = self._fused[0](x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        out: torch.Tensor = self.down_proj(self.act_fn(gate) * up)
        return out


def mlp_from_config(config: ModelConfig) -> GatedMLP:
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)


__all__ = [
    "ACTIVATIONS",
    "Attention",
    "GatedMLP",
    "KVStore",
    "RMSNorm",
    "RotaryEmbedding",
    "activation",
    "apply_rotary",
    "attention_from_config",
    "gelu_new",
    "make_rotary_embeddings",
    "mlp_from_config",
    "rope_inv_freq",
    "rope_tables",
    "rotate_half",
]
