"""Qwen 2 / 2.5: Llama's block with biases on the Q, K and V projections (not on O)."""

from __future__ import annotations

from typing import Any

from infer.models.arch import Architecture, GGUFRules
from infer.models.llama import GGUF_LAYER, LlamaForCausalLM, LlamaTransformerBlock


class Qwen2TransformerBlock(LlamaTransformerBlock):
    qkv_bias = True


class Qwen2ForCausalLM(LlamaForCausalLM):
    block_class = Qwen2TransformerBlock


def normalize(raw: dict[str, Any], source: str) -> None:
    """Hub configs say ``use_sliding_window`` / ``max_window_layers`` instead of ``layer_types``.

    As transformers' Qwen2Config: with ``use_sliding_window`` the layers from
    ``max_window_layers`` on use the window; without it no layer does.
    """
    if raw.get("layer_types") is not None:
        return
    if not raw.get("use_sliding_window"):
        raw.pop("sliding_window", None)
        return
    n, first = raw.get("num_hidden_layers"), raw.get("max_window_layers", 28)
    if isinstance(n, int) and isinstance(first, int):
        raw["layer_types"] = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]


ARCH = Architecture(
    model_type="qwen2",
    model_class=Qwen2ForCausalLM,
    defaults={"rms_norm_eps": 1e-6},
    normalize=normalize,
    gguf=GGUFRules(architectures=("qwen2",), layer=GGUF_LAYER),
)
