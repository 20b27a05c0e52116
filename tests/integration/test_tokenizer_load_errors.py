"""transformers' own strict config checks, met while loading the tokenizer, name the checkpoint.

`AutoTokenizer` reads config.json itself and validates fields `infer` does not use
(``use_cache``, ``max_window_layers``...) with its own exception types. They reach the
user as a ``ValueError`` naming the checkpoint (found by benchmarks/fuzz.py). A generic
tokenizer (`infer.loader.tokenizer.generic_tokenizer`) is served without transformers,
which then checks nothing: the checkpoint loads, as infer reads neither field.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import infer


@pytest.mark.parametrize(("key", "value"), [("use_cache", 7), ("max_window_layers", "llama")])
def test_config_field_refused_by_transformers(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path, key: str, value: object
) -> None:
    path = shutil.copytree(tiny_ckpt_factory("qwen3"), tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, key: value}))
    assert infer.load(path).tokenizer.encode("hi")  # the generic tokenizer: no transformers
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    # a key transformers applies on top of tokenizer.json: AutoTokenizer loads it, and checks config.json
    (path / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "add_bos_token": True}))
    with pytest.raises(ValueError, match="could not load a tokenizer") as info:
        infer.load(path)
    print(info.value)
    assert str(path) in str(info.value) and key in str(info.value)
