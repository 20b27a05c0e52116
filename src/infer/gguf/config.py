"""GGUF metadata -> `ModelConfig`, for the ``llama``, ``qwen3``, ``gemma3`` and ``gpt2`` architectures.

llama.cpp writes hyperparameters as ``{arch}.key`` entries. A few facts are not in the
file and llama.cpp hard-codes them per architecture; we do the same, and say so:

* Gemma 3: every 6th layer is global (the others use a sliding window), the sliding
  layers' RoPE base is 10000, the query scale is ``head_dim`` (``hidden / heads`` for
  the 27B model, which has 62 layers), GeGLU with tanh-GELU, embeddings scaled by
  ``sqrt(hidden)``.
* GPT-2: tanh-GELU, LayerNorm with bias, biases on every projection.

Tied embeddings: a file with no ``output.weight`` ties the head to ``token_embd``
(as llama.cpp and transformers decide).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from infer.gguf.reader import GGUFFile
from infer.loader.config import ModelConfig, config_from_dict

# GGUF architecture -> our model_type
ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "gpt2": "gpt2",
}

GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62


def architecture_of(gguf: GGUFFile) -> str:
    """The file's ``general.architecture``, checked against the supported ones."""
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{gguf.path}: unsupported architecture {arch!r} (metadata 'general.architecture'); "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    return arch


class _Meta:
    """Typed access to ``{arch}.*`` metadata with errors that name the key."""

    def __init__(self, gguf: GGUFFile, arch: str) -> None:
        self.gguf = gguf
        self.arch = arch

    def _get(self, key: str) -> Any:
        return self.gguf.metadata.get(f"{self.arch}.{key}")

    def opt_int(self, key: str, default: int | None = None, *, required: bool = False) -> int | None:
        value = self._get(key)
        if value is None:
            if required:
                raise ValueError(f"{self.gguf.path}: missing metadata key '{self.arch}.{key}'")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"{self.gguf.path}: metadata '{self.arch}.{key}' = {value!r}, expected an integer"
            )
        if value <= 0:
            raise ValueError(f"{self.gguf.path}: metadata '{self.arch}.{key}' = {value}, expected > 0")
        return value

    def req(self, key: str) -> int:
        value = self.opt_int(key, required=True)
        assert value is not None
        return value

    def opt_float(self, key: str, default: float | None = None) -> float | None:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{self.gguf.path}: metadata '{self.arch}.{key}' = {value!r}, expected a number")
        return float(value)

    def opt_str(self, key: str) -> str | None:
        value = self._get(key)
        return value if isinstance(value, str) else None


def _rope_scaling(meta: _Meta) -> dict[str, Any] | None:
    kind = meta.opt_str("rope.scaling.type")
    if kind is None or kind == "none":
        return None
    factor = meta.opt_float("rope.scaling.factor")
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "factor": factor}
    raise ValueError(
        f"{meta.gguf.path}: unsupported RoPE scaling '{meta.arch}.rope.scaling.type' = {kind!r} "
        f"(factor {factor}); supported: none, linear"
    )


def _layer_types(meta: _Meta, n_layers: int) -> list[str] | None:
    """Gemma 3's sliding/global layer pattern: an explicit per-layer array if the file has one, else 5:1."""
    window = meta.opt_int("attention.sliding_window")
    if window is None:
        return None
    explicit = meta._get("attention.sliding_window_pattern")
    if explicit is not None and hasattr(explicit, "__len__") and len(explicit) == n_layers:
        return ["sliding_attention" if bool(s) else "full_attention" for s in explicit]
    period = explicit if isinstance(explicit, int) and explicit > 0 else GEMMA3_SLIDING_PATTERN
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]


def _special_ids(gguf: GGUFFile) -> dict[str, Any]:
    md = gguf.metadata
    out: dict[str, Any] = {}
    if isinstance(md.get("tokenizer.ggml.bos_token_id"), int):
        out["bos_token_id"] = md["tokenizer.ggml.bos_token_id"]
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = md.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value not in eos:
            eos.append(value)
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if isinstance(md.get("tokenizer.ggml.padding_token_id"), int):
        out["pad_token_id"] = md["tokenizer.ggml.padding_token_id"]
    return out


def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    """The `ModelConfig` a GGUF file's metadata describes (errors name the file and the key)."""
    arch = architecture_of(gguf)
    meta = _Meta(gguf, arch)
    hidden = meta.req("embedding_length")
    heads = meta.req("attention.head_count")
    n_layers = meta.req("block_count")
    embd = gguf.tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"{gguf.path}: missing required tensor 'token_embd.weight'")
    vocab = embd.shape[0]
    declared_vocab = meta.opt_int("vocab_size")
    if declared_vocab is not None and declared_vocab != vocab:
        raise ValueError(
            f"{gguf.path}: '{arch}.vocab_size' = {declared_vocab} but token_embd.weight has {vocab} rows"
        )
    key_len = meta.opt_int("attention.key_length")
    value_len = meta.opt_int("attention.value_length")
    if key_len is not None and value_len is not None and key_len != value_len:
        raise ValueError(
            f"{gguf.path}: '{arch}.attention.key_length' = {key_len} differs from "
            f"'{arch}.attention.value_length' = {value_len}; only equal lengths are supported"
        )
    head_dim = key_len if key_len is not None else hidden // heads
    rope_dims = meta.opt_int("rope.dimension_count")
    if arch != "gpt2" and rope_dims is not None and rope_dims != head_dim:
        raise ValueError(
            f"{gguf.path}: partial RoPE ('{arch}.rope.dimension_count' = {rope_dims}, head dim {head_dim}) "
            "is not supported"
        )
    raw: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.opt_int("attention.head_count_kv", heads),
        "intermediate_size": meta.opt_int("feed_forward_length", 4 * hidden),
        "vocab_size": vocab,
        "max_position_embeddings": meta.req("context_length"),
        "head_dim": head_dim,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "torch_dtype": None,
        **_special_ids(gguf),
    }
    if arch == "gpt2":
        raw["rms_norm_eps"] = meta.opt_float("attention.layer_norm_epsilon", 1e-5)
        raw["hidden_act"] = "gelu_new"
        raw["attention_bias"] = raw["mlp_bias"] = True
        raw["head_dim"] = None
    else:
        default_eps = 1e-5 if arch == "llama" else 1e-6
        raw["rms_norm_eps"] = meta.opt_float("attention.layer_norm_rms_epsilon", default_eps)
        raw["rope_theta"] = meta.opt_float("rope.freq_base", 10000.0)
        raw["rope_scaling"] = _rope_scaling(meta)
        raw["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
        raw["mlp_bias"] = "blk.0.ffn_up.bias" in gguf.tensors
    if arch == "gemma3":
        raw["hidden_act"] = "gelu_pytorch_tanh"
        raw["sliding_window"] = meta.opt_int("attention.sliding_window")
        raw["layer_types"] = _layer_types(meta, n_layers)
        raw["rope_local_base_freq"] = GEMMA3_LOCAL_ROPE_BASE
        raw["query_pre_attn_scalar"] = float(hidden // heads if n_layers == GEMMA3_27B_LAYERS else head_dim)
    kinds = Counter(t.type_name for t in gguf.tensors.values())
    raw_config = {k: v for k, v in raw.items() if v is not None}
    config = config_from_dict(raw_config, source=str(gguf.path))
    config.extra["gguf"] = {
        "file_type": gguf.metadata.get("general.file_type"),
        "name": gguf.metadata.get("general.name"),
        "tensor_types": dict(kinds),
    }
    return config
