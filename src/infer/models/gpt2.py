"""GPT-2: learned absolute positions, LayerNorm with bias, fused QKV, tanh-GELU MLP, tied head.

Per-layer modules keep the HF checkpoint's names (``ln_1``, ``attn.c_attn``,
``attn.c_proj``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``). Their weights keep HF's
`Conv1D` layout, ``[in, out]``, so a safetensors checkpoint loads as stored; a GGUF
file (whose converter transposed them to ``[out, in]``) is transposed back, or, when
quantized, gets a packed linear module in their place. No RoPE: `embed` adds the
position embedding of each token's position (``positions [B, T]`` from the cache or
the left padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infer.loader.config import FULL_ATTENTION, ModelConfig
from infer.models.base import DecoderLM, StepInputs
from infer.models.common import KVStore, activation, attend


class Conv1D(nn.Module):
    """HF GPT-2's linear layer: ``y = x @ weight + bias`` with ``weight [in, out]``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.t(), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.c_attn = Conv1D(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = Conv1D(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache: KVStore | None) -> torch.Tensor:
        B, T, D = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x [B, H, T, hd]
        if cache is not None:
            k, v = cache.update(k, v)  # [B, H, S, hd]
        out = attend(q, k, v, mask, self.scale)  # [B, H, T, hd]
        y: torch.Tensor = self.c_proj(out.transpose(1, 2).reshape(B, T, D))
        return y


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = Conv1D(config.hidden_size, config.intermediate_size)
        self.c_proj = Conv1D(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.c_proj(self.act(self.c_fc(x)))
        return y


class GPT2Block(nn.Module):
    """``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``; ``cos``/``sin`` are unused (no RoPE)."""

    def __init__(self, config: ModelConfig, layer_type: str = FULL_ATTENTION) -> None:
        super().__init__()
        self.layer_type = layer_type
        eps = config.rms_norm_eps  # the config's one norm epsilon (GPT-2's layer_norm_epsilon)
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        mask: torch.Tensor | None,
        cache: KVStore | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask, cache)
        y: torch.Tensor = x + self.mlp(self.ln_2(x))
        return y


class GPT2LMHeadModel(DecoderLM):
    def __init__(self, config: ModelConfig) -> None:
        if config.layer_types is not None and set(config.layer_types) != {FULL_ATTENTION}:
            found = sorted(set(config.layer_types))
            raise ValueError(f"GPT-2 has only full-attention layers; config.layer_types has {found}")
        layers: list[nn.Module] = [GPT2Block(config) for _ in range(config.num_hidden_layers)]
        super().__init__(config, layers, nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps))
        n, d = config.max_position_embeddings, config.hidden_size
        self.embed_positions = nn.Embedding(n, d, _weight=torch.empty(n, d))  # skip normal_() (see base.py)
        self.rotary = nn.ModuleDict()  # absolute positions: no RoPE tables to compute per step

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # positions < max_position_embeddings: checked on the host before the step (DecoderLM.forward_hidden)
        x: torch.Tensor = self.embed_tokens(input_ids) + self.embed_positions(positions)  # [B, T, D]
        return x

    def run_layer(self, index: int, layer: nn.Module, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        kv = step.cache.layers[index] if step.cache is not None else None
        out: torch.Tensor = layer(x, None, None, step.masks[self.layer_types[index]], kv)
        return out
