"""infer: pure-PyTorch LLM inference.

>>> import infer
>>> llm = infer.load("path/to/checkpoint")            # HF directory, .gguf file or hub id
>>> llm.generate("The capital of France is", max_new_tokens=32).text
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from infer.api import LLM, GenerationResult, load
from infer.generate import SamplingParams

if TYPE_CHECKING:
    from infer.streaming import StreamingConfig

__all__ = ["LLM", "GenerationResult", "SamplingParams", "StreamingConfig", "load"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # StreamingConfig lives with the streaming executor; import it only when asked for.
    if name == "StreamingConfig":
        from infer.streaming import StreamingConfig

        return StreamingConfig
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
