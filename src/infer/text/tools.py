"""Tool calls: how each model family is told about tools, how its calls read, and a grammar for them.

A `ToolFormat` is one family's syntax (``hermes``, ``llama3``, ``mistral``, ``generic``), picked
from the chat template (`tool_format`); `ToolFormat.grammar` constrains ``tool_choice:
"required"`` or a named function. The formats: docs/structured.md, "Tool calls".
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from infer.text.structured import JSON_OPTIONS

Message = dict[str, Any]
Literal = Callable[[str], str]  # text -> a Lark expression matching it (a string, or a special token)

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, description and the JSON schema of its arguments."""

    name: str
    description: str | None
    parameters: Mapping[str, Any]

    def openai(self) -> dict[str, Any]:
        """As OpenAI (and chat templates) take it: ``{"type": "function", "function": {...}}``."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass
class ToolCall:
    """One call the model made: an id, the function's name, its arguments (parsed JSON)."""

    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments_json},
        }


def check_tools(tools: Any) -> list[Tool]:
    """``tools`` (OpenAI's ``[{"type": "function", "function": {"name", "description",
    "parameters"}}]``, or the inner function dicts) as `Tool` s; errors name ``tools[i]``."""
    if not isinstance(tools, list | tuple):
        raise TypeError(f"tools must be a list of function definitions, got {type(tools).__name__}")
    out: list[Tool] = []
    for i, item in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(item, Mapping):
            raise TypeError(f"{where} must be a dict, got {type(item).__name__}")
        function: Any = item
        if "function" in item or "type" in item:
            if item.get("type", "function") != "function":
                raise ValueError(f"{where}.type must be 'function', got {item.get('type')!r}")
            function = item.get("function")
            where += ".function"
            if not isinstance(function, Mapping):
                raise TypeError(f"{where} must be a dict with a 'name'")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"{where}.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise TypeError(f"{where}.description must be a string")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise TypeError(f"{where}.parameters must be a JSON schema (a dict)")
        if any(t.name == name for t in out):
            raise ValueError(f"{where}.name: {name!r} is offered twice")
        out.append(Tool(name, description, dict(parameters)))
    return out


def tool_choice_of(choice: Any, tools: Sequence[Tool]) -> str:
    """``"none"``, ``"auto"``, ``"required"`` or a function's name, from OpenAI's ``tool_choice``
    (a string, or ``{"type": "function", "function": {"name": ...}}``)."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}")
        if choice != "none" and not tools:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        return choice
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice must be {'type': 'function', 'function': {'name': ...}}")
        if not any(t.name == name for t in tools):
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return name
    raise TypeError(f"tool_choice must be a string or a dict, got {type(choice).__name__}")


def _arguments(value: Any) -> dict[str, Any] | None:
    """A call's arguments as a dict (a JSON string is decoded), or None when they are not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


def _json_objects(text: str, sep: str) -> list[Any] | None:
    """The JSON values ``text`` holds one after another (``sep`` and whitespace between), or None."""
    decoder = json.JSONDecoder()
    out: list[Any] = []
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(value)
        while i < len(text) and text[i].isspace():
            i += 1
        if text.startswith(sep, i):
            i += len(sep)


class ToolFormat:
    """One family's tool-call syntax (docs/structured.md, *Tool calls*); this base is ``hermes``."""

    name = "hermes"
    arguments_key = "arguments"
    renders_tools = True  # the chat template takes `tools` (else infer describes them itself)
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    markers: tuple[str, ...] = ("<tool_call>",)  # text that starts a call (streaming holds it back)

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    # -- the prompt --

    def prepare(self, messages: Sequence[Message], tools: Sequence[Tool]) -> list[Message]:
        """``messages`` as the template takes them: assistant calls with their arguments as dicts
        (templates write them with ``tojson``), content None as ""."""
        out = []
        for m in messages:
            m = dict(m)
            if m.get("content") is None:
                m["content"] = ""
            calls = m.get("tool_calls")
            if calls:
                m["tool_calls"] = [self._call_for_template(c) for c in calls]
            out.append(m)
        return out

    @staticmethod
    def _call_for_template(call: Mapping[str, Any]) -> dict[str, Any]:
        function = dict(call.get("function") or {})
        args = _arguments(function.get("arguments"))
        function["arguments"] = args if args is not None else {}
        return {"id": call.get("id"), "type": "function", "function": function}

    # -- reading the output --

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content, calls)`` of a reply; the content is the text around the calls."""
        calls: list[ToolCall] = []
        kept: list[str] = []
        pos = 0
        pattern = re.compile(
            re.escape(self.open_tag) + r"(.*?)(?:" + re.escape(self.close_tag) + r"|$)", re.S
        )
        for m in pattern.finditer(text):
            call = self._call(m.group(1).strip())
            if call is None:
                continue
            kept.append(text[pos : m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        return "".join(kept).strip(), calls

    def _call(self, body: Any) -> ToolCall | None:
        if isinstance(body, str):
            try:  # the JSON value the body opens with (a reply cut by max_tokens may end in a tag's start)
                body, _ = json.JSONDecoder().raw_decode(body.strip())
            except json.JSONDecodeError:
                return None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return None
        args = _arguments(body.get(self.arguments_key, body.get("arguments", body.get("parameters", {}))))
        if args is None:
            return None
        return ToolCall(self.new_id(), body["name"], args)

    def call_start(self, text: str) -> int | None:
        """Where the calls begin in the text so far (None: not yet); `hold` says how much of the end
        to keep back while it could still become the start of one."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def hold(self, text: str) -> int:
        longest = 0
        for marker in self.markers:
            for n in range(min(len(marker) - 1, len(text)), longest, -1):
                if text.endswith(marker[:n]):
                    longest = n
                    break
        return longest

    # -- constraining --

    def _body(self, tools: Sequence[Tool]) -> str:
        """``%json {...}``: one call's JSON, naming one of ``tools`` with matching arguments."""
        options = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, self.arguments_key: dict(t.parameters)},
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
        schema = {**schema, "x-guidance": JSON_OPTIONS}
        return "%json " + json.dumps(schema, separators=(",", ":"))

    def grammar(self, tools: Sequence[Tool], parallel: bool, lit: Literal) -> str:
        """A Lark grammar for one call (or, ``parallel``, one or more) of ``tools``."""
        call = f"{lit(self.open_tag)} {lit(chr(10))} body {lit(chr(10))} {lit(self.close_tag)}"
        more = f" ({lit(chr(10))} call)*" if parallel else ""
        return f"start: call{more}\ncall: {call}\nbody: {self._body(tools)}\n"


class Llama3Format(ToolFormat):
    name = "llama3"
    arguments_key = "parameters"
    markers = ("<|python_tag|>",)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        body = body.removeprefix("<|python_tag|>").strip()
        for end in ("<|eom_id|>", "<|eot_id|>"):
            body = body.removesuffix(end).strip()
        if not body.startswith("{"):
            return text.strip(), []
        values = _json_objects(body, ";")
        calls = [self._call(v) for v in values] if values else []
        if not calls or any(c is None for c in calls):
            return text.strip(), []
        return "", [c for c in calls if c is not None]

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(("{", "<|python_tag|>")):
            return len(text) - len(stripped)
        return super().call_start(text)

    def hold(self, text: str) -> int:
        return len(text) if not text.strip() else super().hold(text)  # a reply may open with a call

    def grammar(self, tools: Sequence[Tool], parallel: bool, lit: Literal) -> str:
        more = f" ({lit('; ')} body)*" if parallel else ""
        return f"start: body{more}\nbody: {self._body(tools)}\n"


class MistralFormat(ToolFormat):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def new_id(self) -> str:
        # Mistral's templates want 9 letters and digits.
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text.strip(), []
        content, rest = text[:start].strip(), text[start + len("[TOOL_CALLS]") :]
        for end in ("</s>",):
            rest = rest.strip().removesuffix(end)
        values = _json_objects(rest, ",")
        calls: list[ToolCall | None] = []
        if values and len(values) == 1 and isinstance(values[0], list):
            calls = [self._call(v) for v in values[0]]
        elif values and all(isinstance(v, dict) for v in values):
            calls = [self._call(v) for v in values]
        else:  # [TOOL_CALLS]name[ARGS]{...} (later Mistral tokenizers)
            for m in re.finditer(r"([A-Za-z0-9_.\-]+)\[ARGS\]", rest):
                found = _json_objects(rest[m.end() :].split("[TOOL_CALLS]")[0], ",")
                if found:
                    calls.append(self._call({"name": m.group(1), "arguments": found[0]}))
        if not calls or any(c is None for c in calls):
            return text.strip(), []
        return content, [c for c in calls if c is not None]

    def grammar(self, tools: Sequence[Tool], parallel: bool, lit: Literal) -> str:
        more = f" ({lit(', ')} body)*" if parallel else ""
        return f"start: {lit('[TOOL_CALLS]')} {lit('[')} body{more} {lit(']')}\nbody: {self._body(tools)}\n"


class GenericFormat(ToolFormat):
    """A template without tool support: infer describes the tools in the system message."""

    name = "generic"
    renders_tools = False

    def prepare(self, messages: Sequence[Message], tools: Sequence[Tool]) -> list[Message]:
        out: list[Message] = []
        results = -1  # index in `out` of the user message collecting the latest tool results
        for m in super().prepare(messages, tools):
            if m.get("role") == "tool":
                text = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
                if results == len(out) - 1 and results >= 0:
                    out[results]["content"] += "\n" + text
                else:
                    out.append({"role": "user", "content": text})
                    results = len(out) - 1
                continue
            calls = m.pop("tool_calls", None)
            m.pop("tool_call_id", None)
            if calls:
                written = "\n".join(
                    f"{self.open_tag}\n"
                    + json.dumps({"name": c["function"].get("name"), "arguments": c["function"]["arguments"]},
                                 ensure_ascii=False)
                    + f"\n{self.close_tag}"
                    for c in calls
                )  # fmt: skip
                m["content"] = (m["content"] + "\n" if m["content"] else "") + written
            out.append(m)
        if tools:
            system = self.system_text(tools)
            if out and out[0].get("role") == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
            else:
                out.insert(0, {"role": "system", "content": system})
        return out

    def system_text(self, tools: Sequence[Tool]) -> str:
        listed = "\n".join(json.dumps(t.openai()["function"], ensure_ascii=False) for t in tools)
        return (
            f"Functions you can call:\n{listed}\n"
            'To call one, reply <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>'
        )


HERMES, LLAMA3, MISTRAL, GENERIC = ToolFormat(), Llama3Format(), MistralFormat(), GenericFormat()
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, GENERIC)}


def tool_format(template: str | None) -> ToolFormat:
    """The family whose syntax ``template`` (a chat template's source) uses; `GENERIC` when it
    renders no tools or uses a syntax infer does not know."""
    if not template or "tools" not in template:
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name' in template:
        return LLAMA3
    return GENERIC


__all__ = [
    "FORMATS",
    "GENERIC",
    "HERMES",
    "LLAMA3",
    "MISTRAL",
    "Tool",
    "ToolCall",
    "ToolFormat",
    "check_tools",
    "tool_choice_of",
    "tool_format",
]
