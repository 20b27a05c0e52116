"""HF checkpoint tensor names -> our module names, per architecture.

Our modules are named after the checkpoint (``layers.3.self_attn.q_proj``), so each
map is the identity less the ``model.`` prefix; a map exists so that every tensor is
accounted for: the model builder loads exactly the names a map lists.

``lm_head.weight`` is always listed. Real checkpoints are inconsistent about storing
it when embeddings are tied; reusing ``embed_tokens.weight`` is the model's decision.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from infer.loader.config import ModelConfig

_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_QK_NORM = ("self_attn.q_norm", "self_attn.k_norm")
_PRE_NORMS = ("input_layernorm", "post_attention_layernorm")
_SANDWICH_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def _build(num_layers: int, per_layer_modules: tuple[str, ...]) -> dict[str, str]:
    mapping = {"model.embed_tokens.weight": "embed_tokens.weight"}
    for i in range(num_layers):
        for module in per_layer_modules:
            mapping[f"model.layers.{i}.{module}.weight"] = f"layers.{i}.{module}.weight"
    mapping["model.norm.weight"] = "norm.weight"
    mapping["lm_head.weight"] = "lm_head.weight"
    return mapping


def llama_weight_map(num_layers: int) -> dict[str, str]:
    """9 tensors per layer: q/k/v/o, gate/up/down, two norms."""
    return _build(num_layers, _ATTN + _MLP + _PRE_NORMS)


def qwen3_weight_map(num_layers: int) -> dict[str, str]:
    """11 tensors per layer: Llama's 9 plus the per-head q_norm / k_norm."""
    return _build(num_layers, _ATTN + _QK_NORM + _MLP + _PRE_NORMS)


def gemma3_weight_map(num_layers: int) -> dict[str, str]:
    """13 tensors per layer: q/k/v/o, q_norm/k_norm, gate/up/down, four sandwich norms."""
    return _build(num_layers, _ATTN + _QK_NORM + _MLP + _SANDWICH_NORMS)


def gpt2_weight_map(num_layers: int) -> dict[str, str]:
    """GPT-2 as transformers names it, to our names (`infer.models.gpt2`).

    Both spellings are listed: ``transformer.h.{i}...`` (GPT2LMHeadModel) and the bare
    ``h.{i}...`` of older checkpoints saved from GPT2Model. 12 tensors per layer: ln_1
    and ln_2 (weight, bias), the fused c_attn, c_proj, and the MLP's c_fc and c_proj
    (weight, bias each). Conv1D weights are stored [in, out] and our GPT-2 keeps that
    layout, so no tensor is transformed.
    """
    inner = {"wte.weight": "embed_tokens.weight", "wpe.weight": "embed_positions.weight"}
    per_layer = ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
    for i in range(num_layers):
        for module in per_layer:
            for kind in ("weight", "bias"):
                inner[f"h.{i}.{module}.{kind}"] = f"layers.{i}.{module}.{kind}"
    inner["ln_f.weight"] = "norm.weight"
    inner["ln_f.bias"] = "norm.bias"
    mapping = {f"transformer.{k}": v for k, v in inner.items()}
    mapping.update(inner)
    mapping["lm_head.weight"] = "lm_head.weight"
    return mapping


_MAPS: dict[str, Callable[[int], dict[str, str]]] = {
    "llama": llama_weight_map,
    "qwen3": qwen3_weight_map,
    "gemma3_text": gemma3_weight_map,
    "gpt2": gpt2_weight_map,
}


def get_weight_map(config: ModelConfig) -> dict[str, str]:
    """The HF -> internal name map for ``config.model_type`` at ``config.num_hidden_layers``."""
    try:
        build = _MAPS[config.model_type]
    except KeyError:
        raise ValueError(
            f"no weight map for model_type {config.model_type!r}; supported: {sorted(_MAPS)}"
        ) from None
    return build(config.num_hidden_layers)


# Multimodal Gemma 3 checkpoints (4B and up) nest the language model: hub files name it
# ``language_model.model.*``, recent transformers ``model.language_model.*``. The vision
# tower and projector are not part of a text-only model and are left out by name.
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.", "language_model.": ""}
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


# Buffers that older checkpoints saved beside the weights; they are recomputed, never loaded.
_BUFFERS = re.compile(
    r"(?:^|\.)(?:self_attn\.rotary_emb\.inv_freq"  # Llama-family RoPE frequencies
    r"|h\.\d+\.attn\.(?:masked_)?bias)$"  # GPT-2's causal-mask buffers
)


def map_checkpoint_names(config: ModelConfig, names: list[str], source: str) -> dict[str, str]:
    """Checkpoint tensor name -> internal name for every tensor the model uses.

    Unknown names raise `ValueError` naming them. Left out by name: the vision tensors
    of a multimodal checkpoint (only when the language model's own tensors are nested
    under a multimodal prefix) and the precomputed buffers older checkpoints stored
    (RoPE ``inv_freq``, GPT-2's ``attn.bias`` / ``attn.masked_bias`` masks).
    """
    weight_map = get_weight_map(config)
    nested = any(n.startswith(p) for n in names for p in _TEXT_PREFIXES if p != "language_model.")
    mapping: dict[str, str] = {}
    unknown: list[str] = []
    for name in names:
        hf = name
        if _BUFFERS.search(name):
            continue
        if nested:
            if name.startswith(_VISION_PREFIXES):
                continue
            for prefix, replacement in _TEXT_PREFIXES.items():
                if name.startswith(prefix):
                    hf = replacement + name[len(prefix) :]
                    break
        if hf in weight_map:
            mapping[name] = weight_map[hf]
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(
            f"{source}: unexpected tensor(s) for model_type {config.model_type!r}: {sorted(unknown)}"
        )
    return mapping
