"""GGUF tensor names -> our parameter names, one table per architecture.

llama.cpp names tensors ``token_embd``, ``blk.{i}.attn_q``, ``output_norm``, ...; our
modules are named after the HF checkpoint (`infer.loader.weight_map`). Each table
below lists, per layer, GGUF suffix -> our module path; `gguf_weight_map` expands it
like the safetensors maps do.

What llama.cpp's converter changed, and what undoes it (`Fix`):

* ``llama``: the rows of Q and K were permuted from HF's rotate-half RoPE layout to
  interleaved pairs; `Fix.PERMUTE_Q` / `Fix.PERMUTE_K` restore HF's order. It is a
  permutation of whole output rows, so it applies to packed rows as well.
* ``gemma3``: 1 was added to every RMSNorm weight (llama.cpp multiplies by ``w``, HF
  by ``1 + w``); `Fix.UNIT_OFFSET` subtracts it.
* ``gpt2``: Conv1D weights were transposed to ``[out, in]``; `Fix.TRANSPOSE` brings
  float ones back to our GPT-2's ``[in, out]`` (packed ones become linear modules).
"""

from __future__ import annotations

from enum import Enum

import torch


class Fix(Enum):
    PERMUTE_Q = "permute_q"
    PERMUTE_K = "permute_k"
    UNIT_OFFSET = "unit_offset"
    TRANSPOSE = "transpose"


_GLOBAL = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}

_ATTN = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

_LLAMA = {"attn_norm": "input_layernorm", **_ATTN, "ffn_norm": "post_attention_layernorm", **_MLP}
_QWEN3 = {**_LLAMA, **_QK_NORM}
_GEMMA3 = {
    "attn_norm": "input_layernorm",
    **_ATTN,
    **_QK_NORM,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    **_MLP,
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GPT2 = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}

# Per architecture: per-layer modules, and whether they carry .bias tensors.
_LAYERS: dict[str, dict[str, str]] = {"llama": _LLAMA, "qwen3": _QWEN3, "gemma3": _GEMMA3, "gpt2": _GPT2}

# GPT-2 weights the converter transposed from HF's Conv1D [in, out].
_GPT2_CONV1D = ("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")

# Tensors llama.cpp writes that we know and reject with a reason.
UNSUPPORTED_TENSORS = {
    "rope_freqs.weight": "per-frequency RoPE factors (Llama 3.1+ rope scaling) are not supported",
}


def gguf_weight_map(arch: str, num_layers: int, *, biases: bool = False) -> dict[str, str]:
    """GGUF tensor name -> our parameter name for ``arch`` with ``num_layers`` blocks.

    ``biases`` adds a ``.bias`` entry for every projection (Qwen2-style attention
    biases on Llama-family files). GPT-2 always has biases, norms included.
    """
    try:
        layer = _LAYERS[arch]
    except KeyError:
        raise ValueError(
            f"no GGUF tensor map for architecture {arch!r}; supported: {sorted(_LAYERS)}"
        ) from None
    mapping = dict(_GLOBAL)
    if arch == "gpt2":
        mapping["position_embd.weight"] = "embed_positions.weight"
        mapping["output_norm.bias"] = "norm.bias"
    for i in range(num_layers):
        for suffix, module in layer.items():
            mapping[f"blk.{i}.{suffix}.weight"] = f"layers.{i}.{module}.weight"
            if arch == "gpt2" or (biases and not suffix.endswith("norm")):
                mapping[f"blk.{i}.{suffix}.bias"] = f"layers.{i}.{module}.bias"
    return mapping


def fix_for(arch: str, gguf_name: str) -> Fix | None:
    """What undoes llama.cpp's change to tensor ``gguf_name`` of ``arch``, if anything."""
    if arch == "llama":
        if gguf_name.endswith(".attn_q.weight") or gguf_name.endswith(".attn_q.bias"):
            return Fix.PERMUTE_Q
        if gguf_name.endswith(".attn_k.weight") or gguf_name.endswith(".attn_k.bias"):
            return Fix.PERMUTE_K
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        return Fix.UNIT_OFFSET
    if arch == "gpt2" and gguf_name.endswith(_GPT2_CONV1D):
        return Fix.TRANSPOSE
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
    # HF row index r = h*hd + j*half + i  ->  stored row h*hd + 2*i + j
    h = torch.arange(n_heads)[:, None, None]
    j = torch.arange(2)[None, :, None]
    i = torch.arange(half)[None, None, :]
    return (h * head_dim + 2 * i + j).reshape(-1)  # [n_rows], in HF order (h, j, i)
