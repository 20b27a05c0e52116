"""What `infer chat` does with a conversation that outgrows the context, and with bad bytes.

`fit_history` drops the oldest turns (never the system prompt, never the new message)
until the rendered chat fits; `repair_utf8` turns what a terminal or a pipe sent as
undecodable bytes into U+FFFD, so one bad byte does not end the conversation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Message = dict[str, str]


def fit_history(
    messages: Sequence[Message], encode: Callable[[list[Message]], list[int]], limit: int
) -> tuple[list[Message], int]:
    """``(messages that fit in limit tokens, how many were dropped)``; ``([], 0)`` if none can.

    The oldest turns go first, a turn being a user message with the replies after it
    (chat templates want user / assistant to alternate); a leading system message and
    the last message (the new one) always stay. ``encode`` renders messages to ids.
    """
    kept = list(messages)
    start = 1 if kept and kept[0].get("role") == "system" else 0
    dropped = 0
    while len(encode(kept)) > limit:
        if len(kept) - start <= 1:  # the new message alone (with the system prompt) does not fit
            return [], 0
        end = start + 1
        while end < len(kept) - 1 and kept[end].get("role") != "user":
            end += 1  # the replies to the dropped message go with it
        dropped += end - start
        del kept[start:end]
    return kept, dropped


def repair_utf8(text: str) -> tuple[str, bool]:
    """``text`` with undecodable input replaced by U+FFFD, and whether anything was.

    Bytes a stream could not decode arrive as lone surrogates (``errors="surrogateescape"``,
    Python's default for stdin under the C locale): they become U+FFFD, as would any other
    lone surrogate.
    """
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # surrogates that are not escaped bytes
        raw = text.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace"), True


__all__ = ["fit_history", "repair_utf8"]
