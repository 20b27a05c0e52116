"""Mistral: Llama's block; an optional sliding window on every layer."""

from __future__ import annotations

from infer.models.arch import Architecture, sliding_everywhere
from infer.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass


# llama.cpp converts Mistral as "llama" (Q/K permuted, no sliding window in the file): a
# Mistral GGUF file loads through the llama record.
ARCH = Architecture(
    model_type="mistral", model_class=MistralForCausalLM, normalize=sliding_everywhere, gguf_as="llama"
)
