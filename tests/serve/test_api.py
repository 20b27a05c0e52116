"""`infer serve`'s API driven as clients use it: the official `openai` client and httpx over 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infer.params import ParamError, ParamTypeError

from .clients import openai_client, served_model
from .fake_engine import FakeEngine

LiveServer = Callable[..., str]  # tests/serve/conftest.py's live_server
TIMEOUT = httpx.Timeout(60.0)


@pytest.fixture(scope="module")
def base(live_server: LiveServer, tiny_llm: Any) -> str:
    return live_server(tiny_llm, max_batch=4, max_waiting=16)


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai_client(base)


_model = served_model


def _metrics(base: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """``/metrics`` parsed by prometheus_client's parser: ``{sample name{labels}: value}``."""
    text = httpx.get(base + "/metrics", headers=headers, timeout=TIMEOUT).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _sse(lines: Iterator[str]) -> list[Any]:
    """The events of a server-sent-event stream: parsed JSON objects, then the string "[DONE]"."""
    events: list[Any] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_models_health_and_page(base: str, tiny_path: Path) -> None:
    models = httpx.get(base + "/v1/models", timeout=TIMEOUT).json()
    assert models["object"] == "list" and models["data"][0]["id"] == tiny_path.name
    assert models["data"][0]["max_model_len"] == 256
    assert httpx.get(base + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
    page = httpx.get(base + "/", timeout=TIMEOUT)
    assert page.status_code == 200 and "/v1/chat/completions" in page.text


def test_chat_streaming_and_not(client: openai.OpenAI, base: str, tiny_llm: Any) -> None:
    messages: Any = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(
        model=_model(base), messages=messages, max_tokens=12, temperature=0
    )
    choice = whole.choices[0]
    ids = tiny_llm.chat_prompt(messages)
    expected = tiny_llm.generate(ids, max_new_tokens=12)
    print(f"served {choice.message.content!r} ({choice.finish_reason}); llm.chat: {expected.text!r}")
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    assert whole.usage.completion_tokens == len(expected.token_ids)
    assert whole.usage.total_tokens == len(ids) + len(expected.token_ids)
    assert choice.finish_reason == ("length" if expected.finish_reason == "length" else "stop")

    stream = client.chat.completions.create(
        model=_model(base),
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == expected.text
    assert reasons[-1] == choice.finish_reason and all(r is None for r in reasons[:-1])
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # include_usage: a last chunk


def test_completions_text_and_token_ids(client: openai.OpenAI, base: str, tiny_llm: Any) -> None:
    expected = tiny_llm.generate("The capital of", max_new_tokens=10)
    got = client.completions.create(model=_model(base), prompt="The capital of", max_tokens=10, temperature=0)
    assert got.choices[0].text == expected.text
    ids = tiny_llm.tokenizer.encode("The capital of")
    by_ids = client.completions.create(model=_model(base), prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == expected.text and by_ids.usage is not None
    assert by_ids.usage.prompt_tokens == len(ids)
    stream = client.completions.create(
        model=_model(base), prompt="The capital of", max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == expected.text
    default = client.completions.create(model=_model(base), prompt="The capital of", temperature=0)
    assert default.usage is not None and default.usage.completion_tokens <= 16  # OpenAI's default max_tokens


def test_stop_strings_and_seeded_sampling(client: openai.OpenAI, base: str, tiny_llm: Any) -> None:
    full = tiny_llm.generate("Hello", max_new_tokens=20).text
    stop = full[3:5] if len(full) >= 5 else None
    if stop:
        got = client.completions.create(
            model=_model(base), prompt="Hello", max_tokens=20, temperature=0, stop=[stop]
        )
        expected = tiny_llm.generate("Hello", max_new_tokens=20, stop=[stop])
        print(f"full {full!r}, stop {stop!r}: {got.choices[0].text!r}")
        assert got.choices[0].text == expected.text and got.choices[0].finish_reason == "stop"
    kwargs: Any = dict(model=_model(base), prompt="Hello", max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    a = client.completions.create(**kwargs, extra_body={"top_k": 40})
    b = client.completions.create(**kwargs, extra_body={"top_k": 40})
    assert a.choices[0].text == b.choices[0].text  # a seed makes sampling reproducible


def _completion(base: str, body: dict[str, Any], out: dict[str, Any], key: str) -> None:
    r = httpx.post(base + "/v1/completions", json=body, timeout=TIMEOUT)
    out[key] = r.json()


def _alone(llm: Any, prompt: str, n: int) -> tuple[list[int], list[Any]]:
    """Tokens and logprobs (top 2) of ``prompt`` submitted alone to the model's engine."""
    from infer.engine import SamplingParams

    handle = llm.engine.submit(prompt, SamplingParams(max_tokens=n, logprobs=2))
    tokens: list[int] = []
    logprobs: list[Any] = []
    for delta in handle:
        tokens += delta.token_ids
        logprobs += [(lp.token_id, lp.logprob, [list(t) for t in lp.top]) for lp in delta.logprobs or []]
    return tokens, logprobs


def test_concurrent_requests_each_get_their_own_tokens(base: str, tiny_llm: Any) -> None:
    """15 requests of different lengths at once: each gets exactly what it gets alone (deterministic mode).

    Tokens equal `llm.generate`'s; tokens and logprobs are bitwise those of the same request
    submitted alone to the engine.
    """
    assert tiny_llm.deterministic
    prompts = [f"{'word ' * (i % 5)}prompt number {i}:" for i in range(15)]
    lengths = [5 + (7 * i) % 31 for i in range(15)]
    out: dict[str, Any] = {}
    barrier = threading.Barrier(len(prompts))

    def post(prompt: str, n: int) -> None:
        barrier.wait()
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True, "logprobs": 2}
        _completion(base, body, out, prompt)

    threads = [threading.Thread(target=post, args=pn) for pn in zip(prompts, lengths, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for p, n in zip(prompts, lengths, strict=True):
        expected = tiny_llm.generate(p, max_new_tokens=n)
        choice = out[p]["choices"][0]
        tokens, logprobs = _alone(tiny_llm, p, n)
        print(f"{p!r}: served {choice['token_ids']}, generate {expected.token_ids}")
        assert choice["token_ids"] == expected.token_ids == tokens
        assert choice["text"] == expected.text
        assert out[p]["usage"]["completion_tokens"] == len(expected.token_ids)
        served = choice["logprobs"]["token_logprobs"]
        assert served == [lp for _, lp, _ in logprobs]  # bitwise: JSON floats round-trip exactly
        for shown, (_, _, top) in zip(choice["logprobs"]["top_logprobs"], logprobs, strict=True):
            assert set(shown.values()) <= {v for _, v in top}  # keyed by text: equal texts share a key


BAD_REQUESTS: list[tuple[str, str, dict[str, Any] | bytes, str | None]] = [
    ("malformed JSON", "completions", b'{"prompt": "hi", ', None),
    ("not an object", "completions", b"[1, 2]", None),
    ("no prompt", "completions", {"max_tokens": 3}, "prompt"),
    ("prompt a number", "completions", {"prompt": 5}, "prompt"),
    ("empty prompt", "completions", {"prompt": ""}, "prompt"),
    ("token id out of range", "completions", {"prompt": [1, 99999]}, "prompt"),
    ("max_tokens a string", "completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("max_tokens 0", "completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens past the context", "completions", {"prompt": "hi", "max_tokens": 1000}, "max_tokens"),
    ("prompt longer than the context", "completions", {"prompt": "word " * 300}, "prompt"),
    ("temperature negative", "completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("top_p 0", "completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("seed negative", "completions", {"prompt": "hi", "seed": -3}, "seed"),
    ("stop a number", "completions", {"prompt": "hi", "stop": 3}, "stop"),
    ("empty stop", "completions", {"prompt": "hi", "stop": ["a", ""]}, "stop[1]"),
    ("stop a lone surrogate", "completions", b'{"prompt": "hi", "stop": ["a", "\\ud800"]}', "stop[1]"),
    ("17 stop strings", "completions", {"prompt": "hi", "stop": [str(i) for i in range(17)]}, "stop"),
    ("top_k below -1", "completions", {"prompt": "hi", "top_k": -5}, "top_k"),
    ("n 0", "completions", {"prompt": "hi", "n": 0}, "n"),
    ("n past 128", "completions", {"prompt": "hi", "n": 129}, "n"),
    ("stream a string", "completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("temperature a string", "completions", {"prompt": "hi", "temperature": "0"}, "temperature"),
    ("temperature a boolean", "completions", {"prompt": "hi", "temperature": True}, "temperature"),
    ("top_p a string", "completions", {"prompt": "hi", "top_p": "0.5"}, "top_p"),
    (
        "presence_penalty a string",
        "completions",
        {"prompt": "hi", "presence_penalty": "2"},
        "presence_penalty",
    ),
    (
        "a logit_bias value a string",
        "completions",
        {"prompt": "hi", "logit_bias": {"42": "100"}},
        "logit_bias.42",
    ),
    ("unknown model", "completions", {"prompt": "hi", "model": "gpt-5"}, "model"),
    ("logprobs too many", "completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("no messages", "chat", {"messages": []}, "messages"),
    ("bad role", "chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("content a number", "chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        "an image part",
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content",
    ),
    ("chat too long", "chat", {"messages": [{"role": "user", "content": "word " * 300}]}, "messages"),
    (
        "max_completion_tokens past the context",
        "chat",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 999},
        "max_completion_tokens",
    ),
    (
        "max_completion_tokens 0",
        "chat",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        "max_completion_tokens",
    ),
    (
        "max_tokens and max_completion_tokens differ",
        "chat",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5, "max_completion_tokens": 3},
        "max_tokens",
    ),
    (
        "top_logprobs past 20",
        "chat",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    (
        "top_logprobs without logprobs",
        "chat",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "top_logprobs",
    ),
]


@pytest.mark.parametrize(
    ("what", "endpoint", "body", "param"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_requests_are_400_naming_the_field(
    base: str, what: str, endpoint: str, body: dict[str, Any] | bytes, param: str | None
) -> None:
    url = base + ("/v1/completions" if endpoint == "completions" else "/v1/chat/completions")
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=TIMEOUT)
    else:
        r = httpx.post(url, json=body, timeout=TIMEOUT)
    print(f"{what}: {r.status_code} {r.text}")
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if param is not None:
        assert param.split("[")[0].split(".")[0] in error["message"]


def test_openai_client_raises_on_a_bad_request(client: openai.OpenAI, base: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=_model(base), prompt="hi", max_tokens=100000)
    assert "max_tokens" in str(info.value)
    missing = httpx.get(base + "/v1/nothing", timeout=TIMEOUT)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_logprobs_in_both_formats(base: str) -> None:
    chat = httpx.post(
        base + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
              "logprobs": True, "top_logprobs": 3},
        timeout=TIMEOUT,
    ).json()  # fmt: skip
    text = httpx.post(
        base + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 4, "temperature": 0, "logprobs": 3},
        timeout=TIMEOUT,
    ).json()
    content = chat["choices"][0]["logprobs"]
    legacy = text["choices"][0]["logprobs"]
    print(f"chat logprobs {json.dumps(content)[:300]}\ncompletions logprobs {json.dumps(legacy)[:300]}")
    entries = content["content"]
    assert len(entries) == chat["usage"]["completion_tokens"]
    for e in entries:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 3 and isinstance(e["bytes"], list)
        assert e["top_logprobs"][0]["logprob"] >= e["logprob"]  # greedy: the chosen token is the most likely
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(legacy["top_logprobs"])
    # the legacy format keys alternatives by text: byte tokens of one character's parts share "\ufffd"
    assert all(1 <= len(t) <= 3 for t in legacy["top_logprobs"])
    for e in entries:
        assert e["token"].encode() == bytes(e["bytes"]) or e["token"] == "\ufffd"  # a part of a character


def test_client_disconnect_cancels_the_request(base: str) -> None:
    before = _metrics(base)
    body = {"prompt": "Once", "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        events = (line for line in r.iter_lines() if line)
        for _ in range(3):  # a few events, then hang up
            assert next(events).startswith("data: ")
    deadline = time.monotonic() + 10
    while True:
        m = _metrics(base)
        if m["infer_requests_running"] == 0 and m["infer_http_requests_in_flight"] == 0:
            break
        assert time.monotonic() < deadline, f"the row was not freed within 10 s: {m}"
        time.sleep(0.05)
    key = "infer_requests_total{endpoint=text,outcome=cancelled}"
    print(
        f"cancelled before {before.get(key, 0)}, after {m.get(key)}; "
        f"generated {m['infer_generation_tokens_total']}"
    )
    assert m.get(key, 0) == before.get(key, 0) + 1
    tokens = m["infer_generation_tokens_total"] - before["infer_generation_tokens_total"]
    assert tokens < 200  # the request did not run to its end


def test_metrics_parse_and_count(base: str) -> None:
    before = _metrics(base)
    r = httpx.post(
        base + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200
    after = _metrics(base)
    generated = r.json()["usage"]["completion_tokens"]
    for name in (
        "infer_requests_running",
        "infer_requests_waiting",
        "infer_batch_size",
        "infer_time_to_first_token_seconds_count",
        "infer_inter_token_latency_seconds_count",
        "infer_request_duration_seconds_count",
    ):
        assert name in after, f"{name} missing from /metrics"
    assert after["infer_generation_tokens_total"] - before["infer_generation_tokens_total"] == generated
    assert (
        after["infer_time_to_first_token_seconds_count"]
        == before["infer_time_to_first_token_seconds_count"] + 1
    )
    gaps = (
        after["infer_inter_token_latency_seconds_count"] - before["infer_inter_token_latency_seconds_count"]
    )
    assert gaps == generated - 1
    assert (
        after["infer_prompt_tokens_total"] - before["infer_prompt_tokens_total"]
        == r.json()["usage"]["prompt_tokens"]
    )


def test_api_key_on_every_endpoint_but_health(live_server: LiveServer, tiny_path: Path) -> None:
    import infer

    base = live_server(infer.load(tiny_path), api_key="sesame")
    body = {"prompt": "hi", "max_tokens": 2}
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions")]:  # fmt: skip
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            r = httpx.request(method, base + path, json=body, headers=headers, timeout=TIMEOUT)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(base + "/health", timeout=TIMEOUT).status_code == 200
    good = openai.OpenAI(base_url=base + "/v1", api_key="sesame", max_retries=0)
    assert (
        good.completions.create(model=_model_with_key(base), prompt="hi", max_tokens=2).choices[0].text
        is not None
    )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()


def _model_with_key(base: str) -> str:
    r = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer sesame"}, timeout=TIMEOUT)
    name: str = r.json()["data"][0]["id"]
    return name


class _FullEngine(FakeEngine):
    """An engine whose queue is always full."""

    def submit(self, prompt: Any, params: Any) -> Any:
        from infer.engine import EngineFull

        raise EngineFull("64 requests are waiting (max_waiting=64)")

    def stats(self) -> dict[str, int]:
        return {"running": 16, "waiting": 64}


def test_full_queue_is_429_with_retry_after(live_server: LiveServer, tiny_llm: Any) -> None:
    base = live_server(_FullEngine(tiny_llm))
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT)
    print(f"with a full queue: {r.status_code} Retry-After {r.headers.get('retry-after')} {r.text}")
    assert r.status_code == 429
    assert int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"


def test_more_choices_than_the_queue_holds_are_served(live_server: LiveServer, tiny_path: Path) -> None:
    """A response's choices queue together: ``n`` past max_batch + max_waiting on an idle server is
    served, not a 429 no retry could ever pass."""
    import infer

    base = live_server(infer.load(tiny_path, deterministic=True), max_batch=1, max_waiting=1)
    body = {"prompt": ["hi", "there"], "n": 3, "max_tokens": 2, "temperature": 0.8, "seed": 1}
    r = httpx.post(base + "/v1/completions", json=body, timeout=TIMEOUT)
    print(r.status_code, r.text[:300])
    assert r.status_code == 200
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(6))
    assert all(c["finish_reason"] in ("length", "stop") for c in choices)


REFUSALS: list[tuple[Exception, str | None]] = [
    (ParamError("logit_bias", "logit_bias: token id 5 is out of range [0, 4)"), "logit_bias"),
    (ParamTypeError("stop_token_ids", "stop_token_ids must be a list of ints, got str"), "stop_token_ids"),
    (ValueError("prompt has 300 tokens; the model's context is 256 tokens"), "prompt"),
    (ValueError("something else went wrong with top_p and seed"), None),  # no field guessed from the text
]


class _RefusingEngine(FakeEngine):
    """An engine that refuses a prompt ``[i]`` with ``REFUSALS[i]``'s error."""

    def submit(self, prompt: list[int], params: Any) -> Any:
        raise REFUSALS[prompt[0]][0]


def test_engine_refusals_are_400_naming_the_param_the_error_carries(
    live_server: LiveServer, tiny_llm: Any
) -> None:
    base = live_server(_RefusingEngine(tiny_llm))
    for i, (error, param) in enumerate(REFUSALS):
        r = httpx.post(base + "/v1/completions", json={"prompt": [i], "max_tokens": 2}, timeout=TIMEOUT)
        print(f"{error!r}: {r.status_code} {r.text}")
        assert r.status_code == 400
        assert r.json()["error"]["param"] == param and r.json()["error"]["message"] == str(error)


def test_create_app_takes_an_llm_or_any_engine_client(tiny_llm: Any) -> None:
    """An `infer.LLM`, or any engine with what `EngineClient` lists: one that describes a tokenizer
    and no model at all is served."""
    from types import SimpleNamespace

    from infer.serve import create_app

    with pytest.raises(TypeError, match=r"infer\.LLM or an engine"):
        create_app(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass the LLM"):
        create_app(FakeEngine(tiny_llm), max_batch=2)
    no_model = SimpleNamespace(tokenizer=tiny_llm.tokenizer, config=tiny_llm.config, eos_ids=tiny_llm.eos_ids)
    state = create_app(FakeEngine(no_model)).state.serve
    assert state.model.tokenizer is tiny_llm.tokenizer and state.model_name == "tiny"
    assert state.context == tiny_llm.config.max_position_embeddings
    state = create_app(tiny_llm).state.serve
    assert state.model.name == tiny_llm.source.name and state.model.vocab_size == tiny_llm.config.vocab_size


def test_a_burst_past_the_queue_is_refused_and_the_rest_served(
    live_server: LiveServer, tiny_path: Path
) -> None:
    """16 requests at once at max_batch=1, max_waiting=1: each is served correctly or refused with 429."""
    import infer

    llm = infer.load(tiny_path, deterministic=True)
    base = live_server(llm, max_batch=1, max_waiting=1)
    out: dict[int, httpx.Response] = {}
    barrier = threading.Barrier(16)

    def post(i: int) -> None:
        barrier.wait()
        body = {"prompt": f"request {i}", "max_tokens": 40, "temperature": 0, "return_token_ids": True}
        out[i] = httpx.post(base + "/v1/completions", json=body, timeout=TIMEOUT)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    codes = sorted(r.status_code for r in out.values())
    print(f"status codes: {codes}")
    assert len(out) == 16 and set(codes) <= {200, 429}
    assert 429 in codes and 200 in codes
    for i, r in out.items():
        if r.status_code == 429:
            assert "Retry-After" in r.headers
        else:
            expected = llm.generate(f"request {i}", max_new_tokens=40)
            assert r.json()["choices"][0]["token_ids"] == expected.token_ids
    deadline = time.monotonic() + 10
    while (m := _metrics(base))["infer_requests_running"] or m["infer_requests_waiting"]:
        assert time.monotonic() < deadline, f"rows were not freed: {m}"
        time.sleep(0.05)
