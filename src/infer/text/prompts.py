"""How a user's text becomes a prompt: the one place `infer.LLM`, `infer generate`, `infer chat` and
`infer serve` share.

`encode_prompt` checks and encodes a prompt, `chat_prompt` renders a conversation; a user's text
to an instruct model becomes a user message with the assistant's turn opened unless ``raw``.
`tool_chat` renders a chat with tools; `read_reply` takes the calls out of the reply.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from infer.params import check_unicode
from infer.text.structured import Constraint
from infer.text.tools import Tool, ToolCall, ToolFormat, check_tools, tool_choice_of, tool_format

# A tokenizer is `infer.loader.tokenizer.Tokenizer` (a floor above: typed loosely here).
Tokenizer = Any

Message = dict[str, Any]


def encode_prompt(tokenizer: Tokenizer, vocab_size: int, prompt: Any, what: str = "prompt") -> list[int]:
    """One prompt (a string, or a list of token ids) as checked token ids (``what`` names it in errors):
    a string non-empty, valid Unicode and encoding to some tokens; ids ints in [0, vocab_size)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{what} is empty (an empty string)")
        check_unicode(what, prompt)
        ids: list[int] = tokenizer.encode(prompt)
        if not ids:
            raise ValueError(f"{what} encodes to no tokens")
        return ids
    if not isinstance(prompt, list | tuple):
        raise TypeError(f"{what} must be a string or a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError(f"{what} is empty (an empty list of token ids)")
    for t in prompt:
        if isinstance(t, bool) or not hasattr(type(t), "__index__"):
            raise TypeError(f"{what}: token ids must be ints, found {t!r} ({type(t).__name__})")
        if not 0 <= operator.index(t) < vocab_size:
            raise ValueError(f"{what}: token id {t} is out of range [0, {vocab_size})")
    return [operator.index(t) for t in prompt]


def chat_prompt(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    *,
    parse_special_in_content: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The token ids of ``messages`` (and ``tools``' definitions) rendered by ``tokenizer``'s chat
    template, with the assistant's turn opened."""
    if not isinstance(parse_special_in_content, bool):
        raise TypeError(f"parse_special_in_content must be a bool, got {parse_special_in_content!r}")
    ids: list[int] = tokenizer.encode_chat(
        messages, add_generation_prompt=True, parse_special_in_content=parse_special_in_content, tools=tools
    )
    return ids


def has_chat_template(llm: Any) -> bool:
    """Whether ``llm``'s tokenizer carries a chat template."""
    return getattr(llm.tokenizer, "chat_template", None) is not None


def user_messages(text: str, system: str | None = None) -> list[Message]:
    """``text`` as a one-turn conversation (after ``system``'s message when given)."""
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    return messages


def chat_ids(llm: Any, messages: Sequence[Message]) -> list[int]:
    """The token ids of ``messages`` rendered by ``llm``'s chat template, the assistant's turn opened.

    `ValueError` when the model has no chat template (it names the way out: a plain prompt).
    """
    if not has_chat_template(llm):
        raise ValueError("this model's tokenizer has no chat template: send a plain prompt (completions)")
    return chat_prompt(llm.tokenizer, messages)


def prompt_ids(llm: Any, text: str, *, raw: bool = False, system: str | None = None) -> str | list[int]:
    """What to generate from for a user's ``text``: the chat-templated ids, or ``text`` itself.

    The text itself (encoded by `LLM.generate`) when ``raw`` or the model has no chat
    template; an empty ``text`` is a `ValueError` either way (a template would hide it).
    """
    if not isinstance(text, str):
        raise TypeError(f"prompt must be a string, got {type(text).__name__}")
    if raw or not has_chat_template(llm):
        if system:
            raise ValueError(
                "--system needs a chat template; this is a plain completion (--raw or no template)"
            )
        return text  # checked where it is encoded (`encode_prompt`)
    if not text:
        raise ValueError("prompt is empty (an empty string)")
    check_unicode("prompt", text)
    return chat_ids(llm, user_messages(text, system))


@dataclass
class ToolChat:
    """A chat rendered for generation: its ids, the constraint to generate under, and (with tools)
    the format its calls are read in (`read_reply`)."""

    ids: list[int]
    constraint: Constraint | None = None
    format: ToolFormat | None = None  # None: no tools offered (or tool_choice "none")
    tools: list[Tool] = field(default_factory=list)
    choice: str = "none"
    parallel: bool = True


def tool_chat(
    llm: Any,
    messages: Sequence[Message],
    *,
    tools: Any = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
    constraint: Constraint | None = None,
    parse_special_in_content: bool = False,
) -> ToolChat:
    """Render ``messages`` (OpenAI's: assistant ``tool_calls``, ``role: "tool"`` results) with
    ``tools`` for ``llm``'s template, and the constraint to generate under.

    ``tool_choice``: ``"none"`` (tools are not shown; no calls), ``"auto"`` (the default with tools:
    the model decides; the reply is read for calls), ``"required"`` or a function's name
    (generation is constrained to one call — or, ``parallel_tool_calls``, one or more — of the
    offered functions, each valid JSON matching its ``parameters``). ``constraint`` (a JSON schema
    for the answer, OpenAI's ``response_format``) applies to a reply that is not a call: with
    ``"auto"`` the reply is either such an answer or calls.
    """
    if not has_chat_template(llm):
        raise ValueError("this model's tokenizer has no chat template: send a plain prompt (completions)")
    if not isinstance(parallel_tool_calls, bool):
        raise TypeError(f"parallel_tool_calls must be a bool, got {parallel_tool_calls!r}")
    offered = check_tools(tools) if tools is not None else []
    choice = tool_choice_of(tool_choice, offered)
    tokenizer = llm.tokenizer
    fmt = tool_format(tokenizer.chat_template)
    if choice == "none":  # no tools shown; earlier calls and results in the history still render
        prepared = fmt.prepare(messages, [])
        ids = chat_prompt(tokenizer, prepared, parse_special_in_content=parse_special_in_content)
        return ToolChat(ids, constraint)
    prepared = fmt.prepare(messages, offered)
    shown = [t.openai() for t in offered] if fmt.renders_tools else None
    ids = chat_prompt(tokenizer, prepared, parse_special_in_content=parse_special_in_content, tools=shown)
    specials = tokenizer.special_tokens

    def lit(text: str) -> str:
        return f"<[{specials[text]}]>" if text in specials else json.dumps(text)

    if choice == "auto":
        if constraint is None:
            return ToolChat(ids, None, fmt, offered, choice, parallel_tool_calls)
        calls = fmt.grammar(offered, parallel_tool_calls, lit).replace("start:", "calls:", 1)
        grammar = f"start: answer | calls\nanswer: {_inline(constraint)}\n{calls}"
        return ToolChat(ids, Constraint.grammar(grammar), fmt, offered, choice, parallel_tool_calls)
    chosen = offered if choice == "required" else [t for t in offered if t.name == choice]
    grammar = fmt.grammar(chosen, parallel_tool_calls and choice == "required", lit)
    return ToolChat(ids, Constraint.grammar(grammar), fmt, offered, choice, parallel_tool_calls)


def _inline(constraint: Constraint) -> str:
    """A constraint as a Lark rule body (only JSON schemas combine with tool calls)."""
    if constraint.kind != "json_schema":
        raise ValueError("with tools, only a JSON schema constraint (response_format) can shape the answer")
    from infer.text.structured import JSON_OPTIONS

    schema = json.loads(constraint.source)
    schema["x-guidance"] = JSON_OPTIONS
    return "%json " + json.dumps(schema, separators=(",", ":"))


def read_reply(
    llm: Any, chat: ToolChat, token_ids: Sequence[int], text: str, *, cut: bool = False
) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of a reply to ``chat``: the calls in the model's format, the content the
    text around them (``text`` itself when there are none, or no tools were offered). ``cut``: the
    reply ran out of tokens, so markup that opens a call and did not parse is an unfinished call,
    not content, and is dropped."""
    if chat.format is None:
        return text, []
    tokenizer = llm.tokenizer
    full = tokenizer.decode(
        list(token_ids), skip_special_tokens=False
    )  # calls may begin with a control token
    content, calls = chat.format.parse(full)
    unfinished = chat.format.call_start(content) if cut else None
    if not calls and unfinished is None:
        return text, []
    if unfinished is not None:
        content = content[:unfinished]
    for special in sorted(tokenizer.special_tokens, key=len, reverse=True):
        content = content.replace(special, "")
    if not chat.parallel:
        calls = calls[:1]
    return content.strip(), calls


__all__ = [
    "ToolChat",
    "chat_ids",
    "chat_prompt",
    "encode_prompt",
    "has_chat_template",
    "prompt_ids",
    "read_reply",
    "tool_chat",
    "user_messages",
]
