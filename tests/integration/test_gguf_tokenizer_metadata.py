"""GGUF tokenizer metadata is validated before use (issue 10).

Special token ids out of range, a token list of the wrong type or length, ``token_type``
/ ``scores`` / ``merges`` of the wrong type or length: each is a ``ValueError`` naming
the file, the key, what was expected and what was found — not an ``IndexError`` /
``TypeError`` from inside transformers, and not a model that silently never stops
(an end-of-text id no token can have).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFValueType, GGUFWriter
from gguf_copy import copy_tensors_and_close

import infer
from infer.gguf import GGUFFile, config_from_gguf
from infer.gguf.tokenizer import check_tokenizer_metadata
from infer.gguf.writer import write_gguf
from infer.realmodels import gemma3_270m_path, smollm2_path
from infer.testing import build_tokenizer, tiny_hf_model

V = GGUFValueType
Change = tuple[GGUFValueType, Any, GGUFValueType | None] | None  # (type, value, item type); None drops


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok-meta")
    model = tiny_hf_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return write_gguf(d / "good.gguf", model, build_tokenizer(d / "tok"), qtype="Q8_0")


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def with_metadata(src: Path, dst: Path, changes: dict[str, Change]) -> Path:
    """A copy of ``src`` with metadata ``changes`` applied (same tensors)."""
    f = GGUFFile(src)
    w = GGUFWriter(str(dst), f.architecture)
    entries: dict[str, Change] = {}
    for key, value in f.metadata.items():
        types = f.value_types[key]
        if types[0] == V.ARRAY:
            entries[key] = (V.ARRAY, value.tolist(), V(types[1]))
        else:
            entries[key] = (V(types[0]), value, None)
    entries.update(changes)
    for key, entry in entries.items():
        if key != "general.architecture" and entry is not None:
            w.add_key_value(key, entry[1], entry[0], entry[2])
    copy_tensors_and_close(f, w)
    return dst


def vocab_of(path: Path) -> tuple[int, list[str]]:
    tokens = GGUFFile(path).metadata["tokenizer.ggml.tokens"].tolist()
    return len(tokens), tokens


def test_the_tiny_file_loads(good: Path) -> None:
    llm = infer.load(good)
    assert len(llm.generate("hello", max_new_tokens=3).token_ids) == 3


@pytest.mark.realmodel
def test_real_files_pass(good: Path) -> None:
    for path in (smollm2_path(), gemma3_270m_path()):
        gguf = GGUFFile(path)
        check_tokenizer_metadata(gguf, config_from_gguf(gguf).vocab_size)


def cases(n: int, tokens: list[str]) -> dict[str, tuple[dict[str, Change], str, str]]:
    """name -> (changes, key named in the error, what the error says was found)."""
    tt, sc, mg = "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.merges"
    return {
        "eos = vocab": ({"tokenizer.ggml.eos_token_id": (V.UINT32, n, None)}, "eos_token_id", f"uint32 {n}"),
        "eos = 2^32-1": (
            {"tokenizer.ggml.eos_token_id": (V.UINT32, 2**32 - 1, None)},
            "eos_token_id",
            "uint32 4294967295",
        ),
        "eos = -1": ({"tokenizer.ggml.eos_token_id": (V.INT32, -1, None)}, "eos_token_id", "int32 -1"),
        "eos a string": (
            {"tokenizer.ggml.eos_token_id": (V.STRING, "2", None)},
            "eos_token_id",
            "string '2'",
        ),
        "eos a bool": ({"tokenizer.ggml.eos_token_id": (V.BOOL, True, None)}, "eos_token_id", "bool True"),
        "bos >= vocab": (
            {"tokenizer.ggml.bos_token_id": (V.UINT32, n + 5, None)},
            "bos_token_id",
            str(n + 5),
        ),
        "pad >= vocab": (
            {"tokenizer.ggml.padding_token_id": (V.UINT32, n, None)},
            "padding_token_id",
            str(n),
        ),
        "eot >= vocab": ({"tokenizer.ggml.eot_token_id": (V.UINT32, n, None)}, "eot_token_id", str(n)),
        "eom >= vocab": (
            {"tokenizer.ggml.eom_token_id": (V.UINT64, 2**40, None)},
            "eom_token_id",
            str(2**40),
        ),
        "unk >= vocab": (
            {"tokenizer.ggml.unknown_token_id": (V.UINT32, n, None)},
            "unknown_token_id",
            str(n),
        ),
        "tokens of ints": (
            {"tokenizer.ggml.tokens": (V.ARRAY, list(range(n)), V.INT32)},
            "tokens",
            f"an array of {n} int32",
        ),
        "tokens a string": ({"tokenizer.ggml.tokens": (V.STRING, "abc", None)}, "tokens", "string 'abc'"),
        "tokens too short": (
            {"tokenizer.ggml.tokens": (V.ARRAY, tokens[:100], V.STRING)},
            "tokens",
            "an array of 100 string",
        ),
        "tokens too long": (
            {"tokenizer.ggml.tokens": (V.ARRAY, [*tokens, "extra"], V.STRING)},
            "tokens",
            f"an array of {n + 1} string",
        ),
        "token_type too short": ({tt: (V.ARRAY, [1] * 10, V.INT32)}, "token_type", "an array of 10 int32"),
        "token_type of strings": (
            {tt: (V.ARRAY, ["1"] * n, V.STRING)},
            "token_type",
            f"an array of {n} string",
        ),
        "token_type a scalar": ({tt: (V.INT32, 1, None)}, "token_type", "int32 1"),
        "scores too short": ({sc: (V.ARRAY, [0.0] * 3, V.FLOAT32)}, "scores", "an array of 3 float32"),
        "scores of strings": ({sc: (V.ARRAY, ["x"] * n, V.STRING)}, "scores", f"an array of {n} string"),
        "merges of ints": ({mg: (V.ARRAY, [1, 2, 3], V.INT32)}, "merges", "an array of 3 int32"),
        "merges without a space": ({mg: (V.ARRAY, ["abc"], V.STRING)}, "merges' entry #0", "'abc'"),
        "merges of 3 parts": ({mg: (V.ARRAY, [f"{tokens[70]} {tokens[71]} x"], V.STRING)}, "merges", "#0"),
        "merges of unknown tokens": ({mg: (V.ARRAY, ["zzzz qqqq"], V.STRING)}, "merges", "'zzzz qqqq'"),
        "model a number": ({"tokenizer.ggml.model": (V.UINT32, 3, None)}, "tokenizer.ggml.model", "uint32 3"),
        "chat template a number": (
            {"tokenizer.chat_template": (V.UINT32, 3, None)},
            "chat_template",
            "uint32",
        ),
        "add_bos a string": ({"tokenizer.ggml.add_bos_token": (V.STRING, "yes", None)}, "add_bos", "'yes'"),
    }


NAMES = list(cases(1, ["a"] * 80))


@pytest.mark.parametrize("name", NAMES)
def test_bad_tokenizer_metadata(good: Path, tmp_path: Path, name: str) -> None:
    n, tokens = vocab_of(good)
    changes, key, found = cases(n, tokens)[name]
    bad = with_metadata(good, tmp_path / "bad.gguf", changes)
    with pytest.raises(ValueError) as info:
        infer.load(bad)
    message = str(info.value)
    print(f"{name}: {message}")
    assert str(bad) in message
    assert key in message and "expected" in message and found in message


def test_unknown_tokenizer_model_names_the_file(good: Path, tmp_path: Path) -> None:
    bad = with_metadata(good, tmp_path / "bad.gguf", {"tokenizer.ggml.model": (V.STRING, "bert-ish", None)})
    with pytest.raises(ValueError, match="could not build a tokenizer") as info:
        infer.load(bad)
    assert str(bad) in str(info.value) and "bert-ish" in str(info.value)


def test_config_refuses_out_of_range_special_ids(good: Path, tmp_path: Path) -> None:
    """`config_from_gguf` (and so `infer inspect`) refuses an eot id no token has, naming the key."""
    n, _ = vocab_of(good)
    bad = with_metadata(good, tmp_path / "bad.gguf", {"tokenizer.ggml.eot_token_id": (V.UINT32, n, None)})
    with pytest.raises(ValueError, match="eot_token_id"):
        config_from_gguf(GGUFFile(bad))


@pytest.mark.parametrize("cache", ["written", "unwritable"])
def test_the_tokenizer_holds_the_files_tokens_only(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: str
) -> None:
    """transformers' byte-level builder adds GPT-2's ``<|endoftext|>`` to a vocabulary without it (as
    Llama 3's is): one id past the model's rows, which made llguidance refuse every constraint
    ("vocab size too small; 272 vs 273"). The tokenizer holds the file's tokens, as llama.cpp's,
    also where no cache can be written (its directory's parent is a file)."""
    if cache == "unwritable":
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    n, tokens = vocab_of(good)
    assert "<|endoftext|>" not in tokens
    llm = infer.load(good, cache=False)
    assert llm.tokenizer.vocab_size == n == llm.model.vocab_size
    result = llm.generate("Hi", max_new_tokens=4, json_schema={"type": "object"})
    assert result.text.startswith("{"), result.text
