"""`Choice`: one choice of a response, what its engine request produced, and (chat with tools) the
calls read out of its reply. While streaming, text that may begin a call is held back, so a
client never sees a call's markup as content."""

from __future__ import annotations

from typing import TYPE_CHECKING

from infer.engine import Delta, TokenLogprob
from infer.serve.client import HandleClient
from infer.text.prompts import ToolChat, read_reply
from infer.text.tools import ToolCall, ToolFormat

if TYPE_CHECKING:
    from infer.engine import ServedModel


def finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason as OpenAI's (an EOS token is "stop")."""
    return "stop" if reason in ("stop", "eos") else reason


class Choice:
    """One choice of a response: its engine request and what it produced. With tools offered
    (chat), the reply is read for calls at its end (`infer.text.prompts.read_reply`), and while
    streaming, text that may begin a call is held back (`ToolFormat.call_start` / ``hold``)."""

    def __init__(
        self, index: int, handle: HandleClient, chat: ToolChat | None, specials: dict[str, int]
    ) -> None:
        self.index, self.handle, self.chat = index, handle, chat
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.text_offset = 0  # completions' logprobs
        self.first = True  # no chunk sent yet
        self.reason: str | None = None
        self.calls: list[ToolCall] = []
        self.content = ""
        self.emitted = ""  # content streamed so far
        self.call_at: int | None = None  # where, in the text, calls begin
        fmt = self.format
        self._marker_ids = {specials[m] for m in fmt.markers if m in specials} if fmt is not None else set()

    @property
    def format(self) -> ToolFormat | None:
        """The tool-call format its reply is read in (None: no tools offered)."""
        return None if self.chat is None else self.chat.format

    def take(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)

    def stream_content(self, delta: Delta) -> str:
        """The new content of this delta that cannot be part of a call (everything without tools)."""
        fmt = self.format
        if fmt is None:
            return delta.text
        seen = "".join(self.text)
        if self.call_at is None:
            if self._marker_ids.intersection(delta.token_ids):  # a call opened with a control token
                self.call_at = len(seen) - len(delta.text)
            else:
                self.call_at = fmt.call_start(seen)
        upto = self.call_at if self.call_at is not None else len(seen) - fmt.hold(seen)
        upto = len(seen[:upto].rstrip())  # whitespace before a call is not content: it waits
        piece = seen[len(self.emitted) : upto] if upto > len(self.emitted) else ""
        self.emitted += piece
        return piece

    def end(self, model: ServedModel, reason: str | None) -> None:
        """The final event came: read the calls out of the reply (when tools were offered)."""
        text = "".join(self.text)
        self.reason, self.content = reason, text
        if self.chat is not None and self.chat.format is not None:
            cut = reason == "length"  # a reply cut inside its calls ended by length, not in calls
            self.content, self.calls = read_reply(model, self.chat, self.token_ids, text, cut=cut)
            if self.calls and not cut:
                self.reason = "tool_calls"

    def rest(self) -> str:
        """Streaming, at the end: the content not streamed yet."""
        if self.format is None or not self.content.startswith(self.emitted):
            return ""
        return self.content[len(self.emitted) :]


__all__ = ["Choice", "finish_reason"]
