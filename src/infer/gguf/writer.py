"""Write a transformers model (and its fast tokenizer) as GGUF, the way llama.cpp's converter does.

Used to build small GGUF files for tests: the reverse of everything `infer.gguf.loader`
undoes is applied here (llama Q/K row permutation, Gemma's +1 on norm weights,
GPT-2's Conv1D transposed to ``[out, in]`` and its head written as ``output.weight``),
and hyperparameters go under llama.cpp's key names. Facts GGUF cannot express (a
Gemma query scale other than ``head_dim``, logit soft-capping, llama3 RoPE scaling)
are refused rather than written wrongly.

Weight matrices are stored as ``qtype`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
MXFP4, via `gguf.quants.quantize`); norms, biases and position embeddings stay F32,
as llama.cpp's quantizer leaves them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType, TokenType
from gguf.quants import quantize

from infer.gguf.config import GEMMA3_LOCAL_ROPE_BASE, GEMMA3_SLIDING_PATTERN
from infer.gguf.names import Fix, fix_for, gguf_weight_map, unpermute_rows
from infer.loader.config import ModelConfig, config_from_dict
from infer.loader.weight_map import get_weight_map

_ARCH = {"llama": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3", "gpt2": "gpt2"}
WRITABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")


def _metadata(w: GGUFWriter, arch: str, c: ModelConfig) -> None:
    a = arch
    w.add_uint32(f"{a}.context_length", c.max_position_embeddings)
    w.add_uint32(f"{a}.embedding_length", c.hidden_size)
    w.add_uint32(f"{a}.block_count", c.num_hidden_layers)
    w.add_uint32(f"{a}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{a}.attention.head_count", c.num_attention_heads)
    if arch == "gpt2":
        w.add_float32(f"{a}.attention.layer_norm_epsilon", c.rms_norm_eps)
        return
    w.add_uint32(f"{a}.attention.head_count_kv", c.num_key_value_heads)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{a}.rope.freq_base", c.rope_theta)
    w.add_uint32(f"{a}.vocab_size", c.vocab_size)
    hd = c.computed_head_dim
    if arch == "llama":
        w.add_uint32(f"{a}.rope.dimension_count", hd)
    if arch != "llama" or hd != c.hidden_size // c.num_attention_heads:
        w.add_uint32(f"{a}.attention.key_length", hd)
        w.add_uint32(f"{a}.attention.value_length", hd)
    if c.rope_scaling is not None:
        if c.rope_scaling.get("rope_type") != "linear":
            raise ValueError(f"GGUF cannot express RoPE scaling {c.rope_scaling} (only linear)")
        w.add_string(f"{a}.rope.scaling.type", "linear")
        w.add_float32(f"{a}.rope.scaling.factor", float(c.rope_scaling["factor"]))
    if arch == "gemma3":
        if c.query_pre_attn_scalar not in (None, float(hd)):
            raise ValueError(f"GGUF gemma3 fixes the query scale to head_dim={hd}: {c.query_pre_attn_scalar}")
        if c.final_logit_softcapping is not None or c.attn_logit_softcapping is not None:
            raise ValueError("GGUF gemma3 has no logit soft-capping")
        if c.rope_local_base_freq not in (None, GEMMA3_LOCAL_ROPE_BASE):
            raise ValueError(f"GGUF gemma3 fixes the sliding RoPE base to 10000: {c.rope_local_base_freq}")
        if c.sliding_window is not None:
            w.add_uint32(f"{a}.attention.sliding_window", c.sliding_window)
            types = [c.layer_type(i) for i in range(c.num_hidden_layers)]
            default = [(i + 1) % GEMMA3_SLIDING_PATTERN != 0 for i in range(c.num_hidden_layers)]
            sliding = [t == "sliding_attention" for t in types]
            if sliding != default:
                w.add_array(f"{a}.attention.sliding_window_pattern", sliding)


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


def _stored(arch: str, config: ModelConfig, gguf_name: str, value: torch.Tensor) -> torch.Tensor:
    """Apply llama.cpp's converter change to one tensor (the inverse of the loader's fix)."""
    fix = fix_for(arch, gguf_name)
    if fix in (Fix.PERMUTE_Q, Fix.PERMUTE_K):
        heads = config.num_attention_heads if fix is Fix.PERMUTE_Q else config.num_key_value_heads
        stored = torch.empty_like(value)
        stored[unpermute_rows(value.shape[0], heads)] = value  # inverse of the loader's gather
        return stored
    if fix is Fix.UNIT_OFFSET:
        return value + 1.0
    if fix is Fix.TRANSPOSE:
        return value.t()
    return value


def _encode(name: str, values: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, Any]:
    keep_f32 = values.ndim == 1 or name.startswith("position_embd")
    if keep_f32 or qtype == GGMLQuantizationType.F32:
        return values.astype(np.float32), None
    if qtype == GGMLQuantizationType.F16:
        return values.astype(np.float16), None
    return quantize(values.astype(np.float32), qtype), qtype


def write_gguf(path: str | Path, model: Any, tokenizer: Any | None = None, *, qtype: str = "F32") -> Path:
    """Write the transformers causal LM ``model`` (llama, qwen3, gemma3_text, gpt2) to ``path`` as GGUF."""
    if qtype not in WRITABLE_TYPES:
        raise ValueError(f"cannot write weights as {qtype!r}; choose one of {WRITABLE_TYPES}")
    qt = GGMLQuantizationType[qtype]
    config = config_from_dict(model.config.to_dict(), source="model.config")
    arch = _ARCH[config.model_type]
    to_internal = get_weight_map(config)
    to_gguf = {v: k for k, v in gguf_weight_map(arch, config.num_hidden_layers, biases=True).items()}
    path = Path(path)
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    _metadata(w, arch, config)
    if tokenizer is not None:
        _tokenizer_metadata(w, tokenizer, config.vocab_size)
    state = model.state_dict()
    written: set[str] = set()
    for hf_name, tensor in state.items():
        internal = to_internal.get(hf_name)
        if internal is None:
            continue  # buffers such as GPT-2's causal mask
        if internal == "lm_head.weight" and config.tie_word_embeddings and arch != "gpt2":
            continue  # tied: llama.cpp writes no output.weight
        gguf_name = to_gguf[internal]
        if gguf_name in written:
            continue
        values = _stored(arch, config, gguf_name, tensor.detach().float().cpu()).contiguous().numpy()
        data, raw_type = _encode(gguf_name, values, qt)
        w.add_tensor(gguf_name, data, raw_dtype=raw_type)
        written.add(gguf_name)
    if arch == "gpt2" and "output.weight" not in written:
        # The converter writes GPT-2's tied head as its own tensor.
        data, raw_type = _encode("output.weight", state["transformer.wte.weight"].float().numpy(), qt)
        w.add_tensor("output.weight", data, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
