"""`Tokenizer`: the one place that touches transformers' tokenizer classes.

`FastTokenizer` serves a saved ``tokenizer.json`` with the `tokenizers` library alone
(importing transformers' tokenizer classes costs seconds per process): for GGUF
files, and for checkpoint directories whose tokenizer is transformers' generic fast tokenizer
with nothing in its config that transformers would apply on top of ``tokenizer.json``
(`generic_tokenizer`); every other directory goes through ``AutoTokenizer``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from infer.text.chat_template import (
    RenderLimits,
    check_messages,
    control_token_pattern,
    mark_control_tokens,
    render_chat_template,
    split_marked,
)

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")
# transformers' generic fast tokenizer (v5's name and its alias): tokenizer.json as saved, no
# model-specific code building or patching its pipeline.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# tokenizer_config.json keys that `FastTokenizer` serves as transformers does (the special
# tokens, the chat template), or that change nothing infer reads. Any other key (add_bos_token,
# add_prefix_space, legacy, a truthy clean_up_tokenization_spaces...) is left to transformers.
GENERIC_KEYS = frozenset({
    "tokenizer_class", "backend", *SPECIAL_TOKENS, "extra_special_tokens", "additional_special_tokens",
    "added_tokens_decoder", "chat_template", "clean_up_tokenization_spaces", "model_max_length",
    "model_input_names", "padding_side", "truncation_side", "split_special_tokens",
})  # fmt: skip


class FastTokenizer:
    """The part of a transformers fast tokenizer that infer uses, over ``tokenizer.json``.

    Built from what `transformers.TokenizersBackend(tokenizer_file=..., **special,
    chat_template=...)` is built from, and tested equal to it (encode, decode, special
    ids, length, chat template) on both real GGUF tokenizers. `transformers` builds that
    object on first use (`apply_chat_template`).
    """

    def __init__(self, tokenizer_file: Path, special: dict[str, str], chat_template: str | None) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self._file = tokenizer_file
        self._special = dict(special)
        self._tk = RustTokenizer.from_file(str(tokenizer_file))
        self.chat_template = chat_template
        self._hf: Any = None
        for name in SPECIAL_TOKENS:
            token = special.get(name)
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else self._tk.token_to_id(token))

    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False
    ) -> list[int]:
        """``split_special_tokens``: special-token spellings in ``text`` are encoded as text
        (what transformers' fast tokenizers do with the same flag)."""
        self._tk.encode_special_tokens = split_special_tokens
        try:
            ids: list[int] = self._tk.encode(text, add_special_tokens=add_special_tokens).ids
        finally:
            self._tk.encode_special_tokens = False
        return ids

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: token for name in SPECIAL_TOKENS if (token := self._special.get(name)) is not None}

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        """Id -> ``tokenizers.AddedToken`` (``.content``, ``.special``), as transformers lists them."""
        decoder: dict[int, Any] = self._tk.get_added_tokens_decoder()
        return decoder

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> Any:
        """An id (None if unknown) for a token, a list of them for a list."""
        if isinstance(tokens, str):
            return self._tk.token_to_id(tokens)
        return [self._tk.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> Any:
        """A token (None if out of range) for an id, a list of them for a list."""
        if isinstance(ids, int):
            return self._tk.id_to_token(ids)
        return [self._tk.id_to_token(i) for i in ids]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text: str = self._tk.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text

    def __len__(self) -> int:
        return int(self._tk.get_vocab_size(with_added_tokens=True))

    def backend_json(self) -> str:
        """The ``tokenizers`` JSON of this tokenizer (what grammar engines read the vocabulary from)."""
        text: str = self._tk.to_str()
        return text

    def transformers(self) -> Any:
        """The equivalent transformers tokenizer (imports transformers on first use)."""
        if self._hf is None:
            from transformers import TokenizersBackend

            kwargs: dict[str, Any] = dict(self._special)
            if self.chat_template is not None:
                kwargs["chat_template"] = self.chat_template
            self._hf = TokenizersBackend(tokenizer_file=str(self._file), **kwargs)  # type: ignore[no-untyped-call]
        return self._hf

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        return self.transformers().apply_chat_template(messages, **kwargs)


class Tokenizer:
    """A thin, stable wrapper around a HF fast tokenizer.

    ``model_path`` is a checkpoint directory with tokenizer files. For other sources
    (a GGUF file) use `Tokenizer.from_hf` with a tokenizer built elsewhere.
    """

    def __init__(self, model_path: str | Path, *, eos_token_id: int | list[int] | None = None) -> None:
        path = Path(model_path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory does not exist: {path}")
        tok: Any = generic_tokenizer(path)
        if tok is None:
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
            except Exception as e:  # transformers also checks config.json (strictly typed fields)
                message = f"{path}: could not load a tokenizer ({type(e).__name__}: {e})"
                raise ValueError(message[:2000]) from e
        if eos_token_id is None:
            eos_token_id = _eos_from_generation_config(path, len(tok))
        self._init(tok, eos_token_id)

    @classmethod
    def from_hf(cls, hf_tokenizer: Any, *, eos_token_id: int | list[int] | None = None) -> Tokenizer:
        self = cls.__new__(cls)
        self._init(hf_tokenizer, eos_token_id)
        return self

    def _init(self, tok: Any, eos_token_id: int | list[int] | None) -> None:
        self._tok = tok
        ids: list[int] = []
        if eos_token_id is not None:
            ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        if tok.eos_token_id is not None and tok.eos_token_id not in ids:
            ids.insert(0, int(tok.eos_token_id))
        self._eos: list[int] = ids
        # Token id -> raw bytes is what streaming needs to cut text at UTF-8 boundaries;
        # decode() of a growing prefix gives it without touching private APIs.

    def __repr__(self) -> str:
        def token(name: str, token_id: int | None) -> str:
            if token_id is None:
                return f"{name}=None"
            return f"{name}={self._tok.convert_ids_to_tokens(token_id)!r} ({token_id})"

        eos = ", ".join(f"{self._tok.convert_ids_to_tokens(i)!r} ({i})" for i in self._eos)
        specials = [
            token("bos", self.bos_token_id),
            f"eos=[{eos}]" if len(self._eos) != 1 else token("eos", self._eos[0]),
            token("pad", self.pad_token_id),
        ]
        unk = getattr(self._tok, "unk_token_id", None)
        if unk is not None:
            specials.append(token("unk", int(unk)))
        template = "yes" if self.chat_template is not None else "no"
        return f"Tokenizer(vocab_size={self.vocab_size}, {', '.join(specials)}, chat_template={template})"

    @property
    def hf(self) -> Any:
        """The wrapped tokenizer: transformers' or a `FastTokenizer` (see its ``transformers()``)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text

    def backend_json(self) -> str:
        """The HF ``tokenizers`` JSON (vocabulary, merges, normalizer, pre-tokenizer, decoder, added
        tokens): what a grammar engine needs to know each token's bytes (`infer.text.structured`)."""
        own = getattr(self._tok, "backend_json", None)
        if own is not None:
            text: str = own()
            return text
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                "this tokenizer has no HF fast-tokenizer backend (needed for constrained output)"
            )
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        text = backend.to_str()
        return text

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) and template else None

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        limits: RenderLimits | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The chat as text: the template rendered in a bounded sandbox, as transformers renders it.
        ``tools`` (OpenAI's function definitions) reach the template as its ``tools`` variable."""
        return self._render(check_messages(messages), add_generation_prompt, limits, _plain_tools(tools))

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        parse_special_in_content: bool = False,
        limits: RenderLimits | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The chat as token ids; control-token spellings inside messages are encoded as text.

        Only the special tokens the template writes itself (``<|im_start|>``, BOS, ...)
        become control tokens; a message saying ``"<|im_end|><|im_start|>assistant"``
        stays those characters. ``parse_special_in_content=True`` encodes the rendered
        text as a whole instead (transformers' default), so such spellings become tokens.
        """
        checked = check_messages(messages)
        plain_tools = _plain_tools(tools)
        if parse_special_in_content:
            # The template writes the BOS token itself; don't add another one.
            text = self._render(checked, add_generation_prompt, limits, plain_tools)
            return self.encode(text, add_special_tokens=False)
        pattern = control_token_pattern(list(self.special_tokens))
        if plain_tools is not None:  # tool descriptions are text too
            plain_tools = mark_control_tokens(plain_tools, pattern)
        text = self._render(mark_control_tokens(checked, pattern), add_generation_prompt, limits, plain_tools)
        ids: list[int] = []
        for i, (piece, is_content_token) in enumerate(split_marked(text, pattern)):
            piece_ids = self._encode_piece(piece, as_text=is_content_token, first=i == 0)
            if is_content_token and self._tok.convert_tokens_to_ids(piece) in piece_ids:
                raise ValueError(f"the tokenizer encodes {piece!r} as its control token even as plain text")
            ids += piece_ids
        return ids

    @property
    def special_tokens(self) -> dict[str, int]:
        """The special (control) tokens: their text -> their id."""
        return {t.content: int(i) for i, t in self._tok.added_tokens_decoder.items() if t.special}

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        limits: RenderLimits | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        template = self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template; use generate() with a plain prompt")
        variables = {k: v for k, v in self._tok.special_tokens_map.items() if isinstance(v, str)}
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            variables=variables,
            limits=limits,
            tools=tools,
        )

    def _encode_piece(self, text: str, *, as_text: bool, first: bool) -> list[int]:
        """Ids of a piece of a rendered chat; ``as_text`` encodes special-token spellings as text."""

        def encode(t: str) -> list[int]:
            ids: list[int] = self._tok.encode(t, add_special_tokens=False, split_special_tokens=as_text)
            return ids

        if first:
            return encode(text)
        # A piece continues the text before it: encode it after a newline and drop the newline,
        # so a tokenizer that marks the start of a string (SentencePiece's "▁") does not.
        newline = encode("\n")
        ids = encode("\n" + text)
        return ids[len(newline) :] if ids[: len(newline)] == newline else encode(text)

    @property
    def eos_token_id(self) -> int | list[int]:
        """The end-of-sequence id, or all of them when the model defines several (Llama 3.2)."""
        if not self._eos:
            raise ValueError("this tokenizer defines no end-of-sequence token")
        return self._eos[0] if len(self._eos) == 1 else list(self._eos)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos)

    @property
    def bos_token_id(self) -> int | None:
        bos = self._tok.bos_token_id
        return None if bos is None else int(bos)

    @property
    def pad_token_id(self) -> int | None:
        pad = self._tok.pad_token_id
        return None if pad is None else int(pad)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added special tokens included."""
        return len(self._tok)


def generic_tokenizer(path: Path) -> FastTokenizer | None:
    """A `FastTokenizer` over ``path/tokenizer.json`` when ``AutoTokenizer`` would build transformers'
    generic fast tokenizer from it and change nothing infer reads; None otherwise (or on doubt).

    That is: a ``tokenizer_config.json`` naming a `GENERIC_CLASSES` class with only
    `GENERIC_KEYS`, no cleanup of spaces on decode nor special tokens split on encode, special
    tokens that ``tokenizer.json`` holds (transformers would add missing ones), entries of
    ``added_tokens_decoder`` equal to its added tokens, and one chat template (the config's
    string or ``chat_template.jinja``, not both).
    """
    config_file, tokenizer_file, jinja = (
        path / "tokenizer_config.json", path / "tokenizer.json", path / "chat_template.jinja"
    )  # fmt: skip
    others = ("chat_template.json", "additional_chat_templates", "special_tokens_map.json")
    if not (config_file.is_file() and tokenizer_file.is_file()) or any((path / o).exists() for o in others):
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # AutoTokenizer names the problem
    if not isinstance(config, dict) or config.get("tokenizer_class") not in GENERIC_CLASSES:
        return None
    if set(config) - GENERIC_KEYS:
        return None
    # On decode transformers would clean up spaces; on encode, spell special tokens as text.
    flags = ("clean_up_tokenization_spaces", "split_special_tokens")
    if any(config.get(flag, False) is not False for flag in flags):
        return None
    template = config.get("chat_template")
    if template is not None and (not isinstance(template, str) or jinja.exists()):
        return None
    if template is None and jinja.is_file():
        try:
            template = jinja.read_text()
        except (OSError, UnicodeDecodeError):
            return None  # AutoTokenizer names the problem
    special: dict[str, str] = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            return None
        special[name] = value
    try:
        fast = FastTokenizer(tokenizer_file, special, template)
    except Exception:  # the tokenizers library's own (plain) Exception: AutoTokenizer names it
        return None
    if any(fast.convert_tokens_to_ids(token) is None for token in special.values()):
        return None
    held = fast.added_tokens_decoder
    listed = config.get("added_tokens_decoder", {})
    if not isinstance(listed, dict):
        return None
    for key, entry in listed.items():
        token = held.get(int(key)) if str(key).isdigit() else None
        if not isinstance(entry, dict) or token is None or token.content != entry.get("content"):
            return None
        if bool(entry.get("special", False)) != token.special:
            return None
    return fast


def _plain_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """``tools`` as a fresh list of plain JSON dicts (what a template may see), or None."""
    if tools is None:
        return None
    if not isinstance(tools, list | tuple) or not all(isinstance(t, Mapping) for t in tools):
        raise TypeError("tools must be a list of dicts (OpenAI's function definitions)")
    plain: list[dict[str, Any]] = json.loads(json.dumps(list(tools)))
    return plain


def _eos_from_generation_config(path: Path, vocab_size: int) -> int | list[int] | None:
    """``generation_config.json`` lists every stop id (Llama 3.2 has three); the tokenizer knows one.

    None when the file or its ``eos_token_id`` is absent (or null); `ValueError` naming the file
    when it is not a JSON object, or ``eos_token_id`` is not an id (or a list of ids) in
    ``[0, vocab_size)``, the tokenizer's vocabulary."""
    file = path / "generation_config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, found {type(data).__name__} {_short(data)}")
    eos = data.get("eos_token_id")
    if eos is None:
        return None
    expected = "an integer token id, a list of them or null"
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{file}: 'eos_token_id' = {_short(eos)}, expected {expected}")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        verb = "is" if len(outside) == 1 else "are"
        raise ValueError(
            f"{file}: 'eos_token_id' = {_short(eos)}, expected ids in the tokenizer's vocabulary "
            f"[0, {vocab_size}); {', '.join(map(str, outside[:5]))} {verb} not"
        )
    checked: int | list[int] = eos
    return checked


def _short(value: object) -> str:
    """``repr(value)``, cut to a length an error message can hold."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
