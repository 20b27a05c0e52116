"""infer: pure-PyTorch LLM inference.

>>> import infer
>>> llm = infer.load("path/to/checkpoint")            # HF directory, .gguf file or hub id
>>> llm.generate("The capital of France is", max_new_tokens=32).text
"""

from __future__ import annotations

from infer.api import LLM, GenerationResult, load
from infer.generate import SamplingParams
from infer.streaming.config import StreamingConfig

__all__ = ["LLM", "GenerationResult", "SamplingParams", "StreamingConfig", "load"]
__version__ = "0.1.0"
