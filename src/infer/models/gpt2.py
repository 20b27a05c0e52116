"""GPT-2: learned absolute positions, LayerNorm with bias, fused QKV, tanh-GELU MLP, tied head.

Per-layer modules keep the HF checkpoint's names (``ln_1``, ``attn.c_attn``,
``attn.c_proj``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``), as ``nn.Linear`` modules:
HF stores their weights in its `Conv1D` layout ``[in, out]``, which the loader
transposes once (`Fix.TRANSPOSE`); llama.cpp's converter already wrote them
``[out, in]``. No RoPE: `embed_rows` adds the position embedding of each token's position
(``positions [B, T]`` from the cache or the left padding).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from infer.loader.config import FULL_ATTENTION, ModelConfig
from infer.models.arch import GGUF_NONLAYER, TP_ROLES, Architecture, Fix, GGUFKeys, GGUFRules
from infer.models.attend import attend_any
from infer.models.base import DecoderLM
from infer.models.common import KVStore, activation
from infer.models.projections import Linear


class GPT2Attention(nn.Module):
    deterministic: bool = False  # `infer.models.projections.set_deterministic`
    output_projection = "c_proj"  # the module whose input is the heads' outputs [B, T, H * hd]

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads  # a tensor-parallel shard's heads
        self.head_dim = config.computed_head_dim
        self.scale = self.head_dim**-0.5
        width = self.num_heads * self.head_dim  # hidden_size, unless sharded
        self.c_attn = Linear(config.hidden_size, 3 * width)
        self.c_proj = Linear(width, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache: KVStore | None) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x [B, H, T, hd]
        key_limit = None
        if cache is not None:
            k, v = cache.update(k, v)  # [B, H, S, hd]
            key_limit = cache.key_limit
        out = attend_any(q, k, v, mask, self.scale, None, key_limit, self.deterministic)  # [B, H, T, hd]
        y: torch.Tensor = self.c_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
        return y


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.hidden_size, config.intermediate_size)
        self.c_proj = Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.c_proj(self.act(self.c_fc(x)))
        return y


class GPT2Block(nn.Module):
    """``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``; ``cos``/``sin`` are unused (no RoPE)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps  # the config's one norm epsilon (GPT-2's layer_norm_epsilon)
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        mask: torch.Tensor | None,
        cache: KVStore | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask, cache)
        y: torch.Tensor = x + self.mlp(self.ln_2(x))
        return y


class GPT2LMHeadModel(DecoderLM):
    block_class = GPT2Block

    def __init__(self, config: ModelConfig) -> None:
        if config.layer_types is not None and set(config.layer_types) != {FULL_ATTENTION}:
            found = sorted(set(config.layer_types))
            raise ValueError(f"GPT-2 has only full-attention layers; config.layer_types has {found}")
        layers = [GPT2Block(config) for _ in range(config.num_hidden_layers)]
        super().__init__(config, layers, nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps))
        n, d = config.max_position_embeddings, config.hidden_size
        self.embed_positions = nn.Embedding(n, d, _weight=torch.empty(n, d))  # skip normal_() (see base.py)
        self.rotary = nn.ModuleDict()  # absolute positions: no RoPE tables to compute per step

    def embed_rows(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # positions < max_position_embeddings: checked on the host before the step (DecoderLM.forward_hidden)
        x: torch.Tensor = rows + self.embed_positions(positions)  # [B, T, D]
        return x


# --------------------------------------------------------------------------- checkpoints

_HF_GLOBALS = {"wte.": "embed_tokens.", "wpe.": "embed_positions.", "ln_f.": "norm."}
_HF_LAYER = re.compile(r"h\.(\d+)\.")


def from_hf(name: str) -> str | None:
    """``transformer.h.3.attn.c_attn.weight`` (or the bare ``h.3...`` of GPT2Model checkpoints) -> ours."""
    if name.startswith("lm_head."):
        return name
    name = name.removeprefix("transformer.")
    for hf, ours in _HF_GLOBALS.items():
        if name.startswith(hf):
            return ours + name[len(hf) :]
    m = _HF_LAYER.match(name)
    return f"layers.{m.group(1)}.{name[m.end() :]}" if m else None


def to_hf(name: str) -> str:
    if name.startswith("lm_head."):
        return name
    for hf, ours in _HF_GLOBALS.items():
        if name.startswith(ours):
            return "transformer." + hf + name[len(ours) :]
    return "transformer." + re.sub(r"^layers\.(\d+)\.", r"h.\1.", name)


def normalize(raw: dict[str, Any], source: str) -> None:
    """transformers' GPT2Config defaults, and the attention variants this model does not implement."""
    if isinstance(raw.get("hidden_size"), int):
        raw.setdefault("intermediate_size", 4 * raw["hidden_size"])
    raw.setdefault("attention_bias", True)
    raw.setdefault("mlp_bias", True)
    raw.setdefault("tie_word_embeddings", True)
    raw.setdefault("rms_norm_eps", 1e-5)
    raw.setdefault("hidden_act", "gelu_new")
    raw.pop("head_dim", None)
    if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("scale_attn_weights") is False:
        raise ValueError(
            f"{source}: unsupported GPT-2 attention scaling: scale_attn_weights="
            f"{raw.get('scale_attn_weights')}, scale_attn_by_inverse_layer_idx="
            f"{raw.get('scale_attn_by_inverse_layer_idx')} (supported: true, false)"
        )


def gguf_metadata(meta: GGUFKeys) -> dict[str, Any]:
    return {
        "rms_norm_eps": meta.opt_float("attention.layer_norm_epsilon", 1e-5),
        "hidden_act": "gelu_new",
        "attention_bias": True,
        "mlp_bias": True,
        "head_dim": None,
        "rope_theta": None,
        "rope_scaling": None,
    }


def write_gguf_metadata(w: Any, arch: str, c: ModelConfig) -> None:
    w.add_float32(f"{arch}.attention.layer_norm_epsilon", c.rms_norm_eps)


_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")

ARCH = Architecture(
    model_type="gpt2",
    model_class=GPT2LMHeadModel,
    renames={
        "n_embd": "hidden_size",
        "n_layer": "num_hidden_layers",
        "n_head": "num_attention_heads",
        "n_positions": "max_position_embeddings",
        "n_inner": "intermediate_size",
        "layer_norm_epsilon": "rms_norm_eps",
        "activation_function": "hidden_act",
    },
    normalize=normalize,
    from_hf=from_hf,
    to_hf=to_hf,
    hf_ignore=(re.compile(r"(?:^|\.)h\.\d+\.attn\.(?:masked_)?bias$"),),  # the causal-mask buffers
    hf_fixes={f"{linear}.weight": Fix.TRANSPOSE for linear in _LINEARS},
    tp_roles={**TP_ROLES, "attn.c_proj": ("row", ("q",)), "mlp.c_proj": ("row", ("mlp",))},
    gguf=GGUFRules(
        architectures=("gpt2", "gpt"),
        layer={
            "attn_norm": "ln_1",
            "attn_qkv": "attn.c_attn",
            "attn_output": "attn.c_proj",
            "ffn_norm": "ln_2",
            "ffn_up": "mlp.c_fc",
            "ffn_down": "mlp.c_proj",
        },
        nonlayer={**GGUF_NONLAYER, "position_embd": "embed_positions"},
        metadata=gguf_metadata,
        write_metadata=write_gguf_metadata,
    ),
)
