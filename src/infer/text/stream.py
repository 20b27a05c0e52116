"""A request's text: its generated tokens decoded incrementally, stop strings found and cut.

`TextStream` turns a growing list of token ids into text pieces. Each push decodes a window of
the last few tokens, not the whole generation (vLLM's and TGI's incremental detokenizing: the
window starts one read back, so a decoder that treats a sequence's first token differently
treats both decodes of the window alike), so a token costs the same at token 10 and at token
4,000. A piece never splits a UTF-8 character (a window that ends in an incomplete one waits
for the next token), and the end of the text is held back while it could be the start of a
stop string. `finish` decodes the whole generation once, cuts it at the first stop string, and
returns what was not sent yet: the pieces and the final text always join to exactly
``cut_at_stop(decode(tokens), stops)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


def stop_prefix(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``stops`` (a proper prefix)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``(text before the first stop string, whether one was found)``."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class TextStream:
    """The text of a growing list of token ids, decoded incrementally (see the module's docstring).

    ``push(tokens, stops)`` takes the whole list (it must extend the last one) and returns the new
    text that is safe to send; ``stopped`` is set when the text holds one of ``stops`` (the pieces
    then end before it). ``emitted`` is what was sent so far.
    """

    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = ""
        self.stopped = False
        self._text = ""  # the decoded text of tokens[:_read]
        self._prefix = 0  # the window's first token: decoded again with the new ones
        self._read = 0  # tokens decoded into _text

    def text(self) -> str:
        """The whole text of the tokens pushed so far (one full decode)."""
        return self.tokenizer.decode(self.tokens)

    def _advance(self) -> None:
        if self._read >= len(self.tokens):
            return
        decode = self.tokenizer.decode
        before = decode(self.tokens[self._prefix : self._read])
        after = decode(self.tokens[self._prefix :])
        if after.endswith("\ufffd"):
            return  # an incomplete multi-byte character: wait for the next token
        if after.startswith(before):
            self._text += after[len(before) :]
        else:  # the window decodes differently on its own (a decoder's clean-up): decode it all once
            full = decode(self.tokens)
            if full.endswith("\ufffd"):
                return
            self._text = full
        self._prefix, self._read = self._read, len(self.tokens)

    def push(self, tokens: list[int], stops: Sequence[str] = ()) -> str:
        """Take the tokens (the previous ones and new ones) and return the new safe text.

        The text's end is kept back while it could be the start of one of the ``stops``
        strings: at most ``L - 1`` characters for a longest stop string of ``L``, and
        only as long as they match a stop string's beginning.
        """
        if len(tokens) < len(self.tokens) or tokens[: len(self.tokens)] != self.tokens:
            self.__init__(self.tokenizer)  # type: ignore[misc]  # not a continuation: start over
        self.tokens = list(tokens)
        self._advance()
        full = self._text
        if stops:
            longest = max(len(s) for s in stops)
            start = max(0, len(self.emitted) - longest + 1)  # a stop string may straddle the sent text
            cut, found = cut_at_stop(full[start:], stops)
            if found:
                self.stopped = True
                full = full[: start + len(cut)]
                piece = full[len(self.emitted) :] if full.startswith(self.emitted) else ""
                self.emitted += piece
                return piece
        safe = full[: max(len(self.emitted), len(full) - stop_prefix(full, stops))]
        piece = safe[len(self.emitted) :] if safe.startswith(self.emitted) else ""
        self.emitted += piece
        return piece

    def finish(self, tokens: list[int], stops: Sequence[str] = ()) -> str:
        """The rest of the text of ``tokens`` (all of them) cut at the first stop string: one full
        decode, so the pieces and this always join to exactly the cut decoded text."""
        self.tokens = list(tokens)
        final = cut_at_stop(self.tokenizer.decode(self.tokens), stops)[0]
        rest = final[len(self.emitted) :] if final.startswith(self.emitted) else ""
        self.emitted += rest
        return rest


__all__ = ["Decoder", "TextStream", "cut_at_stop", "stop_prefix"]
