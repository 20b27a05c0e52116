"""Mistral: Llama's block; an optional sliding window on every layer."""

from __future__ import annotations

from infer.models.arch import Architecture, sliding_everywhere
from infer.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass


# transformers' AutoConfig reads a mistral config that has layer_types as Ministral's, which
# honours them; without them a set window is on every layer.
# llama.cpp converts Mistral as "llama" (Q/K permuted, no sliding window in the file): a
# Mistral GGUF file loads through the llama record.
ARCH = Architecture(
    model_type="mistral",
    model_class=MistralForCausalLM,
    reads=("sliding_window", "layer_types"),
    normalize=sliding_everywhere,
    gguf_as="llama",
)
