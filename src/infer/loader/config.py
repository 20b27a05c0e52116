"""`ModelConfig`: the typed view of a checkpoint's configuration, and its reader.

The reader accepts both config styles found in the wild:

* hub configs (``rope_theta``, ``rope_scaling``, ``sliding_window_pattern``,
  ``rope_local_base_freq``), and
* configs written by recent transformers (``rope_parameters``, possibly keyed by
  layer type, and an explicit ``layer_types`` list),

and normalizes them to one set of fields, so the models never look at raw JSON. What
differs per architecture (field renames, transformers' defaults, derived fields) is
declared in the architecture's model file (`infer.models.arch.Architecture`), which
registers them here (`register_architecture`; `infer.models` registers every record
it ships when it is imported). This module applies those rules and then checks every
value (`validate_config`), so a config that would fail later with a reshape error or a
division by zero fails here, naming the file and the field. It imports nothing of
infer's: the models import it, never the other way round.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
FREQ_FACTORS = "freq_factors"  # per-frequency divisors, as GGUF files store Llama 3.1+ scaling
ROPE_TYPES = ("default", "linear", "llama3", FREQ_FACTORS)
# Parameters each scaled RoPE type needs, all positive finite numbers.
_ROPE_PARAMETERS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass
class ModelConfig:
    # Identity
    model_type: str  # "llama", "qwen3", "gemma3_text", "gpt2", "qwen2", "mistral", "phi3"

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
    partial_rotary_factor: float = 1.0  # Phi-3 family: RoPE on the first factor * head_dim dims

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
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (the first ones; all of them unless partial)."""
        return int(self.computed_head_dim * self.partial_rotary_factor)

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


REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
)

# Keys a nested text_config takes from the wrapper config when it doesn't set them itself.
_INHERITED_BY_TEXT_CONFIG = (
    "tie_word_embeddings",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)

_INT_FIELDS = (*REQUIRED, "num_key_value_heads")
# A bound on the layer count, checked before anything is made per layer (the largest
# published models have under 200 layers; a corrupt count must not allocate billions).
MAX_LAYERS = 10_000
_OPTIONAL_INT_FIELDS = ("head_dim", "sliding_window", "sliding_window_pattern")
_FLOAT_FIELDS = (
    "rms_norm_eps",
    "rope_theta",
    "rope_local_base_freq",
    "partial_rotary_factor",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
    "attn_logit_softcapping",
)
_REQUIRED_FLOATS = ("rms_norm_eps", "rope_theta", "partial_rotary_factor")  # no null
_BOOL_FIELDS = ("attention_bias", "mlp_bias", "tie_word_embeddings")
# `ModelConfig` fields only some architectures' transformers configs read (Gemma's soft-capping,
# query scale and local RoPE base; sliding windows and per-layer types). Each architecture lists
# the ones it reads (`ConfigRules.reads`); the reader drops the others before anything derives
# from them, as transformers ignores them for that model (a Llama config with
# ``final_logit_softcapping`` is still a plain Llama there).
ARCH_FIELDS = (
    "query_pre_attn_scalar",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "rope_local_base_freq",
    "sliding_window",
    "sliding_window_pattern",
    "layer_types",
)
# Activation names the models implement (`infer.models.common.ACTIVATIONS` maps each to its function).
ACTIVATION_NAMES = ("silu", "swish", "gelu_pytorch_tanh", "gelu_new", "gelu")


class ConfigRules(Protocol):
    """What the reader needs of an architecture (`infer.models.arch.Architecture` has these)."""

    @property
    def model_type(self) -> str: ...
    @property
    def renames(self) -> Mapping[str, str]: ...
    @property
    def defaults(self) -> Mapping[str, Any]: ...
    @property
    def nested_defaults(self) -> Mapping[str, Any]: ...
    @property
    def normalize(self) -> Callable[[dict[str, Any], str], None] | None: ...
    @property
    def reads(self) -> tuple[str, ...]: ...  # the `ARCH_FIELDS` its transformers config reads


# model_type -> its rules, filled by the model side (`register_architecture`).
_REGISTRY: dict[str, ConfigRules] = {}


def register_architecture(rules: ConfigRules) -> None:
    """Make ``rules.model_type`` readable; registering a second record for one type is an error."""
    unknown = sorted(set(rules.reads) - set(ARCH_FIELDS))
    if unknown:
        raise ValueError(
            f"model_type {rules.model_type!r} reads unknown fields {unknown}; known: {ARCH_FIELDS}"
        )
    known = _REGISTRY.get(rules.model_type)
    if known is not None and known is not rules:
        raise ValueError(f"model_type {rules.model_type!r} is already registered")
    _REGISTRY[rules.model_type] = rules


def supported_model_types() -> tuple[str, ...]:
    """The registered model types (every architecture `infer.models` ships, once it is imported)."""
    return tuple(_REGISTRY)


def config_rules(model_type: str | None, source: str) -> ConfigRules:
    """The registered rules of ``model_type``; unknown or missing types name the supported ones."""
    supported = list(_REGISTRY)
    if model_type is None:
        raise ValueError(f"{source}: no 'model_type'; supported model types: {supported}")
    rules = _REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if rules is None:
        hint = "" if supported else " (no architecture is registered: import infer.models first)"
        raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: {supported}{hint}")
    return rules


def _normalize_rope_dict(rope: dict[str, Any]) -> dict[str, Any]:
    rope = dict(rope)
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope.pop("type")
    rope.pop("type", None)
    rope.setdefault("rope_type", "default")
    return rope


def _scaling_or_none(rope: dict[str, Any]) -> dict[str, Any] | None:
    """A rope dict without theta (or partial rotary factor), or None when it describes plain RoPE."""
    rope = _normalize_rope_dict(rope)
    rope.pop("rope_theta", None)
    rope.pop("partial_rotary_factor", None)
    if rope["rope_type"] == "default":
        return None
    return rope


def _apply_rope_parameters(raw: dict[str, Any], source: str) -> None:
    """Fold transformers' ``rope_parameters`` into rope_theta / rope_scaling / rope_local_base_freq."""
    params = raw.pop("rope_parameters", None)
    if not params:
        if isinstance(raw.get("rope_scaling"), dict):
            raw["rope_scaling"] = _scaling_or_none(raw["rope_scaling"])
        return
    if not isinstance(params, dict):
        raise ValueError(f"{source}: 'rope_parameters' = {params!r}, expected an object")
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
        full = params.get(FULL_ATTENTION)
        sliding = params.get(SLIDING_ATTENTION)
        for name, entry in ((FULL_ATTENTION, full), (SLIDING_ATTENTION, sliding)):
            if entry is not None and not isinstance(entry, dict):
                raise ValueError(f"{source}: 'rope_parameters.{name}' = {entry!r}, expected an object")
        if full is not None:
            if "rope_theta" in full:
                raw["rope_theta"] = full["rope_theta"]
            raw["rope_scaling"] = _scaling_or_none(full)
        if sliding is not None:
            if _scaling_or_none(sliding) is not None:
                raise ValueError(
                    f"{source}: scaled RoPE on sliding-window layers is not supported: rope_parameters"
                    f"[{SLIDING_ATTENTION!r}] = {sliding}"
                )
            if "rope_theta" in sliding:
                raw["rope_local_base_freq"] = sliding["rope_theta"]
        return
    if "rope_theta" in params:
        raw["rope_theta"] = params["rope_theta"]
    if "partial_rotary_factor" in params:
        raw["partial_rotary_factor"] = params["partial_rotary_factor"]
    raw["rope_scaling"] = _scaling_or_none(params)


def _resolve_layer_types(raw: dict[str, Any], source: str) -> None:
    """``layer_types`` from Gemma's ``sliding_window_pattern`` (every pattern-th layer is global)."""
    if raw.get("layer_types") is not None:
        return
    pattern = raw.get("sliding_window_pattern")
    if pattern is None or raw.get("sliding_window") is None:
        return
    n = _as_int(raw, "num_hidden_layers", source)
    period = _as_int(raw, "sliding_window_pattern", source)
    raw["layer_types"] = [FULL_ATTENTION if (i + 1) % period == 0 else SLIDING_ATTENTION for i in range(n)]


def _as_int(raw: dict[str, Any], key: str, source: str) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}: '{key}' = {value!r}, expected an integer")
    return value


def _unnest_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Multimodal wrappers (Gemma 3 4B+) nest the language model's config under ``text_config``."""
    text_config = raw.get("text_config")
    if not isinstance(text_config, dict):
        return raw
    inner = dict(text_config)
    outer_type = raw.get("model_type")
    inner.setdefault("model_type", f"{outer_type}_text" if outer_type else None)
    for key in _INHERITED_BY_TEXT_CONFIG:  # keep the wrapper's values the inner config leaves out
        if key in raw and key not in inner:
            inner[key] = raw[key]
    # transformers writes a nested config as its difference from the class defaults
    # (gemma-3-4b-it's text_config has no num_attention_heads, head_dim, vocab_size, ...).
    arch = _REGISTRY.get(inner["model_type"]) if isinstance(inner["model_type"], str) else None
    if arch is not None:
        for key, value in arch.nested_defaults.items():
            if inner.get(key) is None:
                inner[key] = value
    return inner


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> ModelConfig:
    """Build a `ModelConfig` from a parsed ``config.json``; ``source`` names it in errors.

    The input is not mutated. Every value is checked (`validate_config`).
    """
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object, found {type(data).__name__}")
    raw = _unnest_text_config(dict(data))
    arch = config_rules(raw.get("model_type"), source)

    for old, new in arch.renames.items():
        # The hub name is the one transformers reads (Gemma's MLP uses hidden_activation even
        # when an older hidden_act is also present), so it wins when set.
        value = raw.pop(old, None)
        if value is not None:
            raw[new] = value
    if "dtype" in raw and raw.get("torch_dtype") is None:
        raw["torch_dtype"] = raw["dtype"]

    # JSON nulls fall back to the defaults.
    raw = {k: v for k, v in raw.items() if v is not None}
    # What this architecture's transformers config ignores (set aside: layer_types is still checked).
    ignored = {key: raw.pop(key) for key in sorted(set(ARCH_FIELDS) - set(arch.reads)) if key in raw}
    for key in (*_INT_FIELDS, *_OPTIONAL_INT_FIELDS):
        if key in raw:
            _as_int(raw, key, source)
    layers = raw.get("num_hidden_layers")
    if layers is not None and not 0 < layers <= MAX_LAYERS:  # before anything makes a list per layer
        raise _fail(source, "num_hidden_layers", layers, f"an integer in [1, {MAX_LAYERS}]")
    if "layer_types" in ignored and layers is not None:
        listed = ignored["layer_types"]
        _check_layer_types(list(listed) if isinstance(listed, tuple) else listed, layers, source)
    if arch.normalize is not None:
        arch.normalize(raw, source)

    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"{source}: missing required field(s) {missing} for model_type {arch.model_type!r}")
    raw.setdefault("num_key_value_heads", raw["num_attention_heads"])
    for key in _INT_FIELDS:
        _as_int(raw, key, source)

    _apply_rope_parameters(raw, source)
    _resolve_layer_types(raw, source)
    for key, value in arch.defaults.items():
        raw.setdefault(key, value)

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    kwargs = {k: v for k, v in raw.items() if k in names}
    if isinstance(kwargs.get("layer_types"), list | tuple):
        kwargs["layer_types"] = list(kwargs["layer_types"])
    if isinstance(kwargs.get("rope_scaling"), dict):
        kwargs["rope_scaling"] = _normalize_rope_dict(kwargs["rope_scaling"])
    for key in _FLOAT_FIELDS:  # JSON writes 1000000 for 1e6; keep the typed fields typed
        if isinstance(kwargs.get(key), int) and not isinstance(kwargs[key], bool):
            kwargs[key] = float(kwargs[key])
    config = ModelConfig(**kwargs)
    validate_config(config, source)
    return config


def _fail(source: str, key: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"{source}: '{key}' = {value!r}, expected {expected}")


SIZE_LIMIT = 2**31  # sizes index tensors with 32-bit ints in torch's kernels; no real model comes near


def validate_config(config: ModelConfig, source: str) -> None:
    """Check every field's type and range, and the relations between them; raise `ValueError` naming them.

    Sizes are positive integers, norm epsilons and RoPE bases positive and finite, heads
    divide as attention needs (``hidden_size % heads`` when ``head_dim`` is implied,
    ``heads % kv_heads``), layer types are known and one per layer, special token ids
    lie in the vocabulary.
    """
    c = config
    for key in _INT_FIELDS:
        value = getattr(c, key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < SIZE_LIMIT:
            raise _fail(source, key, value, "a positive integer below 2^31")
    for key in _OPTIONAL_INT_FIELDS:
        value = getattr(c, key)
        bad = isinstance(value, bool) or not isinstance(value, int) or not 0 < value < SIZE_LIMIT
        if value is not None and bad:
            raise _fail(source, key, value, "a positive integer below 2^31, or null")
    for key in _FLOAT_FIELDS:
        value = getattr(c, key)
        if value is None and key in _REQUIRED_FLOATS:
            raise _fail(source, key, value, "a finite number")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _fail(source, key, value, "a finite number")
        if value <= 0:
            raise _fail(source, key, value, "a number > 0")
    for key in _BOOL_FIELDS:
        if not isinstance(getattr(c, key), bool):
            raise _fail(source, key, getattr(c, key), "true or false")
    if not isinstance(c.hidden_act, str) or c.hidden_act not in ACTIVATION_NAMES:
        raise _fail(source, "hidden_act", c.hidden_act, f"one of {sorted(ACTIVATION_NAMES)}")
    if c.head_dim is None and c.hidden_size % c.num_attention_heads:
        raise ValueError(
            f"{source}: hidden_size {c.hidden_size} is not divisible by num_attention_heads "
            f"{c.num_attention_heads} (and no head_dim is given)"
        )
    if c.num_attention_heads % c.num_key_value_heads:
        raise ValueError(
            f"{source}: num_attention_heads {c.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {c.num_key_value_heads}"
        )
    if c.partial_rotary_factor > 1:
        raise _fail(source, "partial_rotary_factor", c.partial_rotary_factor, "a number in (0, 1]")
    if c.rotary_dim % 2 or c.rotary_dim == 0:
        raise ValueError(
            f"{source}: RoPE rotates {c.rotary_dim} of {c.computed_head_dim} head dimensions "
            f"(partial_rotary_factor {c.partial_rotary_factor}); expected an even, positive number"
        )
    if c.layer_types is not None:
        _check_layer_types(c.layer_types, c.num_hidden_layers, source)
        if SLIDING_ATTENTION in c.layer_types and c.sliding_window is None:
            raise ValueError(f"{source}: layer_types has sliding-window layers but sliding_window is not set")
    if c.rope_scaling is not None:
        _validate_rope_scaling(c, source)
    for key in ("bos_token_id", "pad_token_id"):
        value = getattr(c, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise _fail(source, key, value, "an integer or null")
    eos = c.eos_token_id
    if eos is not None and not (
        (isinstance(eos, int) and not isinstance(eos, bool))
        or (isinstance(eos, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in eos))
    ):
        raise _fail(source, "eos_token_id", eos, "an integer, a list of integers or null")
    for token in [c.bos_token_id, *c.eos_token_ids]:
        if token is not None and not 0 <= token < c.vocab_size:
            raise ValueError(
                f"{source}: special token id {token} (bos_token_id / eos_token_id) is outside the "
                f"vocabulary [0, {c.vocab_size})"
            )
    if c.torch_dtype is not None and not isinstance(c.torch_dtype, str):
        raise _fail(source, "torch_dtype", c.torch_dtype, "a dtype name or null")


def _check_layer_types(layer_types: Any, num_hidden_layers: int, source: str) -> None:
    """``layer_types`` is a list of one known layer type per layer (transformers checks this of
    every config, also where the model ignores the list)."""
    if not isinstance(layer_types, list) or len(layer_types) != num_hidden_layers:
        found = f"{len(layer_types)} entries" if isinstance(layer_types, list) else repr(layer_types)
        raise ValueError(
            f"{source}: 'layer_types' = {found[:100]}, expected a list of num_hidden_layers="
            f"{num_hidden_layers} layer types"
        )
    unknown = sorted({str(t) for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        raise ValueError(
            f"{source}: unsupported layer type(s) {unknown} in layer_types; known: {LAYER_TYPES}"
        )


def _validate_rope_scaling(c: ModelConfig, source: str) -> None:
    scaling = c.rope_scaling
    if not isinstance(scaling, dict):
        raise _fail(source, "rope_scaling", scaling, "an object or null")
    kind = scaling.get("rope_type")
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"{source}: unsupported RoPE scaling type {kind!r} (rope_scaling / rope_parameters); "
            f"supported: {list(ROPE_TYPES)}"
        )
    for key in _ROPE_PARAMETERS.get(kind, ()):
        value = scaling.get(key)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise _fail(source, f"rope_scaling.{key}", value, f"a positive number for {kind} RoPE")
    if kind == "llama3" and scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
        raise ValueError(
            f"{source}: llama3 RoPE needs low_freq_factor < high_freq_factor, found "
            f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}"
        )
    if kind == FREQ_FACTORS:
        factors = scaling.get("factors")
        n = c.rotary_dim // 2
        if (
            not isinstance(factors, list | tuple)
            or len(factors) != n
            or not all(isinstance(f, float) and math.isfinite(f) and f > 0 for f in factors)
        ):
            raise ValueError(f"{source}: RoPE frequency factors must be {n} positive finite numbers")


def load_config(model_path: str | Path) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself) into a `ModelConfig`."""
    path = Path(model_path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    except RecursionError:
        raise ValueError(f"{file}: not valid JSON (nested too deeply)") from None
    return config_from_dict(data, source=str(file))


__all__ = [
    "ACTIVATION_NAMES",
    "ARCH_FIELDS",
    "FREQ_FACTORS",
    "FULL_ATTENTION",
    "LAYER_TYPES",
    "ROPE_TYPES",
    "SLIDING_ATTENTION",
    "ConfigRules",
    "ModelConfig",
    "config_from_dict",
    "config_rules",
    "load_config",
    "register_architecture",
    "supported_model_types",
    "validate_config",
]
