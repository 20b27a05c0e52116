"""Write a transformers model (and its fast tokenizer) as GGUF, the way llama.cpp's converter does.

For tests. Names, metadata keys and the converter's changes come from the architecture records
(`infer.models.arch.GGUFRules`), applied in reverse of what the loader undoes; facts GGUF cannot
express are refused. Matrices are stored as ``qtype`` (`gguf.quants.quantize`); norms, biases and
position embeddings stay F32, as llama.cpp's quantizer leaves them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType, TokenType
from gguf.quants import quantize

from infer.loader.config import ModelConfig, config_from_dict
from infer.models import architecture
from infer.models.arch import Architecture, Fix, GGUFRules, fix_for, unpermute_rows

WRITABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")


def _metadata(w: GGUFWriter, arch: str, c: ModelConfig, rules: GGUFRules) -> None:
    a = arch
    w.add_uint32(f"{a}.context_length", c.max_position_embeddings)
    w.add_uint32(f"{a}.embedding_length", c.hidden_size)
    w.add_uint32(f"{a}.block_count", c.num_hidden_layers)
    w.add_uint32(f"{a}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{a}.attention.head_count", c.num_attention_heads)
    if arch == "gpt2":
        assert rules.write_metadata is not None
        rules.write_metadata(w, a, c)
        return
    w.add_uint32(f"{a}.attention.head_count_kv", c.num_key_value_heads)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{a}.rope.freq_base", c.rope_theta)
    w.add_uint32(f"{a}.vocab_size", c.vocab_size)
    hd = c.computed_head_dim
    if arch != "llama" or hd != c.hidden_size // c.num_attention_heads:
        w.add_uint32(f"{a}.attention.key_length", hd)
        w.add_uint32(f"{a}.attention.value_length", hd)
    kind = c.rope_scaling.get("rope_type") if c.rope_scaling is not None else None
    if kind == "linear":
        assert c.rope_scaling is not None
        w.add_string(f"{a}.rope.scaling.type", "linear")
        w.add_float32(f"{a}.rope.scaling.factor", float(c.rope_scaling["factor"]))
    elif kind is not None and not (kind == "llama3" and "rope_freqs.weight" in rules.config_tensors):
        raise ValueError(f"GGUF {arch} cannot express RoPE scaling {c.rope_scaling}")
    if rules.write_metadata is not None:
        rules.write_metadata(w, a, c)


def llama3_rope_factors(c: ModelConfig) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter computes from a llama3 ``rope_scaling``."""
    assert c.rope_scaling is not None
    dim = c.rotary_dim
    freqs = 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = float(c.rope_scaling["factor"])
    low, high = float(c.rope_scaling["low_freq_factor"]), float(c.rope_scaling["high_freq_factor"])
    old = float(c.rope_scaling["original_max_position_embeddings"])
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _tokenizer_metadata(w: GGUFWriter, tok: Any, vocab_size: int) -> None:
    """A byte-level BPE fast tokenizer as ``tokenizer.ggml.*`` (llama.cpp's "gpt2" tokenizer model).

    Like the converter, the token list is padded to the model's vocabulary with unused ``[PAD{i}]``.
    """
    state = json.loads(tok.backend_tokenizer.to_str())
    model = state["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only byte-level BPE tokenizers can be written, not {model.get('type')}")
    vocab: dict[str, int] = dict(model["vocab"])
    special: set[int] = set()
    for added in state.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    n = max(max(vocab.values()) + 1, vocab_size)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [TokenType.UNUSED] * n
    for text, idx in vocab.items():
        tokens[idx] = text
        types[idx] = TokenType.CONTROL if idx in special else TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    if merges:
        w.add_token_merges(merges)
    else:  # GGUF has no empty arrays; scores let a reader derive the (empty) merge list
        w.add_token_scores([0.0] * n)
    for name, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("pad", w.add_pad_token_id)):
        token_id = getattr(tok, f"{name}_token_id", None)
        if token_id is not None:
            add(int(token_id))
    bos = getattr(tok, "bos_token_id", None)
    w.add_add_bos_token(bos is not None and tok.encode("a")[:1] == [bos])  # does encode() prepend BOS?
    if getattr(tok, "chat_template", None):
        w.add_chat_template(tok.chat_template)


def _stored(
    rules: GGUFRules, hf_fix: Fix | None, config: ModelConfig, name: str, value: torch.Tensor
) -> torch.Tensor:
    """HF's tensor as llama.cpp stores it: HF's own layout undone, then the converter's change applied."""
    if hf_fix is Fix.TRANSPOSE:
        value = value.t()
    fix = fix_for(rules.fixes, name)
    if fix in (Fix.PERMUTE_Q, Fix.PERMUTE_K):
        heads = config.num_attention_heads if fix is Fix.PERMUTE_Q else config.num_key_value_heads
        stored = torch.empty_like(value)
        stored[unpermute_rows(value.shape[0], heads)] = value  # inverse of the loader's gather
        return stored
    if fix is Fix.UNIT_OFFSET:
        return value + 1.0
    return value


def _gguf_name(rules: GGUFRules, ours: str) -> str:
    path, _, kind = ours.rpartition(".")
    parts = path.split(".", 2)
    if parts[0] == "layers":
        suffix = {v: k for k, v in rules.layer.items()}[parts[2]]
        return f"blk.{parts[1]}.{suffix}.{kind}"
    return f"{ {v: k for k, v in rules.nonlayer.items()}[path] }.{kind}"


def _encode(name: str, values: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, Any]:
    keep_f32 = values.ndim == 1 or name.startswith("position_embd")
    if keep_f32 or qtype == GGMLQuantizationType.F32:
        return values.astype(np.float32), None
    if qtype == GGMLQuantizationType.F16:
        return values.astype(np.float16), None
    return quantize(values.astype(np.float32), qtype), qtype


def _rules(arch: Architecture) -> GGUFRules:
    target = architecture(arch.gguf_as, "model.config") if arch.gguf_as is not None else arch
    if target.gguf is None:
        raise ValueError(f"llama.cpp has no GGUF conversion for model_type {arch.model_type!r}")
    return target.gguf


def write_gguf(path: str | Path, model: Any, tokenizer: Any | None = None, *, qtype: str = "F32") -> Path:
    """Write the transformers causal LM ``model`` to ``path`` as GGUF (any architecture with GGUF rules)."""
    if qtype not in WRITABLE_TYPES:
        raise ValueError(f"cannot write weights as {qtype!r}; choose one of {WRITABLE_TYPES}")
    qt = GGMLQuantizationType[qtype]
    config = config_from_dict(model.config.to_dict(), source="model.config")
    arch = architecture(config.model_type, "model.config")
    rules = _rules(arch)
    gguf_arch = rules.architectures[0]
    path = Path(path)
    w = GGUFWriter(str(path), gguf_arch)
    w.add_name(f"tiny-{gguf_arch}")
    _metadata(w, gguf_arch, config, rules)
    if tokenizer is not None:
        _tokenizer_metadata(w, tokenizer, config.vocab_size)
    kind = config.rope_scaling.get("rope_type") if config.rope_scaling is not None else None
    if kind == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    state = model.state_dict()
    written: set[str] = set()
    for hf_name, tensor in state.items():
        if any(p.search(hf_name) for p in arch.hf_ignore):
            continue
        ours = arch.from_hf(hf_name)
        if ours is None:
            raise ValueError(f"cannot name {hf_name!r} for GGUF")
        if ours == "lm_head.weight" and config.tie_word_embeddings and gguf_arch != "gpt2":
            continue  # tied: llama.cpp writes no output.weight
        name = _gguf_name(rules, ours)
        if name in written:
            continue
        value = tensor.detach().float().cpu()
        values = _stored(rules, fix_for(arch.hf_fixes, ours), config, ours, value).contiguous().numpy()
        data, raw_type = _encode(name, values, qt)
        w.add_tensor(name, data, raw_dtype=raw_type)
        written.add(name)
    if gguf_arch == "gpt2" and "output.weight" not in written:
        # The converter writes GPT-2's tied head as its own tensor.
        data, raw_type = _encode("output.weight", state["transformer.wte.weight"].float().numpy(), qt)
        w.add_tensor("output.weight", data, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
