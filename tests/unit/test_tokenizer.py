"""`Tokenizer` against `AutoTokenizer` on the locally built byte-level tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from infer.loader.tokenizer import Tokenizer
from infer.testing import BOS, EOS, EOT, PAD, TOKENIZER_VOCAB

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines",
    "ünïcödé, 你好, emoji 🙂",
    "special <|eot|> inside <|user|> text",
    "",
]


@pytest.fixture
def hf_tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def with_generation_config(tokenizer_dir: Path, tmp_path: Path, eos: Any) -> Path:
    path = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_auto_tokenizer(tokenizer_dir: Path, hf_tokenizer: Any, text: str) -> None:
    tok = Tokenizer(tokenizer_dir)
    ids = tok.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert ids[0] == BOS  # the post-processor adds <|begin|>
    bare = tok.encode(text, add_special_tokens=False)
    assert bare == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ids == [BOS, *bare]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(tokenizer_dir: Path, hf_tokenizer: Any, text: str) -> None:
    tok = Tokenizer(tokenizer_dir)
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin|>" + text
    if "<|" not in text:
        assert tok.decode(ids) == text


def test_encode_known_ids(tokenizer_dir: Path) -> None:
    tok = Tokenizer(str(tokenizer_dir))  # str paths work too
    ids = tok.encode("ab<|eot|>", add_special_tokens=False)
    assert len(ids) == 3 and ids[-1] == EOT
    assert tok.decode(ids) == "ab"


def test_single_eos_without_generation_config(tokenizer_dir: Path) -> None:
    tok = Tokenizer(tokenizer_dir)
    assert tok.eos_token_id == EOS
    assert isinstance(tok.eos_token_id, int)
    assert tok.eos_token_ids == [EOS]


def test_eos_list_from_generation_config(tiny_ckpt_factory: Any) -> None:
    """Like Llama 3.2 (``[128001, 128008, 128009]``): generation_config lists every stop id."""
    tok = Tokenizer(tiny_ckpt_factory("llama"))
    assert tok.eos_token_id == [EOS, EOT]
    assert tok.eos_token_ids == [EOS, EOT]


def test_eos_list_keeps_order(tokenizer_dir: Path, tmp_path: Path) -> None:
    path = with_generation_config(tokenizer_dir, tmp_path, [EOS, EOT, PAD])
    assert Tokenizer(path).eos_token_id == [EOS, EOT, PAD]


def test_single_eos_in_generation_config(tokenizer_dir: Path, tmp_path: Path) -> None:
    path = with_generation_config(tokenizer_dir, tmp_path, EOS)
    assert Tokenizer(path).eos_token_id == EOS


def test_generation_config_eos_adds_to_tokenizer_eos(tokenizer_dir: Path, tmp_path: Path) -> None:
    path = with_generation_config(tokenizer_dir, tmp_path, EOT)
    assert Tokenizer(path).eos_token_id == [EOS, EOT]  # the tokenizer's own EOS is never dropped


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1]", r"generation_config.json: expected a JSON object, found list \[1\]"),
        ('"eos"', r"generation_config.json: expected a JSON object, found str 'eos'"),
        ("{not json", r"generation_config.json: not valid JSON \(Expecting property name"),
        ("", r"generation_config.json: not valid JSON"),
        ('{"eos_token_id": [99999, -3]}', r"'eos_token_id' = \[99999, -3\], expected ids in the "
         r"tokenizer's vocabulary \[0, VOCAB\); 99999, -3 are not"),
        ('{"eos_token_id": -1}', r"'eos_token_id' = -1, expected ids in .*; -1 is not"),
        ('{"eos_token_id": "2"}',
         r"'eos_token_id' = '2', expected an integer token id, a list of them or null"),
        ('{"eos_token_id": [2, 1.0]}', r"'eos_token_id' = \[2, 1.0\], expected an integer token id"),
        ('{"eos_token_id": true}', r"'eos_token_id' = True, expected an integer token id"),
        ('{"eos_token_id": {"id": 2}}', r"'eos_token_id' = \{'id': 2\}, expected an integer token id"),
    ],
    ids=["list", "string", "invalid JSON", "empty", "outside the vocabulary", "negative", "a string id",
         "a float id", "a bool", "an object"],
)  # fmt: skip
def test_a_bad_generation_config_is_named(
    tokenizer_dir: Path, tmp_path: Path, text: str, message: str
) -> None:
    """A generation_config.json that is present but wrong is an error naming it (it used to be an
    AttributeError, or was ignored, or gave stop ids no token has)."""
    path = with_generation_config(tokenizer_dir, tmp_path, None)
    (path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=message.replace("VOCAB", str(TOKENIZER_VOCAB))) as info:
        Tokenizer(path)
    print(info.value)
    assert str(info.value).startswith(str(path / "generation_config.json"))


def test_a_generation_config_without_eos_is_absent(tokenizer_dir: Path, tmp_path: Path) -> None:
    eos: list[int] | None
    for eos in (None, []):
        path = with_generation_config(tokenizer_dir, tmp_path / str(eos), eos)
        assert Tokenizer(path).eos_token_ids == [EOS]
    (path / "generation_config.json").write_text('{"max_length": 20}')
    assert Tokenizer(path).eos_token_ids == [EOS]
    assert Tokenizer(path, eos_token_id=[EOT]).eos_token_ids == [EOS, EOT]  # config.json's: no file read
    (path / "generation_config.json").write_text("[1]")
    assert Tokenizer(path, eos_token_id=[EOT]).eos_token_ids == [EOS, EOT]


def test_explicit_eos_argument(tokenizer_dir: Path) -> None:
    assert Tokenizer(tokenizer_dir, eos_token_id=[EOT, PAD]).eos_token_id == [EOS, EOT, PAD]
    assert Tokenizer(tokenizer_dir, eos_token_id=EOS).eos_token_id == EOS


def test_bos_and_vocab_size(tokenizer_dir: Path, hf_tokenizer: Any) -> None:
    tok = Tokenizer(tokenizer_dir)
    assert tok.bos_token_id == BOS == hf_tokenizer.bos_token_id
    assert tok.pad_token_id == PAD
    assert tok.vocab_size == TOKENIZER_VOCAB == len(hf_tokenizer)  # added special tokens included


def test_no_bos(hf_tokenizer: Any) -> None:
    hf_tokenizer.bos_token = None
    tok = Tokenizer.from_hf(hf_tokenizer)
    assert tok.bos_token_id is None
    assert tok.eos_token_id == EOS
    assert tok.hf is hf_tokenizer


def test_no_eos_at_all_is_an_error(hf_tokenizer: Any) -> None:
    hf_tokenizer.eos_token = None
    tok = Tokenizer.from_hf(hf_tokenizer)
    with pytest.raises(ValueError, match="end-of-sequence"):
        _ = tok.eos_token_id


def test_chat_template(tiny_ckpt_factory: Any, hf_tokenizer: Any) -> None:
    tok = Tokenizer(tiny_ckpt_factory("qwen3"))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text = tok.apply_chat_template(messages)
    assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|begin|><|user|>hi<|eot|><|assistant|>yo<|eot|><|assistant|>"


def test_no_chat_template(hf_tokenizer: Any) -> None:
    hf_tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        Tokenizer.from_hf(hf_tokenizer).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Tokenizer(tmp_path / "nowhere")


def test_a_generic_tokenizer_is_served_without_transformers(tokenizer_dir: Path) -> None:
    """The tiny tokenizer (transformers' generic class): `FastTokenizer`, which every test above
    compares with `AutoTokenizer`; its chat template renders as transformers renders it."""
    from infer.loader.tokenizer import FastTokenizer

    tok = Tokenizer(tokenizer_dir)
    assert isinstance(tok.hf, FastTokenizer)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    want = tok.hf.transformers().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == want


def _edited(tokenizer_dir: Path, tmp_path: Path, **config: Any) -> Path:
    path = shutil.copytree(tokenizer_dir, tmp_path / "tok")
    data = json.loads((path / "tokenizer_config.json").read_text())
    data.update(config)
    (path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return path


@pytest.mark.parametrize(
    "config",
    [
        {"tokenizer_class": "LlamaTokenizer"},  # model-specific code may rebuild the pipeline
        {"add_bos_token": False},  # transformers patches the post-processor
        {"clean_up_tokenization_spaces": True},  # decode removes spaces before punctuation
        {"split_special_tokens": True},  # encode spells special tokens as text
        {"eos_token": "<|not-in-the-vocabulary|>"},  # transformers would add it
        {"chat_template": "{{ messages }}"},  # beside chat_template.jinja: which one is ambiguous
        {"added_tokens_decoder": {"3": {"content": "<|other|>", "special": True}}},
    ],
)
def test_anything_transformers_applies_goes_through_it(
    tokenizer_dir: Path, tmp_path: Path, config: dict[str, Any]
) -> None:
    from infer.loader.tokenizer import FastTokenizer, generic_tokenizer

    path = _edited(tokenizer_dir, tmp_path, **config)
    assert generic_tokenizer(path) is None
    if "tokenizer_class" not in config:
        assert not isinstance(Tokenizer(path).hf, FastTokenizer)


def test_special_tokens_written_as_added_tokens_are_read(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Older configs write a special token as ``{"content": ..., "__type": "AddedToken"}``."""
    path = _edited(tokenizer_dir, tmp_path, eos_token={"content": "<|end|>", "__type": "AddedToken"})
    fast = generic_tokenizer_of(path)
    assert fast.eos_token_id == EOS


def generic_tokenizer_of(path: Path) -> Any:
    from infer.loader.tokenizer import generic_tokenizer

    fast = generic_tokenizer(path)
    assert fast is not None
    return fast


def test_an_unreadable_chat_template_is_left_to_transformers(tokenizer_dir: Path, tmp_path: Path) -> None:
    """A ``chat_template.jinja`` that is not UTF-8: no fast tokenizer; transformers' error then
    reaches the user naming the directory, never a bare UnicodeDecodeError."""
    from infer.loader.tokenizer import generic_tokenizer

    path = _edited(tokenizer_dir, tmp_path)
    (path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}\xc3")
    assert generic_tokenizer(path) is None
    with pytest.raises(ValueError, match="could not load a tokenizer") as info:
        Tokenizer(path)
    print(info.value)
    assert str(path) in str(info.value)
