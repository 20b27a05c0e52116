"""Gemma 3: sandwich norms, (1 + w) RMSNorm, GeGLU, QK-norm, scaled embeddings,
sliding-window layers with their own RoPE base."""

from __future__ import annotations

import torch
from torch import nn

from infer.loader.config import FULL_ATTENTION, ModelConfig
from infer.models.base import DecoderLM, gemma_embed_scale
from infer.models.common import KVStore, RMSNorm, attention_from_config, mlp_from_config


class Gemma3TransformerBlock(nn.Module):
    """Post-sub-layer norms are applied before the residual add (sandwich norm).

    ``layer_type`` (``config.layer_types[i]``) tells the model which mask and RoPE
    table to pass: sliding-window layers use ``rope_local_base_freq``.
    """

    def __init__(self, config: ModelConfig, layer_type: str = FULL_ATTENTION) -> None:
        super().__init__()
        self.layer_type = layer_type
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.self_attn = attention_from_config(config, qk_norm=True, norm_unit_offset=True)
        self.post_attention_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.mlp = mlp_from_config(config)
        self.post_feedforward_layernorm = RMSNorm(d, eps, unit_offset=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVStore | None = None,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        out: torch.Tensor = x + self.post_feedforward_layernorm(h)
        return out


class Gemma3ForCausalLM(DecoderLM):
    norm_unit_offset = True

    def __init__(self, config: ModelConfig) -> None:
        layers: list[nn.Module] = [
            Gemma3TransformerBlock(config, config.layer_type(i)) for i in range(config.num_hidden_layers)
        ]
        super().__init__(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True))
        self.embed_scale = gemma_embed_scale(config)
