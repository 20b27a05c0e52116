"""Model architectures, built from the shared pieces in `infer.models.common`."""

from __future__ import annotations

from infer.loader.config import ModelConfig
from infer.models.base import DecoderLM
from infer.models.gemma3 import Gemma3ForCausalLM, Gemma3TransformerBlock
from infer.models.gpt2 import GPT2Block, GPT2LMHeadModel
from infer.models.llama import LlamaForCausalLM, LlamaTransformerBlock
from infer.models.qwen3 import Qwen3ForCausalLM, Qwen3TransformerBlock

MODEL_CLASSES: dict[str, type[DecoderLM]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gpt2": GPT2LMHeadModel,
}

BLOCK_CLASSES: dict[str, type] = {
    "llama": LlamaTransformerBlock,
    "qwen3": Qwen3TransformerBlock,
    "gemma3_text": Gemma3TransformerBlock,
    "gpt2": GPT2Block,
}


def model_class(config: ModelConfig) -> type[DecoderLM]:
    try:
        return MODEL_CLASSES[config.model_type]
    except KeyError:
        raise ValueError(
            f"no model for model_type {config.model_type!r}; supported: {sorted(MODEL_CLASSES)}"
        ) from None


__all__ = [
    "BLOCK_CLASSES",
    "MODEL_CLASSES",
    "DecoderLM",
    "GPT2Block",
    "GPT2LMHeadModel",
    "Gemma3ForCausalLM",
    "Gemma3TransformerBlock",
    "LlamaForCausalLM",
    "LlamaTransformerBlock",
    "Qwen3ForCausalLM",
    "Qwen3TransformerBlock",
    "model_class",
]
