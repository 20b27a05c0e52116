"""GGUF test files: tiny models of several architectures, each written in several GGML types."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from infer.gguf.writer import write_gguf
from infer.testing import build_tokenizer, tiny_hf_model


def write_gguf_files(
    root: Path, overrides: Mapping[str, Mapping[str, Any]], qtypes: Iterable[str]
) -> dict[tuple[str, str], Path]:
    """One file per (architecture, qtype) under ``root``: ``tiny_hf_model(arch, **overrides[arch])``
    with the test tokenizer, at ``root / f"{arch}-{qtype}.gguf"``."""
    tokenizer = build_tokenizer(root / "tokenizer")
    files = {}
    qtypes = list(qtypes)
    for arch, kwargs in overrides.items():
        model = tiny_hf_model(arch, **kwargs)
        for qtype in qtypes:
            files[arch, qtype] = write_gguf(root / f"{arch}-{qtype}.gguf", model, tokenizer, qtype=qtype)
    return files
