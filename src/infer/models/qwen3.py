"""Qwen 3: Llama's block with per-head RMSNorm on Q and K (before RoPE)."""

from __future__ import annotations

from infer.models.arch import Architecture, GGUFRules, sliding_from_max_window_layers
from infer.models.llama import GGUF_LAYER, LlamaForCausalLM, LlamaTransformerBlock


class Qwen3TransformerBlock(LlamaTransformerBlock):
    qk_norm = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    block_class = Qwen3TransformerBlock


GGUF_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

ARCH = Architecture(
    model_type="qwen3",
    model_class=Qwen3ForCausalLM,
    defaults={"rms_norm_eps": 1e-6},
    reads=("sliding_window", "layer_types"),
    normalize=sliding_from_max_window_layers,
    gguf=GGUFRules(architectures=("qwen3",), layer={**GGUF_LAYER, **GGUF_QK_NORM}),
)
