"""Completions' ``echo`` and ``logprobs`` of the prompt, ``max_tokens: 0``, ``/tokenize`` and
``/detokenize``, over 127.0.0.1 with the official `openai` client and httpx, and lm-eval's
``local-completions`` against the server.

The prompt's logprobs are checked against transformers' own model on the same weights (float32
``log_softmax`` of its logits); lm-eval's API backend's loglikelihoods against the in-process
``model="infer"`` backend's (`infer.evaluation`, itself checked against ``model="hf"`` in
tests/integration/test_evaluation.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from .clients import openai_client, served_model
from .fake_engine import FakeEngine

LiveServer = Callable[..., str]
TIMEOUT = httpx.Timeout(60.0)
PROMPT = "The cat sat on the mat."
TASKS_DIR = Path(__file__).resolve().parents[1] / "data" / "eval_tasks"


@pytest.fixture(scope="module")
def base(live_server: LiveServer, tiny_llm: Any) -> str:
    return live_server(tiny_llm, max_batch=4, max_waiting=64)


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai_client(base)


_model = served_model


def _reference(hf_model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-probabilities ``[len - 1, V]`` of ``ids[1:]``'s positions."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def test_echo_logprobs_with_max_tokens_0(
    client: openai.OpenAI, base: str, tiny_llm: Any, tiny_path: Path, hf_model_factory: Callable[..., Any]
) -> None:
    """The prompt back with its tokens, their logprobs (the first null), the top 3 alternatives at
    each position and the offsets of the tokens' texts — transformers' numbers, nothing generated."""
    out = client.completions.create(
        model=_model(base), prompt=PROMPT, echo=True, max_tokens=0, logprobs=3, temperature=0
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    ids = tiny_llm.tokenizer.encode(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage is not None and out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    assert lp.tokens == [tiny_llm.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    ref = _reference(hf_model_factory(tiny_path), ids)
    expected = ref.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    served = torch.tensor(lp.token_logprobs[1:])
    err = float((served - expected).abs().max())
    print(f"echo logprobs of {len(ids)} prompt tokens vs transformers: max error {err:.2e}")
    assert err < 1e-4
    for i, top in enumerate(lp.top_logprobs[1:]):
        values, indices = ref[i].topk(3)
        expected_top: dict[str, float] = {}
        for t, v in zip(indices.tolist(), values.tolist(), strict=True):  # one text: its likeliest token
            expected_top.setdefault(tiny_llm.tokenizer.decode([t], skip_special_tokens=False), v)
        assert top is not None and list(top) == list(expected_top), (i, top, expected_top)
        assert list(top.values()) == pytest.approx(list(expected_top.values()), abs=1e-4)
        assert max(top.values()) >= lp.token_logprobs[i + 1]


def test_lm_eval_payload_batch_of_token_prompts(base: str, tiny_llm: Any) -> None:
    """lm-eval's request (``echo``, ``max_tokens: 1``, ``logprobs: 1``, prompts as token ids): a
    choice per prompt, the prompt's entries then the generated token's."""
    prompts = [tiny_llm.tokenizer.encode("Question: two plus two?"), tiny_llm.tokenizer.encode("Hi")]
    body = {"model": _model(base), "prompt": prompts, "echo": True, "max_tokens": 1, "logprobs": 1,
            "temperature": 0, "seed": 1234}  # fmt: skip
    r = httpx.post(base + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for ids, choice in zip(prompts, out["choices"], strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None
        assert choice["text"].startswith(tiny_llm.tokenizer.decode(ids, skip_special_tokens=False))
        assert lp["text_offset"][-1] == len(tiny_llm.tokenizer.decode(ids, skip_special_tokens=False))
        alone = tiny_llm.score(ids, top_k=1)  # the in-process scores of the same prompt
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(alone.logprobs.tolist(), abs=1e-5)
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


def test_echo_without_logprobs_prepends_the_prompt(client: openai.OpenAI, base: str, tiny_llm: Any) -> None:
    plain = client.completions.create(model=_model(base), prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model=_model(base), prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.choices[0].logprobs is None


REFUSED = [
    ("echo with stream", {"prompt": "hi", "echo": True, "stream": True}, "echo"),
    ("logprobs past 20", {"prompt": "hi", "echo": True, "max_tokens": 0, "logprobs": 21}, "logprobs"),
    ("best_of 2", {"prompt": "hi", "echo": True, "max_tokens": 0, "best_of": 2}, "best_of"),
    ("max_tokens 0 without echo", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("prompt past the context", {"prompt": [5] * 300, "echo": True, "max_tokens": 0}, "prompt"),
    ("suffix", {"prompt": "hi", "echo": True, "suffix": "x"}, "suffix"),
    # Scored before the engine sees them: their ids are checked before scoring.
    (
        "an id past the vocabulary, scored",
        {"prompt": [1, 10**8], "echo": True, "max_tokens": 1, "logprobs": 0},
        "prompt",
    ),
    ("a negative id, scored", {"prompt": [-3, 1, 2], "echo": True, "max_tokens": 1, "logprobs": 0}, "prompt"),
    (
        "a batch with one bad id, scored",
        {"prompt": [[1, 2], [1, 10**8]], "echo": True, "logprobs": 1},
        "prompt",
    ),
    (
        "prompt past the context, scored",
        {"prompt": [5] * 300, "echo": True, "max_tokens": 1, "logprobs": 0},
        "prompt",
    ),
]


@pytest.mark.parametrize(("what", "body", "param"), REFUSED, ids=[r[0] for r in REFUSED])
def test_what_cannot_be_honoured_is_a_400_naming_it(
    base: str, what: str, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(base + "/v1/completions", json=body, timeout=TIMEOUT)
    print(f"{what}: {r.status_code} {r.text}")
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_echo_logprobs_without_a_resident_model_is_a_400(live_server: LiveServer, tiny_llm: Any) -> None:
    """An engine that is not infer's (no model in this process to score with): refused, not guessed."""
    base = live_server(FakeEngine(tiny_llm))
    r = httpx.post(
        base + "/v1/completions",
        json={"prompt": "hi", "echo": True, "max_tokens": 0, "logprobs": 1},
        timeout=TIMEOUT,
    )
    print(r.text)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_tokenize_detokenize_and_tokenizer_info(base: str, tiny_llm: Any) -> None:
    tok = tiny_llm.tokenizer
    vllm = httpx.post(base + "/tokenize", json={"prompt": PROMPT}, timeout=TIMEOUT).json()
    assert vllm["tokens"] == tok.encode(PROMPT) and vllm["count"] == len(vllm["tokens"])
    assert vllm["max_model_len"] == tiny_llm.config.max_position_embeddings
    plain = httpx.post(
        base + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}, timeout=TIMEOUT
    )
    assert plain.json()["tokens"] == tok.encode(PROMPT, add_special_tokens=False)
    llama = httpx.post(
        base + "/tokenize", json={"content": "ab", "with_pieces": True}, timeout=TIMEOUT
    ).json()
    assert llama["tokens"] == [
        {"id": t, "piece": tok.decode([t])} for t in tok.encode("ab", add_special_tokens=False)
    ]
    back = httpx.post(base + "/detokenize", json={"tokens": vllm["tokens"]}, timeout=TIMEOUT).json()
    assert back["prompt"] == back["content"] == tok.decode(vllm["tokens"], skip_special_tokens=False)
    bad = httpx.post(base + "/detokenize", json={"tokens": [1, 10**6]}, timeout=TIMEOUT)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
    info = httpx.get(base + "/tokenizer_info", timeout=TIMEOUT).json()
    assert info["eos_token"] == "<|end|>" and info["bos_token"] == "<|begin|>"
    assert info["chat_template"] == tok.chat_template


@pytest.mark.slow
def test_lm_eval_local_completions_gives_the_in_process_scores(
    base: str, tiny_llm: Any, tiny_path: Path
) -> None:
    """lm-eval's ``local-completions`` against the server: every per-sample loglikelihood of the
    multiple-choice and rolling tasks within 1e-4 nats (1e-5 of its magnitude) of ``InferLM``'s on
    the same LLM, the same greedy flags, the same generated texts. The API backend keeps one
    position for the generated token and one more for rolling windows, so it is given
    ``max_length`` 2 more than the in-process backend (the same truncation and windows)."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from infer.evaluation import InferLM

    M = 48
    tasks = TaskManager(include_path=str(TASKS_DIR))

    def run(model: Any, model_args: str | None, names: list[str]) -> dict[str, Any]:
        result: dict[str, Any] = lm_eval.simple_evaluate(
            model=model, model_args=model_args, tasks=names, task_manager=tasks, num_fewshot=2,
            log_samples=True, batch_size=4,
        )  # fmt: skip
        return result

    api = (
        f"model={_model(base)},base_url={base}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={tiny_path},add_bos_token=True,max_retries=1,num_concurrent=1"
    )
    scored = ["tiny_choices", "tiny_texts"]
    over_http = run("local-completions", api + f",max_length={M + 2}", scored)
    in_process = run(InferLM(tiny_llm, max_length=M), None, scored)
    worst = 0.0
    for task in scored:
        a = sorted(over_http["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(in_process["samples"][task], key=lambda s: s["doc_id"])
        assert len(a) == len(b) > 0
        for x, y in zip(a, b, strict=True):
            for http, ours in zip(x["resps"], y["resps"], strict=True):
                http, ours = http[0], ours[0]
                if isinstance(ours, tuple | list):
                    assert bool(http[1]) == ours[1], f"{task} doc {x['doc_id']}: greedy differs"
                    http, ours = http[0], ours[0]
                err = abs(http - ours)
                worst = max(worst, err)
                assert err <= max(1e-4, 1e-5 * abs(ours)), f"{task} doc {x['doc_id']}: {http} vs {ours}"
    print(f"local-completions vs in-process: largest loglikelihood error {worst:.2e} nats")
    # generation: the API backend leaves contexts max_length - 1 - max_gen_toks tokens
    gen_http = run("local-completions", api + f",max_length={M + 1}", ["tiny_answers"])
    gen_ours = run(InferLM(tiny_llm, max_length=M), None, ["tiny_answers"])
    texts_http = [s["resps"] for s in sorted(gen_http["samples"]["tiny_answers"], key=lambda s: s["doc_id"])]
    texts_ours = [s["resps"] for s in sorted(gen_ours["samples"]["tiny_answers"], key=lambda s: s["doc_id"])]
    print(f"generated over HTTP {texts_http}\ngenerated in process {texts_ours}")
    assert texts_http == texts_ours
