"""Structured output and tool calls over HTTP, driven by the official `openai` client on 127.0.0.1.

The tiny checkpoint's template has no tool support, so tools go through infer's ``generic`` format
(described in the system message, called in the ``<tool_call>`` syntax); its random weights would
never call a tool or write JSON unconstrained, so ``tool_choice: "auto"`` is driven by a scripted
engine that replies with a call, and everything constrained runs on the real engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from infer.text.prompts import read_reply, tool_chat

from .clients import openai_client, served_model
from .fake_engine import FakeEngine, FakeHandle

LiveServer = Callable[..., str]
TIMEOUT = httpx.Timeout(60.0)

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": WEATHER_PARAMS},
}
NOTHING: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
CLOCK: dict[str, Any] = {"type": "function", "function": {"name": "now", "parameters": NOTHING}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny Llama with room for a tool description (its byte-level tokens are many)."""
    import infer
    from infer.testing import build_checkpoint

    path = build_checkpoint(tmp_path_factory.mktemp("serve-tools"), "llama", max_position_embeddings=2048)
    return infer.load(path, deterministic=True)


@pytest.fixture(scope="module")
def base(live_server: LiveServer, llm: Any) -> str:
    return live_server(llm, max_batch=4, max_waiting=16)


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai_client(base)


_model = served_model


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int = Field(ge=0, le=8)
    tags: list[Literal["small", "loud", "old"]] = Field(min_length=1, max_length=2)


def test_parse_returns_a_pydantic_object(client: openai.OpenAI, base: str, llm: Any) -> None:
    completion = client.beta.chat.completions.parse(
        model=_model(base),
        messages=[{"role": "user", "content": "A pet, please."}],
        response_format=Pet,
        max_tokens=120,
        temperature=0,
    )
    choice = completion.choices[0]
    print(choice.message.content)
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)
    assert choice.message.parsed == Pet.model_validate_json(choice.message.content or "")
    # The server's answer is the library's under the same schema (what the client sent: strict).
    from openai.lib._pydantic import to_strict_json_schema

    ids = llm.chat_prompt([{"role": "user", "content": "A pet, please."}])
    assert (
        llm.generate(ids, max_new_tokens=120, json_schema=to_strict_json_schema(Pet)).text
        == choice.message.content
    )


def test_json_schema_streamed_and_json_object(client: openai.OpenAI, base: str) -> None:
    schema = Pet.model_json_schema() | {"additionalProperties": False}
    kwargs: dict[str, Any] = {
        "model": _model(base),
        "messages": [{"role": "user", "content": "A pet"}],
        "max_tokens": 120,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "pet", "strict": True, "schema": schema},
        },
    }
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].message.content or ""
    jsonschema.validate(json.loads(content), schema)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    assert chunks[-1].choices[0].finish_reason == "stop"
    any_object = client.chat.completions.create(
        model=_model(base),
        messages=[{"role": "user", "content": "JSON"}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = any_object.choices[0].message.content or ""
    print(text)
    assert text.startswith("{")  # random weights may not close it within max_tokens; if they do:
    assert any_object.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


Reply = tuple[list[tuple[str, dict[str, Any]]], str | None, str]  # (calls, finish reason, content)


def _streamed(chunks: list[Any]) -> dict[int, Reply]:
    """Each choice of a stream: its calls (``delta.tool_calls`` gathered by index, as clients do),
    its finish reason and its content."""
    calls: dict[int, dict[int, dict[str, str]]] = {}
    content: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            i = choice.index
            content[i] = content.get(i, "") + (choice.delta.content or "")
            finish[i] = choice.finish_reason or finish.get(i)
            for tc in choice.delta.tool_calls or []:
                slot = calls.setdefault(i, {}).setdefault(tc.index, {"name": "", "arguments": "", "id": ""})
                slot["id"] += tc.id or ""
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
    out: dict[int, Reply] = {}
    for i in content:
        made = [c for _, c in sorted(calls.get(i, {}).items())]
        assert all(c["id"] for c in made)
        out[i] = ([(c["name"], json.loads(c["arguments"])) for c in made], finish[i], content[i])
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_tool_calls_match_the_parameters(
    client: openai.OpenAI, base: str, stream: bool
) -> None:
    params = {"get_weather": WEATHER_PARAMS, "now": NOTHING}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs: dict[str, Any] = dict(
            model=_model(base),
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice=choice,
            max_tokens=200,
            temperature=0.9,
            seed=7,
            n=3,
        )
        if stream:
            replies = _streamed(list(client.chat.completions.create(stream=True, **kwargs)))
            results = [replies[i] for i in sorted(replies)]
        else:
            r = client.chat.completions.create(**kwargs)
            results = [(_calls(c.message), c.finish_reason, c.message.content or "") for c in r.choices]
        assert len(results) == 3
        for calls, finish, content in results:
            print(choice, calls)
            assert finish == "tool_calls" and calls and content == ""
            for name, arguments in calls:
                assert choice == "required" or name == "get_weather"
                jsonschema.validate(arguments, params[name])


def test_streamed_calls_equal_the_whole_response(client: openai.OpenAI, base: str) -> None:
    kwargs: dict[str, Any] = dict(
        model=_model(base),
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        max_tokens=200,
        temperature=0,
        parallel_tool_calls=False,
    )
    whole = client.chat.completions.create(**kwargs)
    streamed = _streamed(list(client.chat.completions.create(stream=True, **kwargs)))[0]
    assert streamed[:2] == (_calls(whole.choices[0].message), "tool_calls")
    assert len(streamed[0]) == 1


def test_a_tool_result_continues_the_conversation(client: openai.OpenAI, base: str, llm: Any) -> None:
    kwargs: dict[str, Any] = {"model": _model(base), "messages": ASK, "tools": [WEATHER], "max_tokens": 200}
    first = client.chat.completions.create(tool_choice="required", temperature=0, **kwargs)
    assert first.choices[0].message.tool_calls is not None
    call = first.choices[0].message.tool_calls[0]
    assert call.type == "function"
    history: list[Any] = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),  # as clients send it back
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"},
    ]
    r = httpx.post(
        base + "/v1/chat/completions",
        json={
            "messages": history,
            "tools": [WEATHER],
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
        },
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    # The server rendered the call and its result as infer renders them, and answered from there.
    chat = tool_chat(
        llm,
        [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"},
        ],
        tools=[WEATHER],
    )
    rendered = llm.tokenizer.decode(chat.ids, skip_special_tokens=False)
    assert (
        "<tool_response>\nsunny, 24 C\n</tool_response>" in rendered and call.function.arguments in rendered
    )
    assert r.json()["choices"][0]["token_ids"] == llm.generate(chat.ids, max_new_tokens=8).token_ids


CALL = '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}'
SCRIPT = f"I will check.\n<tool_call>\n{CALL}\n</tool_call>"


class _Scripted(FakeEngine):
    """Replies with ``script``, one byte-level token per event (what a model that calls tools writes)."""

    def __init__(self, llm: Any, script: str, reason: str = "stop") -> None:
        super().__init__(llm)
        self.script, self.reason = script, reason

    def submit(self, prompt: list[int], params: Any) -> Any:
        from infer.engine import Delta

        ids = self.llm.tokenizer.encode(self.script, add_special_tokens=False)
        decode, reason = self.llm.tokenizer.decode, self.reason

        class Handle(FakeHandle):
            id = "scripted"
            prompt_tokens = len(prompt)

            def __iter__(self) -> Iterator[Delta]:
                for i, t in enumerate(ids):
                    yield Delta([t], decode(ids[i : i + 1]), None, None)
                yield Delta([], "", None, reason)

            def cancel(self) -> None:
                pass

        return Handle()


CUT = SCRIPT + '\n<tool_call>\n{"name": "no'  # a second call, cut by max_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_reply_cut_inside_a_call_finishes_with_length(
    live_server: LiveServer, llm: Any, stream: bool
) -> None:
    """Out of tokens in its second call: the first call is kept, the unfinished one is not content,
    and the finish reason says the reply was cut ("length"), not that it ended in its calls."""
    base = live_server(_Scripted(llm, CUT, reason="length"))
    client = openai_client(base)
    kwargs: dict[str, Any] = dict(model=_model(base), messages=ASK, tools=[WEATHER, CLOCK])
    if stream:
        calls, finish, content = _streamed(list(client.chat.completions.create(stream=True, **kwargs)))[0]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls, finish, content = _calls(choice.message), choice.finish_reason, choice.message.content or ""
    print(stream, calls, finish, repr(content))
    assert (calls, finish, content) == (
        [("get_weather", {"city": "Rome", "days": 2})],
        "length",
        "I will check.",
    )


def test_read_reply_drops_an_unfinished_call_only_when_cut(llm: Any) -> None:
    chat = tool_chat(llm, ASK, tools=[WEATHER, CLOCK])
    ids = llm.tokenizer.encode(CUT, add_special_tokens=False)
    whole, calls = read_reply(llm, chat, ids, CUT)
    assert [c.name for c in calls] == [
        "get_weather"
    ] and whole == 'I will check.\n\n<tool_call>\n{"name": "no'
    cut, calls = read_reply(llm, chat, ids, CUT, cut=True)
    assert [c.name for c in calls] == ["get_weather"] and cut == "I will check."
    alone = "Sure.\n<tool_call>\n{"  # cut in its only call: no call, and the markup is not content
    assert read_reply(llm, chat, llm.tokenizer.encode(alone, add_special_tokens=False), alone, cut=True) == (
        "Sure.",
        [],
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_reads_the_call_out_of_the_reply(live_server: LiveServer, llm: Any, stream: bool) -> None:
    two = SCRIPT + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    base = live_server(_Scripted(llm, two))
    client = openai_client(base)
    for parallel, expected in ((True, 2), (False, 1)):
        kwargs: dict[str, Any] = dict(
            model=_model(base), messages=ASK, tools=[WEATHER, CLOCK], parallel_tool_calls=parallel
        )
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            calls, finish, content = _streamed(chunks)[0]
            assert not any(
                "<" in (c.choices[0].delta.content or "") for c in chunks if c.choices
            )  # held back
        else:
            message = client.chat.completions.create(**kwargs).choices[0]
            calls, finish, content = (
                _calls(message.message),
                message.finish_reason,
                message.message.content or "",
            )
        assert content == "I will check."
        assert finish == "tool_calls"
        assert calls == [("get_weather", {"city": "Rome", "days": 2}), ("now", {})][:expected]
    # A reply without a call is content, "<" included, finished with "stop"; tool_choice none: no parsing.
    plain = live_server(_Scripted(llm, "a < b, and <tool_ is not a call"))
    client = openai_client(plain)
    kwargs = {"model": _model(plain), "messages": ASK, "tools": [WEATHER]}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        assert _streamed(chunks)[0] == ([], "stop", "a < b, and <tool_ is not a call")
    else:
        whole = client.chat.completions.create(**kwargs).choices[0]
        assert (_calls(whole.message), whole.finish_reason) == ([], "stop")
        assert whole.message.content == "a < b, and <tool_ is not a call"
    scripted = live_server(_Scripted(llm, SCRIPT))
    client = openai_client(scripted)
    none = client.chat.completions.create(**{**kwargs, "model": _model(scripted)}, tool_choice="none")
    assert none.choices[0].message.content == SCRIPT and none.choices[0].message.tool_calls is None


def test_logit_bias_penalties_and_n(base: str, llm: Any) -> None:
    url = base + "/v1/completions"
    forced = httpx.post(
        url,
        json={
            "prompt": "Hello",
            "max_tokens": 6,
            "temperature": 0,
            "logit_bias": {"65": 100},
            "return_token_ids": True,
        },
        timeout=TIMEOUT,
    ).json()
    assert forced["choices"][0]["token_ids"] == [65] * 6
    body = {
        "prompt": "Hello",
        "max_tokens": 12,
        "temperature": 0,
        "presence_penalty": 1.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.3,
        "return_token_ids": True,
    }
    served = httpx.post(url, json=body, timeout=TIMEOUT).json()["choices"][0]["token_ids"]
    ids = llm.tokenizer.encode("Hello")
    assert (
        served
        == llm.generate(
            ids, max_new_tokens=12, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3
        ).token_ids
    )
    assert served != llm.generate(ids, max_new_tokens=12).token_ids  # the penalties changed something
    # n choices: choice i draws from row_seed(seed, i), as generate's batch row i does.
    n3 = httpx.post(
        url,
        json={
            "prompt": "Hello",
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 4,
            "n": 3,
            "return_token_ids": True,
        },
        timeout=TIMEOUT,
    ).json()
    batch = llm.generate([ids, ids, ids], max_new_tokens=8, temperature=1.0, seed=4)
    assert [c["index"] for c in n3["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in n3["choices"]] == [b.token_ids for b in batch]
    assert n3["usage"]["completion_tokens"] == sum(len(b.token_ids) for b in batch)
    streamed = httpx.post(
        url,
        json={
            "prompt": "Hello",
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 4,
            "n": 3,
            "stream": True,
            "return_token_ids": True,
        },
        timeout=TIMEOUT,
    )
    tokens: dict[int, list[int]] = {}
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                tokens.setdefault(c["index"], []).extend(c["token_ids"])
    assert [tokens[i] for i in range(3)] == [c["token_ids"] for c in n3["choices"]]


CHAT = {"messages": ASK, "max_tokens": 4}
UNHONOURED: list[tuple[str, str, dict[str, Any], str]] = [
    ("functions", "chat", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("function_call", "chat", {**CHAT, "function_call": "auto"}, "function_call"),
    ("audio", "chat", {**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("modalities audio", "chat", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("reasoning_effort", "chat", {**CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
    ("verbosity", "chat", {**CHAT, "verbosity": "low"}, "verbosity"),
    ("web_search_options", "chat", {**CHAT, "web_search_options": {}}, "web_search_options"),
    ("min_p (vLLM's)", "chat", {**CHAT, "min_p": 0.1}, "min_p"),
    ("best_of", "completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("suffix", "completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
    (
        "response_format on completions",
        "completions",
        {"prompt": "hi", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    (
        "stream_options without stream",
        "chat",
        {**CHAT, "stream_options": {"include_usage": True}},
        "stream_options",
    ),
    (
        "an unenforceable schema",
        "chat",
        {
            **CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            },
        },
        "response_format",
    ),
    (
        "json_schema without schema object",
        "chat",
        {**CHAT, "response_format": {"type": "json_schema"}},
        "response_format",
    ),
    ("a tool named twice", "chat", {**CHAT, "tools": [WEATHER, WEATHER]}, "tools"),
    (
        "tool_choice not offered",
        "chat",
        {**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "later"}}},
        "tool_choice",
    ),
    ("required without tools", "chat", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    (
        "logit_bias past the vocabulary",
        "completions",
        {"prompt": "hi", "logit_bias": {"99999": 1}},
        "logit_bias",
    ),
    ("logit_bias out of range", "completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    (
        "presence_penalty out of range",
        "completions",
        {"prompt": "hi", "presence_penalty": 3},
        "presence_penalty",
    ),
    ("repetition_penalty 0", "completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("content null for a user", "chat", {"messages": [{"role": "user", "content": None}]}, "messages[0]"),
]


@pytest.mark.parametrize(("what", "endpoint", "body", "param"), UNHONOURED, ids=[u[0] for u in UNHONOURED])
def test_a_field_infer_cannot_honour_is_a_400_naming_it(
    base: str, what: str, endpoint: str, body: dict[str, Any], param: str
) -> None:
    url = base + ("/v1/completions" if endpoint == "completions" else "/v1/chat/completions")
    r = httpx.post(url, json=body, timeout=TIMEOUT)
    print(f"{what}: {r.status_code} {r.text}")
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"].startswith(param) and error["type"] == "invalid_request_error"
    assert param.split("[")[0] in error["message"]


def test_an_unsupported_field_and_a_wrong_value_have_their_own_codes(base: str) -> None:
    """OpenAI's ``code``: a field infer does not serve is "unsupported_parameter" on either endpoint
    (``response_format`` on completions too); a schema infer cannot enforce is "invalid_schema"."""
    text = {"prompt": "hi", "response_format": {"type": "json_object"}}
    r = httpx.post(base + "/v1/completions", json=text, timeout=TIMEOUT)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "unsupported_parameter")
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
    }
    r = httpx.post(base + "/v1/chat/completions", json={**CHAT, "response_format": schema}, timeout=TIMEOUT)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_schema")


def test_known_fields_sent_as_null_take_their_defaults(base: str) -> None:
    """OpenAI's nullable fields: null is as if not sent, the same answer as without them."""
    nulls = {"n": None, "stream": None, "logprobs": None, "seed": None, "top_p": None}
    plain = httpx.post(base + "/v1/chat/completions", json={**CHAT, "temperature": 0}, timeout=TIMEOUT)
    r = httpx.post(base + "/v1/chat/completions", json={**CHAT, **nulls, "temperature": 0}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    text = {"prompt": "hi", "max_tokens": 2, "n": None, "echo": None, "stream": None, "ignore_eos": None}
    r = httpx.post(base + "/v1/completions", json=text, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


def test_fields_that_change_nothing_are_accepted(base: str) -> None:
    ignored = {
        "user": "u1",
        "store": False,
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "modalities": ["text"],
        "safety_identifier": "s",
        "prompt_cache_key": "c",
        "functions": None,
        "parallel_tool_calls": True,
    }
    r = httpx.post(base + "/v1/chat/completions", json={**CHAT, **ignored}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
