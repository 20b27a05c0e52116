"""Llama 3: pre-norm blocks, SwiGLU, llama3-scaled RoPE, no QK-norm."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from infer.loader.config import FREQ_FACTORS, ModelConfig
from infer.models.arch import Architecture, Fix, GGUFKeys, GGUFRules
from infer.models.base import DecoderLM
from infer.models.common import KVStore, RMSNorm, attention_from_config, mlp_from_config


class LlamaTransformerBlock(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``. Qwen 3 is this with QK-norm."""

    qk_norm: bool = False
    qkv_bias: bool | None = None  # None: the config's attention_bias

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention_from_config(config, qk_norm=self.qk_norm, qkv_bias=self.qkv_bias)
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
        x = x + self.attention_out(self.self_attn(self.input_layernorm(x), cos, sin, mask, cache))
        out: torch.Tensor = x + self.mlp_out(self.mlp(self.mlp_in(x)))
        return out

    # Where the norms sit around the two sub-layers (Gemma 3 overrides them: sandwich norms).
    def attention_out(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.post_attention_layernorm(x)
        return out

    def mlp_out(self, h: torch.Tensor) -> torch.Tensor:
        return h


class LlamaForCausalLM(DecoderLM):
    block_class: type[nn.Module] = LlamaTransformerBlock

    def __init__(self, config: ModelConfig) -> None:
        layers = [self.block_class(config) for _ in range(config.num_hidden_layers)]
        super().__init__(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps))


# --------------------------------------------------------------------------- checkpoints

# GGUF tensor names inside a block (llama.cpp) -> our module path inside a layer.
GGUF_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
GGUF_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def gguf_layer(
    attention: Mapping[str, str] = GGUF_ATTENTION, mlp: Mapping[str, str] = GGUF_MLP
) -> dict[str, str]:
    """The GGUF names of Llama's block: its two norms, and the ``attention`` and ``mlp`` given."""
    return {"attn_norm": "input_layernorm", **attention, "ffn_norm": "post_attention_layernorm", **mlp}


GGUF_LAYER = gguf_layer()
# llama.cpp's converter reorders the rows of Q and K from HF's rotate-half layout to
# interleaved pairs (for llama and the models it converts as llama: Mistral, SmolLM2, ...).
GGUF_PERMUTED = {
    "self_attn.q_proj.weight": Fix.PERMUTE_Q,
    "self_attn.q_proj.bias": Fix.PERMUTE_Q,
    "self_attn.k_proj.weight": Fix.PERMUTE_K,
    "self_attn.k_proj.bias": Fix.PERMUTE_K,
}
ROPE_FREQS = "rope_freqs.weight"


def gguf_metadata(meta: GGUFKeys) -> dict[str, Any]:
    """Llama's GGUF extras: projection biases when the file has them, Llama 3.1+ RoPE factors."""
    raw: dict[str, Any] = {
        "attention_bias": meta.has_tensor("blk.0.attn_q.bias"),
        "mlp_bias": meta.has_tensor("blk.0.ffn_up.bias"),
    }
    if meta.has_tensor(ROPE_FREQS):
        # llama.cpp divides each RoPE frequency by these factors (its converter computes them
        # from the llama3 rope_scaling of config.json).
        raw["rope_scaling"] = {"rope_type": FREQ_FACTORS, "factors": meta.float_vector(ROPE_FREQS)}
    return raw


def write_gguf_metadata(w: Any, arch: str, c: ModelConfig) -> None:
    """The inverse of `gguf_metadata` for `infer.gguf.writer` (llama3 scaling becomes ``rope_freqs``)."""
    w.add_uint32(f"{arch}.rope.dimension_count", c.rotary_dim)


ARCH = Architecture(
    model_type="llama",
    model_class=LlamaForCausalLM,
    gguf=GGUFRules(
        architectures=("llama",),
        layer=GGUF_LAYER,
        fixes=GGUF_PERMUTED,
        metadata=gguf_metadata,
        write_metadata=write_gguf_metadata,
        config_tensors=(ROPE_FREQS,),
    ),
)
