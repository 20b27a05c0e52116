"""`ModelConfig`: the typed view of a checkpoint's `config.json`.

The reader accepts both config styles found in the wild:

* hub configs (``rope_theta``, ``rope_scaling``, ``sliding_window_pattern``,
  ``rope_local_base_freq``), and
* configs written by recent transformers (``rope_parameters``, possibly keyed by
  layer type, and an explicit ``layer_types`` list),

and normalizes them to one set of fields, so the models never look at raw JSON.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen3", "gemma3_text", "gpt2")

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass
class ModelConfig:
    # Identity
    model_type: str  # "llama", "qwen3", "gemma3_text", "gpt2"

    # Dimensions
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads

    # Normalization
    rms_norm_eps: float = 1e-5

    # RoPE
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # always carries "rope_type" after normalization
    rope_local_base_freq: float | None = None  # Gemma 3: theta of the sliding-window layers

    # Projection biases
    attention_bias: bool = False
    mlp_bias: bool = False

    # Activation
    hidden_act: str = "silu"

    # Attention scaling
    query_pre_attn_scalar: float | None = None  # None -> head_dim

    # Sliding window attention
    sliding_window: int | None = None
    sliding_window_pattern: int | None = None
    layer_types: list[str] | None = None

    # Embeddings
    tie_word_embeddings: bool = False

    # Soft-capping (Gemma family); None disables
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    # Special tokens
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    # The checkpoint's dtype as written ("bfloat16", "float32", ...); None if absent
    torch_dtype: str | None = None

    # Free-form extras a loader wants to carry (e.g. GGUF quantization facts)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def computed_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def attention_scale(self) -> float:
        """Softmax scale: ``query_pre_attn_scalar ** -0.5`` when set, else ``head_dim ** -0.5``."""
        scalar: float | None = self.query_pre_attn_scalar
        if scalar is None:
            scalar = self.computed_head_dim
        scale: float = float(scalar) ** -0.5  # as transformers computes it
        return scale

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    def layer_type(self, index: int) -> str:
        """The attention type of layer ``index`` (``full_attention`` when the config has no types)."""
        if self.layer_types is None:
            return FULL_ATTENTION
        return self.layer_types[index]


_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
)

# Per-family field renames applied before anything else (hub name -> our name).
_RENAMES: dict[str, dict[str, str]] = {
    "gemma3_text": {"hidden_activation": "hidden_act"},
    "gpt2": {
        "n_embd": "hidden_size",
        "n_layer": "num_hidden_layers",
        "n_head": "num_attention_heads",
        "n_positions": "max_position_embeddings",
        "n_inner": "intermediate_size",
        "layer_norm_epsilon": "rms_norm_eps",
        "activation_function": "hidden_act",
    },
}

# transformers' own defaults for fields a family's hub configs may leave out (gemma-3-1b-it
# has no tie_word_embeddings: Gemma3TextConfig defaults it to True).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "tie_word_embeddings": True,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256.0,
    },
}

# Keys a nested text_config takes from the wrapper config when it doesn't set them itself.
_INHERITED_BY_TEXT_CONFIG = (
    "tie_word_embeddings",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)

# Gemma3TextConfig's defaults, which a multimodal Gemma 3 config.json leaves out of its text_config.
_NESTED_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
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
    },
}

_FLOAT_FIELDS = (
    "rms_norm_eps",
    "rope_theta",
    "rope_local_base_freq",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
    "attn_logit_softcapping",
)


def _normalize_rope_dict(rope: dict[str, Any]) -> dict[str, Any]:
    rope = dict(rope)
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope.pop("type")
    rope.pop("type", None)
    rope.setdefault("rope_type", "default")
    return rope


def _scaling_or_none(rope: dict[str, Any]) -> dict[str, Any] | None:
    """A rope dict without theta, or None when it describes plain (unscaled) RoPE."""
    rope = _normalize_rope_dict(rope)
    rope.pop("rope_theta", None)
    if rope["rope_type"] == "default":
        return None
    return rope


def _apply_rope_parameters(raw: dict[str, Any]) -> None:
    """Fold transformers' ``rope_parameters`` into rope_theta / rope_scaling / rope_local_base_freq."""
    params = raw.pop("rope_parameters", None)
    if not params:
        if isinstance(raw.get("rope_scaling"), dict):
            raw["rope_scaling"] = _scaling_or_none(raw["rope_scaling"])
        return
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
        full = params.get(FULL_ATTENTION)
        sliding = params.get(SLIDING_ATTENTION)
        if full is not None:
            if "rope_theta" in full:
                raw["rope_theta"] = full["rope_theta"]
            raw["rope_scaling"] = _scaling_or_none(full)
        if sliding is not None:
            if _scaling_or_none(sliding) is not None:
                raise ValueError(
                    f"scaled RoPE on sliding-window layers is not supported: rope_parameters"
                    f"[{SLIDING_ATTENTION!r}] = {sliding}"
                )
            if "rope_theta" in sliding:
                raw["rope_local_base_freq"] = sliding["rope_theta"]
        return
    if "rope_theta" in params:
        raw["rope_theta"] = params["rope_theta"]
    raw["rope_scaling"] = _scaling_or_none(params)


def _resolve_layer_types(raw: dict[str, Any]) -> None:
    if raw.get("layer_types") is not None:
        return
    pattern = raw.get("sliding_window_pattern")
    if pattern is None or raw.get("sliding_window") is None:
        return
    n = int(raw["num_hidden_layers"])
    raw["layer_types"] = [
        FULL_ATTENTION if (i + 1) % int(pattern) == 0 else SLIDING_ATTENTION for i in range(n)
    ]


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> ModelConfig:
    """Build a `ModelConfig` from a parsed ``config.json``; ``source`` names it in errors.

    The input is not mutated.
    """
    raw: dict[str, Any] = dict(data)
    text_config = raw.get("text_config")
    if isinstance(text_config, dict):
        # Multimodal wrappers (Gemma 3 4B+) nest the language model's config; keep the
        # outer tie_word_embeddings / dtype / special tokens if the inner one doesn't say.
        inner = dict(text_config)
        outer_type = raw.get("model_type")
        inner.setdefault("model_type", f"{outer_type}_text" if outer_type else None)
        for key in _INHERITED_BY_TEXT_CONFIG:
            if key in raw and key not in inner:
                inner[key] = raw[key]
        # transformers writes a nested config as its difference from the class defaults
        # (gemma-3-4b-it's text_config has no num_attention_heads, head_dim, vocab_size, ...).
        for key, value in _NESTED_TEXT_DEFAULTS.get(inner["model_type"], {}).items():
            if inner.get(key) is None:
                inner[key] = value
        raw = inner

    model_type = raw.get("model_type")
    if model_type is None:
        raise ValueError(f"{source}: no 'model_type'; supported model types: {list(SUPPORTED_MODEL_TYPES)}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: unsupported model_type {model_type!r}; supported: {list(SUPPORTED_MODEL_TYPES)}"
        )

    for old, new in _RENAMES.get(model_type, {}).items():
        # The hub name is the one transformers reads (Gemma's MLP uses hidden_activation even
        # when an older hidden_act is also present), so it wins when set.
        value = raw.pop(old, None)
        if value is not None:
            raw[new] = value
    if "dtype" in raw and raw.get("torch_dtype") is None:
        raw["torch_dtype"] = raw["dtype"]

    # JSON nulls fall back to the dataclass defaults.
    raw = {k: v for k, v in raw.items() if v is not None}

    if model_type == "gpt2":
        if "hidden_size" in raw:
            raw.setdefault("intermediate_size", 4 * int(raw["hidden_size"]))
        raw.setdefault("attention_bias", True)
        raw.setdefault("mlp_bias", True)
        raw.setdefault("tie_word_embeddings", True)
        raw.setdefault("rms_norm_eps", 1e-5)
        raw.setdefault("hidden_act", "gelu_new")
        # Variants infer.models.gpt2 does not implement (transformers' GPT2Config flags).
        if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("scale_attn_weights") is False:
            raise ValueError(
                f"{source}: unsupported GPT-2 attention scaling: scale_attn_weights="
                f"{raw.get('scale_attn_weights')}, scale_attn_by_inverse_layer_idx="
                f"{raw.get('scale_attn_by_inverse_layer_idx')} (supported: true, false)"
            )

    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"{source}: missing required field(s) {missing} for model_type {model_type!r}")
    raw.setdefault("num_key_value_heads", raw["num_attention_heads"])

    _apply_rope_parameters(raw)
    _resolve_layer_types(raw)
    for key, value in _FAMILY_DEFAULTS.get(model_type, {}).items():
        raw.setdefault(key, value)

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    kwargs = {k: v for k, v in raw.items() if k in names}
    if "layer_types" in kwargs:
        kwargs["layer_types"] = list(kwargs["layer_types"])
        if len(kwargs["layer_types"]) != int(kwargs["num_hidden_layers"]):
            raise ValueError(
                f"{source}: layer_types has {len(kwargs['layer_types'])} entries, "
                f"expected num_hidden_layers={kwargs['num_hidden_layers']}"
            )
    if "rope_scaling" in kwargs and kwargs["rope_scaling"] is not None:
        kwargs["rope_scaling"] = _normalize_rope_dict(kwargs["rope_scaling"])
    for key in _FLOAT_FIELDS:  # JSON writes 1000000 for 1e6; keep the typed fields typed
        if isinstance(kwargs.get(key), int) and not isinstance(kwargs[key], bool):
            kwargs[key] = float(kwargs[key])
    return ModelConfig(**kwargs)


def load_config(model_path: str | Path) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself) into a `ModelConfig`."""
    path = Path(model_path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, found {type(data).__name__}")
    return config_from_dict(data, source=str(file))
