"""Gemma 3: sandwich norms, (1 + w) RMSNorm, GeGLU, QK-norm, scaled embeddings,
sliding-window layers with their own RoPE base."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from infer.loader.config import ARCH_FIELDS, FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from infer.models.arch import Architecture, Fix, GGUFKeys, GGUFRules
from infer.models.base import DecoderLM
from infer.models.common import RMSNorm, attention_from_config, mlp_from_config
from infer.models.llama import GGUF_ATTENTION, GGUF_MLP, LlamaTransformerBlock
from infer.models.qwen3 import GGUF_QK_NORM


class Gemma3TransformerBlock(LlamaTransformerBlock):
    """Post-sub-layer norms are applied before the residual add (sandwich norm):
    ``x + norm(attn(norm(x)))`` then ``x + norm(mlp(norm(x)))``.

    Which mask and RoPE table a layer gets is the model's decision
    (``config.layer_types[i]``: sliding-window layers use ``rope_local_base_freq``).
    """

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.self_attn = attention_from_config(config, qk_norm=True, norm_unit_offset=True)
        self.post_attention_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.mlp = mlp_from_config(config)
        self.post_feedforward_layernorm = RMSNorm(d, eps, unit_offset=True)

    def attention_out(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.post_attention_layernorm(h)
        return out

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.pre_feedforward_layernorm(x)
        return out

    def mlp_out(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.post_feedforward_layernorm(h)
        return out


class Gemma3ForCausalLM(DecoderLM):
    block_class = Gemma3TransformerBlock

    def __init__(self, config: ModelConfig) -> None:
        layers = [Gemma3TransformerBlock(config) for _ in range(config.num_hidden_layers)]
        super().__init__(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True))
        self.embed_scale = math.sqrt(config.hidden_size)


# --------------------------------------------------------------------------- checkpoints

# transformers' Gemma3TextConfig defaults, which a multimodal Gemma 3 config.json leaves out
# of its text_config.
NESTED_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
}

# Facts llama.cpp hard-codes for Gemma 3 instead of writing them to the file.
GGUF_SLIDING_PATTERN = 6  # every 6th layer is global
GGUF_LOCAL_ROPE_BASE = 10000.0
GGUF_27B_LAYERS = 62  # the 27B model scales queries by hidden / heads, not head_dim

_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "norm",
)


def normalize(raw: dict[str, Any], source: str) -> None:
    """Refuse ``use_bidirectional_attention`` (EmbeddingGemma): infer serves causal LMs.

    transformers then attends both ways (and halves the sliding window): a different model,
    which a causal KV cache cannot run, so it is rejected rather than run causally.
    """
    value = raw.get("use_bidirectional_attention", False)
    if value is not False:
        raise ValueError(
            f"{source}: 'use_bidirectional_attention' = {value!r}, expected false: bidirectional "
            "(encoder / embedding) Gemma 3 models are not supported; infer serves causal LMs"
        )


def gguf_metadata(meta: GGUFKeys) -> dict[str, Any]:
    hidden, heads = meta.int("embedding_length"), meta.int("attention.head_count")
    n_layers = meta.int("block_count")
    head_dim = meta.opt_int("attention.key_length") or hidden // heads
    window = meta.opt_int("attention.sliding_window")
    layer_types = None
    if window is not None:
        explicit = meta.get("attention.sliding_window_pattern")
        if explicit is not None and hasattr(explicit, "__len__") and len(explicit) == n_layers:
            layer_types = [SLIDING_ATTENTION if bool(s) else FULL_ATTENTION for s in explicit]
        else:
            period = explicit if isinstance(explicit, int) and explicit > 0 else GGUF_SLIDING_PATTERN
            layer_types = [
                FULL_ATTENTION if (i + 1) % period == 0 else SLIDING_ATTENTION for i in range(n_layers)
            ]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": window,
        "layer_types": layer_types,
        "rope_local_base_freq": GGUF_LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": float(hidden // heads if n_layers == GGUF_27B_LAYERS else head_dim),
    }


def write_gguf_metadata(w: Any, arch: str, c: ModelConfig) -> None:
    hd = c.computed_head_dim
    if c.query_pre_attn_scalar not in (None, float(hd)):
        raise ValueError(f"GGUF gemma3 fixes the query scale to head_dim={hd}: {c.query_pre_attn_scalar}")
    if c.final_logit_softcapping is not None or c.attn_logit_softcapping is not None:
        raise ValueError("GGUF gemma3 has no logit soft-capping")
    if c.rope_local_base_freq not in (None, GGUF_LOCAL_ROPE_BASE):
        raise ValueError(f"GGUF gemma3 fixes the sliding RoPE base to 10000: {c.rope_local_base_freq}")
    if c.sliding_window is not None:
        w.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
        default = [(i + 1) % GGUF_SLIDING_PATTERN != 0 for i in range(c.num_hidden_layers)]
        sliding = [c.layer_type(i) == SLIDING_ATTENTION for i in range(c.num_hidden_layers)]
        if sliding != default:
            w.add_array(f"{arch}.attention.sliding_window_pattern", sliding)


ARCH = Architecture(
    model_type="gemma3_text",
    model_class=Gemma3ForCausalLM,
    renames={"hidden_activation": "hidden_act"},
    reads=ARCH_FIELDS,  # Gemma3TextConfig reads every one of them
    normalize=normalize,
    # transformers' defaults for fields hub configs leave out (gemma-3-1b-it has no
    # tie_word_embeddings: Gemma3TextConfig defaults it to True).
    defaults={
        "tie_word_embeddings": True,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256.0,
        "rms_norm_eps": 1e-6,
    },
    nested_defaults=NESTED_DEFAULTS,
    gguf=GGUFRules(
        architectures=("gemma3",),
        layer={
            "attn_norm": "input_layernorm",
            **GGUF_ATTENTION,
            **GGUF_QK_NORM,
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            **GGUF_MLP,
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        # llama.cpp multiplies by w, HF by (1 + w): the converter added 1 to every norm weight.
        fixes={f"{norm}.weight": Fix.UNIT_OFFSET for norm in _NORMS},
        metadata=gguf_metadata,
        write_metadata=write_gguf_metadata,
    ),
)
