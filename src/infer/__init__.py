"""infer: pure-PyTorch LLM inference.

>>> import infer
>>> llm = infer.load("path/to/checkpoint")            # HF directory, .gguf file or hub id
>>> llm.generate("The capital of France is", max_new_tokens=32).text
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infer.api import load
    from infer.llm import LLM, GenerationResult
    from infer.params import NonFiniteLogitsError, SamplingParams
    from infer.streaming.config import StreamingConfig

# Imported on first use: `import infer` (and so `infer.cli`, whose first act is to take
# Ctrl-C) is instant; torch is imported with the first of these names.
_LAZY = {
    "LLM": "infer.llm",
    "GenerationResult": "infer.llm",
    "load": "infer.api",
    "SamplingParams": "infer.params",
    "NonFiniteLogitsError": "infer.params",
    "StreamingConfig": "infer.streaming.config",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'infer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["LLM", "GenerationResult", "NonFiniteLogitsError", "SamplingParams", "StreamingConfig", "load"]
__version__ = "0.1.0"
