"""Model architectures, built from the shared pieces in `infer.models.common`.

`ARCHITECTURES` is the registry: one `Architecture` record per ``model_type``, each
declared in its model file. Everything that depends on an architecture (the safetensors
and GGUF loaders, the GGUF writer, the original weight-map API) looks it up here with
`architecture`; importing this package also registers each record's config rules with
the config reader (`infer.loader.config.register_architecture`), which imports no model.
"""

from __future__ import annotations

from infer.loader.config import ModelConfig, config_rules, register_architecture
from infer.models import gemma3, gpt2, llama, mistral, phi3, qwen2, qwen3
from infer.models.arch import Architecture
from infer.models.base import DecoderLM

ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (llama.ARCH, qwen3.ARCH, gemma3.ARCH, gpt2.ARCH, qwen2.ARCH, mistral.ARCH, phi3.ARCH)
}
for _arch in ARCHITECTURES.values():
    register_architecture(_arch)


def architecture(model_type: str | None, source: str) -> Architecture:
    """The `Architecture` record of ``model_type``; unknown or missing types name the supported ones."""
    return ARCHITECTURES[config_rules(model_type, source).model_type]


def model_class(config: ModelConfig) -> type[DecoderLM]:
    """The `DecoderLM` subclass of ``config.model_type``."""
    cls = architecture(config.model_type, "config").model_class
    if not (isinstance(cls, type) and issubclass(cls, DecoderLM)):
        raise TypeError(f"{config.model_type}: model_class {cls!r} is not a DecoderLM subclass")
    return cls


__all__ = ["ARCHITECTURES", "Architecture", "DecoderLM", "architecture", "model_class"]
