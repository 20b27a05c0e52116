"""`ModelConfig` and its reader, importable here for the original loader API (the code: `infer.config`)."""

from __future__ import annotations

from infer.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    config_from_dict,
    load_config,
    supported_model_types,
)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = supported_model_types()

__all__ = [
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "SUPPORTED_MODEL_TYPES",
    "ModelConfig",
    "config_from_dict",
    "load_config",
    "supported_model_types",
]
