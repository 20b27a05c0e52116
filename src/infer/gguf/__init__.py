"""GGUF checkpoints: a fast metadata reader, config from metadata, a weight source, a tokenizer cache."""

from __future__ import annotations

from infer.gguf.config import config_from_gguf
from infer.gguf.reader import GGUFFile, TensorInfo
from infer.gguf.source import GGUFSource

__all__ = ["GGUFFile", "GGUFSource", "TensorInfo", "config_from_gguf"]
