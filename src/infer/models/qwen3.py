"""Qwen 3: Llama's block with per-head RMSNorm on Q and K (before RoPE)."""

from __future__ import annotations

from infer.models.llama import LlamaForCausalLM, LlamaTransformerBlock


class Qwen3TransformerBlock(LlamaTransformerBlock):
    qk_norm = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    block_class = Qwen3TransformerBlock
