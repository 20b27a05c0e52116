"""GGUF checkpoints: a fast metadata reader, config and tensor maps, tokenizer cache, model loader."""

from __future__ import annotations

from infer.gguf.config import config_from_gguf
from infer.gguf.loader import GGUFModelLoader, inspect_rows, load_gguf
from infer.gguf.reader import GGUFFile, TensorInfo

__all__ = ["GGUFFile", "GGUFModelLoader", "TensorInfo", "config_from_gguf", "inspect_rows", "load_gguf"]
