"""Qwen 2 / 2.5: Llama's block with biases on the Q, K and V projections (not on O)."""

from __future__ import annotations

from infer.models.arch import Architecture, GGUFRules, sliding_from_max_window_layers
from infer.models.llama import GGUF_LAYER, LlamaForCausalLM, LlamaTransformerBlock


class Qwen2TransformerBlock(LlamaTransformerBlock):
    qkv_bias = True


class Qwen2ForCausalLM(LlamaForCausalLM):
    block_class = Qwen2TransformerBlock


ARCH = Architecture(
    model_type="qwen2",
    model_class=Qwen2ForCausalLM,
    defaults={"rms_norm_eps": 1e-6},
    reads=("sliding_window", "layer_types"),
    normalize=sliding_from_max_window_layers,
    gguf=GGUFRules(architectures=("qwen2",), layer=GGUF_LAYER),
)
