"""The GGUF tokenizer: built as transformers builds it, cached on disk, identical after the cache."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from infer.gguf.config import config_from_gguf
from infer.gguf.reader import GGUFFile
from infer.gguf.tokenizer import build_hf_tokenizer, gguf_tokenizer
from infer.realmodels import gemma3_270m_path, smollm2_path

pytestmark = pytest.mark.slow  # parity with transformers: `pytest tests/integration/ -m slow` runs it

TEXTS = [
    "The capital of France is",
    "  two leading spaces and\ttabs\n\nnew lines",
    "Ünïcödé 日本語 🤗 emoji, numbers 1234567 and symbols <>&",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<bos><start_of_turn>user\nhello<end_of_turn>",
    " leading space",
    "x" * 80,
]


def _same_behaviour(a: object, b: object) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = a.encode(text, add_special_tokens=special)  # type: ignore[attr-defined]
            assert ids == b.encode(text, add_special_tokens=special), (text, special)  # type: ignore[attr-defined]
            for skip in (True, False):
                assert a.decode(ids, skip_special_tokens=skip) == b.decode(ids, skip_special_tokens=skip)  # type: ignore[attr-defined]
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template"):
        assert getattr(a, name) == getattr(b, name), name
    assert len(a) == len(b)  # type: ignore[arg-type]


@pytest.mark.realmodel
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_cached_tokenizer_matches_a_fresh_build(which: str, tmp_path: Path) -> None:
    gguf = GGUFFile(smollm2_path() if which == "smollm2" else gemma3_270m_path())
    config = config_from_gguf(gguf)
    t0 = time.perf_counter()
    first = gguf_tokenizer(gguf, config, cache_dir=tmp_path)  # miss: built and saved
    t1 = time.perf_counter()
    second = gguf_tokenizer(gguf, config, cache_dir=tmp_path)  # hit
    t2 = time.perf_counter()
    assert len(list(tmp_path.iterdir())) == 1
    fresh = build_hf_tokenizer(gguf, config.model_type)
    _same_behaviour(second.hf, fresh)
    _same_behaviour(first.hf, fresh)
    assert second.eos_token_ids == config.eos_token_ids
    print(f"{gguf.path.name}: tokenizer miss {t1 - t0:.2f}s, hit {t2 - t1:.2f}s")


@pytest.mark.realmodel
def test_smollm2_matches_auto_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = smollm2_path()
    gguf = GGUFFile(path)
    ours = gguf_tokenizer(gguf, config_from_gguf(gguf), cache_dir=tmp_path)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _same_behaviour(ours.hf, reference)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_cache_key_follows_the_header(tmp_path: Path) -> None:
    from infer.gguf.tokenizer import _cache_key

    smol = GGUFFile(smollm2_path())
    copy = tmp_path / "copy.gguf"
    copy.symlink_to(smol.path)
    assert _cache_key(GGUFFile(copy)) == _cache_key(smol)


def test_a_file_without_tokenizer(tmp_path: Path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="no tokenizer in the file"):
        build_hf_tokenizer(GGUFFile(tmp_path / "t.gguf"), "llama")
