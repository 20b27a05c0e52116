"""HF checkpoint tensor names -> our module names, per architecture (the original loader API).

Our modules are named after the checkpoint (``layers.3.self_attn.q_proj``), so for most
architectures a map is the identity less the ``model.`` prefix. The maps are derived
from the architecture records (`infer.models.arch.Architecture.to_hf`) and the model's
own parameter names, so they cannot drift from what the loader accepts.

``lm_head.weight`` is always listed. Real checkpoints are inconsistent about storing
it when embeddings are tied; reusing ``embed_tokens.weight`` is the model's decision, and
a stored head must then equal the embedding (`infer.assembly.build.ModelBuilder` refuses
one that differs, which transformers would keep untied).
"""

from __future__ import annotations

from infer.loader.config import ModelConfig
from infer.models import architecture


def _config(model_type: str, num_layers: int) -> ModelConfig:
    # Names do not depend on sizes: the smallest shapes the model classes accept.
    return ModelConfig(
        model_type=model_type,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=8,
        max_position_embeddings=8,
    )


def weight_map_for(config: ModelConfig) -> dict[str, str]:
    """HF tensor name -> our parameter name for every parameter of ``config``'s model."""
    from infer.assembly.build import build_empty

    arch = architecture(config.model_type, "config")
    names = [name for name, _ in build_empty(config).named_parameters(remove_duplicate=False)]
    if "lm_head.weight" not in names:
        names.append("lm_head.weight")
    return {arch.to_hf(name): name for name in names}


def llama_weight_map(num_layers: int) -> dict[str, str]:
    """9 tensors per layer: q/k/v/o, gate/up/down, two norms."""
    return weight_map_for(_config("llama", num_layers))


def qwen3_weight_map(num_layers: int) -> dict[str, str]:
    """11 tensors per layer: Llama's 9 plus the per-head q_norm / k_norm."""
    return weight_map_for(_config("qwen3", num_layers))


def gemma3_weight_map(num_layers: int) -> dict[str, str]:
    """13 tensors per layer: q/k/v/o, q_norm/k_norm, gate/up/down, four sandwich norms."""
    return weight_map_for(_config("gemma3_text", num_layers))


def get_weight_map(config: ModelConfig) -> dict[str, str]:
    """The HF -> internal name map for ``config.model_type`` at ``config.num_hidden_layers``."""
    return weight_map_for(config)


__all__ = ["gemma3_weight_map", "get_weight_map", "llama_weight_map", "qwen3_weight_map", "weight_map_for"]
