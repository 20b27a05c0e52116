"""Phi-3: Llama's block with fused ``qkv_proj`` and ``gate_up_proj``, optional partial RoPE
and an optional sliding window on every layer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from infer.loader.config import ModelConfig
from infer.models.arch import Architecture, GGUFKeys, GGUFRules, sliding_everywhere
from infer.models.common import Attention, GatedMLP, RMSNorm, activation, attention_from_config
from infer.models.llama import LlamaForCausalLM, LlamaTransformerBlock, gguf_layer
from infer.models.projections import Fusable, Linear


class Phi3Attention(Attention):
    """Q, K and V from one ``qkv_proj``: rows ``[q (H*hd) | k (Hkv*hd) | v (Hkv*hd)]``."""

    def make_qkv(self, hidden_size: int, bias: bool) -> None:
        rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(hidden_size, rows, bias=bias)

    def fusable(self) -> list[nn.Module]:
        return []  # already one product

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_rows, kv_rows, kv_rows], dim=-1)
        return (
            q.reshape(B, T, self.num_heads, self.head_dim),
            k.reshape(B, T, self.num_kv_heads, self.head_dim),
            v.reshape(B, T, self.num_kv_heads, self.head_dim),
        )


class Phi3MLP(GatedMLP):
    """``down_proj(act(gate) * up)`` with ``gate_up_proj`` rows ``[gate (I) | up (I)]``."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False
    ) -> None:
        Fusable.__init__(self)
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = activation(act)

    def fusable(self) -> list[nn.Module]:
        return []  # already one product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # 2 x [B, T, I]
        out: torch.Tensor = self.down_proj(self.act_fn(gate) * up)
        return out


class Phi3TransformerBlock(LlamaTransformerBlock):
    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention_from_config(config, qk_norm=False, cls=Phi3Attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Phi3MLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)


class Phi3ForCausalLM(LlamaForCausalLM):
    block_class = Phi3TransformerBlock


# --------------------------------------------------------------------------- checkpoints


def gguf_metadata(meta: GGUFKeys) -> dict[str, Any]:
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if meta.has_tensor(name):
            raise ValueError(
                f"{meta.path}: tensor {name!r}: Phi-3 long-context RoPE (longrope) is not supported"
            )
    window = meta.get("attention.sliding_window")  # llama.cpp writes 0 for "no window"
    return {"sliding_window": window if isinstance(window, int) and window > 0 else None}


def write_gguf_metadata(w: Any, arch: str, c: ModelConfig) -> None:
    w.add_uint32(f"{arch}.rope.dimension_count", c.rotary_dim)
    w.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window or 0)


ARCH = Architecture(
    model_type="phi3",
    model_class=Phi3ForCausalLM,
    reads=("sliding_window",),  # Phi3Config ignores layer_types: a set window is on every layer
    normalize=sliding_everywhere,
    gguf=GGUFRules(
        architectures=("phi3",),
        # Q/K/V and gate/up fused, as in the HF checkpoint.
        layer=gguf_layer(
            {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj"},
            {"ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
        ),
        metadata=gguf_metadata,
        write_metadata=write_gguf_metadata,
    ),
)
