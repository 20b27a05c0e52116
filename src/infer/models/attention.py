"""The attention layer: `Attention` (GQA, decoupled ``head_dim``, optional QK-norm), what it
needs of a KV cache (`KVStore`) and `attention_from_config`; the products are in
`infer.models.attend`."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from infer.loader.config import ModelConfig
from infer.models.attend import attend_any, attend_shared
from infer.models.norm import RMSNorm
from infer.models.projections import Fusable, Linear
from infer.models.rope import apply_rotary


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
