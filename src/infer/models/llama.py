"""Llama 3: pre-norm blocks, SwiGLU, llama3-scaled RoPE, no QK-norm."""

from __future__ import annotations

import torch
from torch import nn

from infer.loader.config import FULL_ATTENTION, ModelConfig
from infer.models.base import DecoderLM
from infer.models.common import KVStore, RMSNorm, attention_from_config, mlp_from_config


class LlamaTransformerBlock(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``. Qwen 3 is this with QK-norm."""

    qk_norm: bool = False

    def __init__(self, config: ModelConfig, layer_type: str = FULL_ATTENTION) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention_from_config(config, qk_norm=self.qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp_from_config(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVStore | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class LlamaForCausalLM(DecoderLM):
    block_class: type[LlamaTransformerBlock] = LlamaTransformerBlock

    def __init__(self, config: ModelConfig) -> None:
        layers: list[nn.Module] = [
            self.block_class(config, config.layer_type(i)) for i in range(config.num_hidden_layers)
        ]
        super().__init__(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps))
