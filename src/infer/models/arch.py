"""`Architecture`: everything the loaders need to know about one architecture, as data.

Each model file (``models/<arch>.py``) declares one record beside its classes: how its
``config.json`` differs from the common fields, how checkpoint tensor names map to the
model's module names (safetensors and GGUF), what llama.cpp's converter changed in the
stored tensors and how GGUF metadata becomes a config. `infer.models.ARCHITECTURES`
lists the records; the config reader, the loaders, the GGUF writer and the original
weight maps are all derived from them. Adding an architecture is its file plus one
line in that registry (see docs/architecture.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from pathlib import Path

    from infer.loader.config import ModelConfig
    from infer.models.base import DecoderLM


class Fix(Enum):
    """A change a converter made to a stored tensor, undone when it is placed."""

    PERMUTE_Q = "permute_q"  # llama.cpp reordered each query head's rows to interleaved RoPE pairs
    PERMUTE_K = "permute_k"  # ... and each key head's
    UNIT_OFFSET = "unit_offset"  # the norm weight was stored as 1 + w (llama.cpp's Gemma)
    TRANSPOSE = "transpose"  # the matrix is stored [in, out] (GPT-2's Conv1D)


def fix_for(rules: Mapping[str, Fix], name: str) -> Fix | None:
    """The fix of parameter ``name`` (our name): the rule keyed by ``name`` or by a dotted suffix of it."""
    for suffix, fix in rules.items():
        if name == suffix or name.endswith("." + suffix):
            return fix
    return None


def unpermute_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation for ``n_heads`` heads of ``n_rows // n_heads`` rows.

    The converter reordered each head's rows from ``[first half | second half]`` (HF
    rotate-half) to interleaved pairs ``(0, half), (1, half+1), ...``. Stored row
    ``h*hd + 2*i + j`` is HF row ``h*hd + j*half + i``; this returns, for each HF
    row, the stored row to take.
    """
    head_dim = n_rows // n_heads
    half = head_dim // 2
    h = torch.arange(n_heads)[:, None, None]
    j = torch.arange(2)[None, :, None]
    i = torch.arange(half)[None, None, :]
    return (h * head_dim + 2 * i + j).reshape(-1)  # [n_rows], in HF order (h, j, i)


# Tensor parallelism (Megatron-style): how each linear module splits across ranks, by the
# last component of its path. "column": output rows split (no communication after);
# "row": input columns split (partial sums all-reduced after). The segments say which
# sizes the rows / columns are made of, for fused modules: "q" = heads x head_dim,
# "kv" = kv heads x head_dim, "mlp" = intermediate size.
TP_ROLES: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "q_proj": ("column", ("q",)),
    "k_proj": ("column", ("kv",)),
    "v_proj": ("column", ("kv",)),
    "qkv_proj": ("column", ("q", "kv", "kv")),  # Phi-3
    "c_attn": ("column", ("q", "kv", "kv")),  # GPT-2
    "o_proj": ("row", ("q",)),
    "gate_proj": ("column", ("mlp",)),
    "up_proj": ("column", ("mlp",)),
    "gate_up_proj": ("column", ("mlp", "mlp")),  # Phi-3
    "c_fc": ("column", ("mlp",)),  # GPT-2
    "down_proj": ("row", ("mlp",)),
}

# Buffers older checkpoints saved beside the weights; they are recomputed, never loaded.
ROPE_BUFFERS = re.compile(r"(?:^|\.)rotary_emb\.inv_freq$")


def hf_model_prefix(name: str) -> str | None:
    """Checkpoint name -> our parameter name for the common HF layout: ``model.`` + our name."""
    if name.startswith("lm_head."):
        return name
    if name.startswith("model."):
        return name[len("model.") :]
    return None


def hf_name(name: str) -> str:
    """Inverse of `hf_model_prefix`: our parameter name -> its name in an HF checkpoint."""
    return name if name.startswith("lm_head.") else "model." + name


# GGUF tensors outside the blocks, by our module path.
GGUF_NONLAYER: Mapping[str, str] = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
}


class GGUFKeys(Protocol):
    """What an architecture's GGUF reader asks of a file (`infer.gguf.metadata.GGUFMetadata` has it):
    its ``{arch}.*`` keys, checked, and its tensor table."""

    @property
    def path(self) -> Path: ...
    def get(self, key: str) -> Any: ...
    def opt_int(self, key: str, default: int | None = None) -> int | None: ...
    def opt_float(self, key: str, default: float | None = None) -> float | None: ...
    def opt_str(self, key: str) -> str | None: ...
    def has_tensor(self, name: str) -> bool: ...
    def float_vector(self, name: str) -> list[float]: ...
    def int(self, key: str) -> int: ...


@dataclass(frozen=True)
class GGUFRules:
    """How an architecture is stored in GGUF (llama.cpp's names, metadata and converter changes).

    ``layer`` maps a tensor name inside a block (``attn_q``) to our module path inside a
    layer (``self_attn.q_proj``); ``nonlayer`` does the same outside the blocks. ``fixes``
    maps our parameter-name suffixes to what the converter changed. ``metadata`` turns the
    file's ``{arch}.*`` metadata into config fields beyond the common ones, and
    ``write_metadata`` is its inverse (used by `infer.gguf.writer` for test files).
    ``config_tensors`` are tensors that describe the config rather than hold weights
    (Llama 3.1's ``rope_freqs``): read by ``metadata``, never placed.
    """

    architectures: tuple[str, ...]
    layer: Mapping[str, str]
    nonlayer: Mapping[str, str] = field(default_factory=lambda: dict(GGUF_NONLAYER))
    fixes: Mapping[str, Fix] = field(default_factory=dict)
    metadata: Callable[[GGUFKeys], dict[str, Any]] | None = None
    write_metadata: Callable[[Any, str, ModelConfig], None] | None = None
    config_tensors: tuple[str, ...] = ()


@dataclass(frozen=True)
class Architecture:
    """One architecture: its model class and the rules that load checkpoints into it.

    * ``renames``: hub config field -> `ModelConfig` field (GPT-2's ``n_embd``).
    * ``defaults``: transformers' defaults for fields a hub config may leave out.
    * ``nested_defaults``: defaults a multimodal wrapper's ``text_config`` leaves out.
    * ``reads``: the architecture-specific `ModelConfig` fields
      (`infer.loader.config.ARCH_FIELDS`) its transformers config reads; the reader drops
      the others, which transformers ignores for this model.
    * ``normalize(raw, source)``: derive fields from others (in place, before defaults).
    * ``from_hf(name)``: safetensors tensor name -> our parameter name, or None when the
      name is not one of this architecture's; ``to_hf`` is its inverse.
    * ``hf_ignore``: stored tensors that are buffers, recomputed rather than loaded.
    * ``hf_fixes``: parameters stored differently in HF checkpoints.
    * ``gguf``: the GGUF rules, or None when llama.cpp has no converter for it.
    * ``gguf_as``: the architecture llama.cpp converts this one as (Mistral: ``"llama"``);
      such files load as that architecture.
    * ``tp_roles``: how linear modules split for tensor parallelism (`TP_ROLES`, by the
      module's last name; a full path takes precedence, as GPT-2's two ``c_proj``).
    """

    model_type: str
    model_class: Callable[[ModelConfig], DecoderLM]
    renames: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    nested_defaults: Mapping[str, Any] = field(default_factory=dict)
    reads: tuple[str, ...] = ()
    normalize: Callable[[dict[str, Any], str], None] | None = None
    from_hf: Callable[[str], str | None] = hf_model_prefix
    to_hf: Callable[[str], str] = hf_name
    hf_ignore: tuple[re.Pattern[str], ...] = (ROPE_BUFFERS,)
    hf_fixes: Mapping[str, Fix] = field(default_factory=dict)
    gguf: GGUFRules | None = None
    gguf_as: str | None = None
    tp_roles: Mapping[str, tuple[str, tuple[str, ...]]] = field(default_factory=lambda: dict(TP_ROLES))


def sliding_everywhere(raw: dict[str, Any], source: str) -> None:
    """Mistral / Phi-3: a set ``sliding_window`` applies to every layer, unless ``layer_types`` say
    otherwise (Mistral's; Phi3Config ignores them, so the reader has dropped Phi-3's)."""
    if raw.get("sliding_window") is not None and raw.get("layer_types") is None:
        n = raw.get("num_hidden_layers")
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            raw["layer_types"] = ["sliding_attention"] * n


# Qwen2Config / Qwen3Config's default for ``max_window_layers``.
MAX_WINDOW_LAYERS = 28


def sliding_from_max_window_layers(raw: dict[str, Any], source: str) -> None:
    """Qwen 2 / 3: ``use_sliding_window`` and ``max_window_layers`` say which layers use the window.

    As transformers' Qwen2Config / Qwen3Config: without ``use_sliding_window`` there is no
    window at all (``sliding_window`` is dropped, whatever ``layer_types`` says); with it and
    no ``layer_types``, the layers from ``max_window_layers`` on are sliding.
    """
    if not raw.get("use_sliding_window"):
        raw.pop("sliding_window", None)
    if raw.get("layer_types") is not None or raw.get("sliding_window") is None:
        return
    n, first = raw.get("num_hidden_layers"), raw.get("max_window_layers", MAX_WINDOW_LAYERS)
    if isinstance(first, bool) or not isinstance(first, int):
        raise ValueError(f"{source}: 'max_window_layers' = {first!r}, expected an integer")
    if isinstance(n, int) and not isinstance(n, bool):
        raw["layer_types"] = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]


__all__ = [
    "GGUF_NONLAYER",
    "MAX_WINDOW_LAYERS",
    "ROPE_BUFFERS",
    "TP_ROLES",
    "Architecture",
    "Fix",
    "GGUFKeys",
    "GGUFRules",
    "fix_for",
    "hf_model_prefix",
    "hf_name",
    "sliding_everywhere",
    "sliding_from_max_window_layers",
    "unpermute_rows",
]
