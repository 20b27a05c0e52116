"""Tool-call formats (`infer.text.tools`): which family a template is, how each family's calls read, and
how a template without tool support is given the tools and the conversation's earlier calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from infer.text.tools import (
    GENERIC,
    HERMES,
    LLAMA3,
    MISTRAL,
    check_tools,
    tool_choice_of,
    tool_format,
)

LLAMA32_LINE = (
    '{{ tools }} Respond in the format {"name": function name, "parameters": dictionary of argument '
    "name and its value}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.mark.parametrize(
    ("template", "family"),
    [
        (None, "generic"),
        ("{{ messages }}", "generic"),  # no tools at all
        ("{% if tools %}{{ tools }}{% endif %}<tool_call>", "hermes"),  # Qwen 2.5 / 3
        ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
        ("{% if tools %}{% endif %}<|python_tag|>", "llama3"),
        (LLAMA32_LINE, "llama3"),
        ("{% for t in tools %}{{ t }}{% endfor %} <function=...>", "generic"),  # a syntax infer does not know
    ],
)
def test_the_family_is_read_from_the_template(template: str | None, family: str) -> None:
    assert tool_format(template).name == family


def test_hermes_calls_and_the_text_around_them() -> None:
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>'
    )
    content, calls = HERMES.parse(text)
    assert content == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert json.loads(calls[0].openai()["function"]["arguments"]) == {"city": "Paris"}
    # A call cut off by max_tokens before its closing tag still reads when its JSON is whole.
    assert HERMES.parse('<tool_call>\n{"name": "f", "arguments": {}}')[1][0].name == "f"
    # Not a call: broken JSON, or no name, stays text.
    assert HERMES.parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    assert HERMES.parse('<tool_call>{"arguments": {}}</tool_call>')[1] == []
    assert HERMES.parse("plain answer") == ("plain answer", [])


def test_llama3_calls() -> None:
    content, calls = LLAMA3.parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eom_id|>'
    )
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo"})]
    _, calls = LLAMA3.parse('{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert [(c.name, c.arguments) for c in calls] == [("a", {}), ("b", {"x": 1})]
    assert LLAMA3.parse('{"answer": 42}') == ('{"answer": 42}', [])  # JSON, but not a call
    assert LLAMA3.parse("The answer is 42.")[1] == []


def test_mistral_calls_in_both_syntaxes() -> None:
    content, calls = MISTRAL.parse('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}]</s>')
    assert content == "" and calls[0].name == "get_weather" and calls[0].arguments == {"city": "Nice"}
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()  # Mistral's templates check the id's length
    _, calls = MISTRAL.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}')
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Lyon"})]
    assert MISTRAL.parse("no calls here") == ("no calls here", [])


def test_streaming_holds_back_what_may_begin_a_call() -> None:
    assert HERMES.call_start("Sure. <tool_call>\n{") == 6
    assert HERMES.call_start("Sure.") is None
    assert HERMES.hold("Sure. <tool_") == len("<tool_")  # may be the start of "<tool_call>"
    assert HERMES.hold("Sure. <b>") == 0
    assert LLAMA3.call_start('  {"name"') == 2  # a reply that opens with JSON is a call
    assert LLAMA3.hold("   ") == 3 and LLAMA3.hold("Hi") == 0


def test_a_template_without_tools_gets_them_in_the_system_message() -> None:
    tools = check_tools([WEATHER])
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    out = GENERIC.prepare(messages, tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]  # results in one user turn
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in out[0]["content"]
    assert (
        out[2]["content"].count("<tool_call>\n") == 2
        and '"arguments": {"city": "Paris"}' in out[2]["content"]
    )
    assert (
        out[3]["content"]
        == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    )
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in out)
    # Templates that render tools get the calls' arguments as dicts (they write them with tojson).
    kept = HERMES.prepare(messages, tools)
    assert kept[2]["content"] == "" and kept[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_tools_and_tool_choice_are_checked() -> None:
    tools = check_tools([WEATHER, {"name": "now"}])  # the inner function dict is taken too
    assert [t.name for t in tools] == ["get_weather", "now"]
    assert tools[1].parameters == {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match=r"tools\[0\].function.name"):
        check_tools([{"type": "function", "function": {"name": "has space"}}])
    with pytest.raises(ValueError, match="offered twice"):
        check_tools([WEATHER, WEATHER])
    with pytest.raises(TypeError, match="tools must be a list"):
        check_tools({"name": "f"})
    assert tool_choice_of(None, tools) == "auto" and tool_choice_of(None, []) == "none"
    assert tool_choice_of({"type": "function", "function": {"name": "now"}}, tools) == "now"
    with pytest.raises(ValueError, match="not among the tools"):
        tool_choice_of({"type": "function", "function": {"name": "later"}}, tools)
    with pytest.raises(ValueError, match="needs tools"):
        tool_choice_of("required", [])
    with pytest.raises(ValueError, match="tool_choice must be"):
        tool_choice_of("sometimes", tools)
