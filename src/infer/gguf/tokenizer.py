"""The tokenizer (and chat template) a GGUF file describes, built once and cached on disk.

Built with the tokenizer class transformers' `AutoTokenizer` would pick, saved under
``~/.cache/infer/tokenizers/<key>/`` (the key: a hash of the file's header and the transformers
version), and loaded later with the `tokenizers` library alone (`FastTokenizer`). See
docs/gguf.md, "Tokenizer".
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from infer.gguf.reader import GGUFFile
from infer.loader.config import ModelConfig
from infer.loader.tokenizer import SPECIAL_TOKENS, FastTokenizer, Tokenizer

CACHE_VERSION = 3  # 2: BPE merges saved as strings (`_compact_merges`); 3: no token past the file's
_MARKER = "infer-tokenizer.json"

TOKENS = "tokenizer.ggml.tokens"
# Metadata keys holding one token id each (llama.cpp's names).
SPECIAL_ID_KEYS = tuple(
    f"tokenizer.ggml.{name}_token_id"
    for name in ("bos", "eos", "eot", "eom", "unknown", "separator", "padding", "cls", "mask")
)
_FLAG_KEYS = tuple(f"tokenizer.ggml.{name}" for name in ("add_bos_token", "add_eos_token", "add_sep_token"))
_STRING_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
_INT_ITEMS = frozenset({0, 1, 2, 3, 4, 5, 10, 11})  # GGUF integer value types
_FLOAT_ITEMS = frozenset({6, 12})
_STRING, _ARRAY = 8, 9


def check_tokenizer_metadata(gguf: GGUFFile, vocab_size: int) -> None:
    """Validate the file's ``tokenizer.*`` metadata before anything uses it.

    ``vocab_size`` token strings, per-token types and scores, string merges, special ids in
    range, boolean flags, string names and template; a ``ValueError`` names the file, the key,
    what was expected and what was found (the table: docs/reliability.md).
    """
    md = gguf.metadata

    def fail(key: str, expected: str) -> ValueError:
        return ValueError(f"{gguf.path}: metadata {key!r}: expected {expected}, found {gguf.describe(key)}")

    if TOKENS not in md:
        raise ValueError(f"{gguf.path}: no tokenizer in the file (no metadata key {TOKENS!r})")
    if gguf.value_types[TOKENS] != (_ARRAY, _STRING):
        raise fail(TOKENS, f"an array of {vocab_size} strings")
    n = len(md[TOKENS])
    if n != vocab_size:
        raise fail(TOKENS, f"{vocab_size} tokens, one per row of token_embd.weight")
    for key, items, what in (
        ("tokenizer.ggml.token_type", _INT_ITEMS, "integers"),
        ("tokenizer.ggml.scores", _FLOAT_ITEMS, "floats"),
    ):
        if key in md:
            types = gguf.value_types[key]
            if types[0] != _ARRAY or types[1] not in items or len(md[key]) != n:
                raise fail(key, f"an array of {n} {what} (one per token)")
    merges = "tokenizer.ggml.merges"
    if merges in md and gguf.value_types[merges] != (_ARRAY, _STRING):
        raise fail(merges, "an array of strings")
    for key in SPECIAL_ID_KEYS:
        value = md.get(key)
        if key in md and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n):
            raise fail(key, f"an integer token id in 0..{n - 1}")
    for key in _FLAG_KEYS:
        if key in md and not isinstance(md[key], bool):
            raise fail(key, "a bool")
    for key in _STRING_KEYS:
        if key in md and not isinstance(md[key], str):
            raise fail(key, "a string")


def _check_merges(gguf: GGUFFile) -> None:
    """Each merge is two tokens of the vocabulary separated by one space (on a cache miss only)."""
    merges = gguf.metadata.get("tokenizer.ggml.merges")
    if merges is None:
        return
    vocab = set(gguf.metadata[TOKENS])
    for i, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab:
            raise ValueError(
                f"{gguf.path}: metadata 'tokenizer.ggml.merges' entry #{i}: expected two tokens of the "
                f"vocabulary separated by a space, found {merge[:100]!r}"
            )


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/infer`` (default ``~/.cache/infer``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "infer"


def _cache_key(gguf: GGUFFile) -> str:
    from importlib.metadata import version  # the version without importing transformers (~1-2 s)

    return f"{gguf.header_digest()[:32]}-tf{version('transformers')}-v{CACHE_VERSION}"


def build_hf_tokenizer(gguf: GGUFFile, model_type: str) -> Any:
    """A transformers tokenizer built from the file's metadata, as `AutoTokenizer` would build it."""
    from transformers import TokenizersBackend
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    if TOKENS not in gguf.metadata:
        raise ValueError(f"{gguf.path}: no tokenizer in the file (no metadata key {TOKENS!r})")
    _check_merges(gguf)
    cls: Any = TOKENIZER_MAPPING.get(CONFIG_MAPPING[model_type], TokenizersBackend)
    try:
        return cls.from_pretrained(str(gguf.path.parent), gguf_file=gguf.path.name)
    except Exception as e:  # transformers / tokenizers on metadata we did not foresee: name the file
        raise ValueError(
            f"{gguf.path}: could not build a tokenizer from the GGUF metadata ({type(e).__name__}: {e})"
        ) from e


def _compact_merges(tokenizer_json: Path) -> None:
    """Rewrite a BPE ``tokenizer.json``'s merges as ``"a b"`` strings, which `tokenizers` reads
    faster than pairs (docs/gguf.md); only when no merged token holds a space (ambiguous)."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    model = data.get("model", {})
    merges = model.get("merges")
    if model.get("type") != "BPE" or not merges or not all(isinstance(m, list) for m in merges):
        return
    if any(len(m) != 2 or " " in m[0] or " " in m[1] for m in merges):
        return
    model["merges"] = [f"{a} {b}" for a, b in merges]
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def _drop_tokens_past(tokenizer_json: Path, vocab_size: int) -> set[str]:
    """Remove the added tokens whose ids are past the file's ``vocab_size`` tokens; their texts.

    transformers' byte-level builder adds GPT-2's ``<|endoftext|>`` as one more id to a vocabulary
    that lacks it; no row of the model produces it and llguidance refuses it ("vocab size too small").
    """
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    added = data.get("added_tokens") or []
    past = {t["content"] for t in added if t["id"] >= vocab_size}
    if past:
        data["added_tokens"] = [t for t in added if t["id"] < vocab_size]
        tokenizer_json.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return past


def _save(hf_tok: Any, target: Path, vocab_size: int) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        hf_tok.save_pretrained(str(tmp))
        _compact_merges(tmp / "tokenizer.json")
        dropped = _drop_tokens_past(tmp / "tokenizer.json", vocab_size)
        special = {name: getattr(hf_tok, name, None) for name in SPECIAL_TOKENS}
        special = {k: v for k, v in special.items() if v is not None and v not in dropped}
        marker = {"class": type(hf_tok).__name__, "special": special}
        (tmp / _MARKER).write_text(json.dumps(marker))
        with contextlib.suppress(OSError):  # another process may have won the race
            tmp.rename(target)  # atomic
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_cached(directory: Path) -> FastTokenizer | None:
    marker_file = directory / _MARKER
    tokenizer_file = directory / "tokenizer.json"
    if not marker_file.is_file() or not tokenizer_file.is_file():
        return None
    try:
        marker = json.loads(marker_file.read_text())
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else None
        return FastTokenizer(tokenizer_file, dict(marker["special"]), template)
    except Exception:  # OSError, bad JSON, or the tokenizers library's own (plain) Exception
        return None  # a damaged cache entry is rebuilt


def gguf_tokenizer(gguf: GGUFFile, config: ModelConfig, *, cache_dir: Path | None = None) -> Tokenizer:
    """The file's tokenizer wrapped in our `Tokenizer`, from the on-disk cache when possible.

    ``cache_dir`` defaults to ``cache_root() / "tokenizers"``; it is written only on a miss.
    """
    check_tokenizer_metadata(gguf, config.vocab_size)
    root = cache_dir if cache_dir is not None else cache_root() / "tokenizers"
    directory = root / _cache_key(gguf)
    hf_tok: Any = _load_cached(directory)
    if hf_tok is None:
        built = build_hf_tokenizer(gguf, config.model_type)
        with contextlib.suppress(OSError):  # a read-only cache only costs speed
            _save(built, directory, config.vocab_size)
        hf_tok = _load_cached(directory)  # the same object a later hit returns
        if hf_tok is None:  # no cache to write: the same files, in a directory of this process's
            private = Path(tempfile.mkdtemp(prefix="infer-tokenizer-"))
            atexit.register(shutil.rmtree, private, True)
            _save(built, private / "tokenizer", config.vocab_size)
            hf_tok = _load_cached(private / "tokenizer") or built
    return Tokenizer.from_hf(hf_tok, eos_token_id=config.eos_token_id)
