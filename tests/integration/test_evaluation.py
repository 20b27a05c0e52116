"""`infer.evaluation`: lm-eval's tasks through ``model="infer"`` give lm-eval's ``model="hf"`` scores.

Three local tasks (tests/data/eval_tasks: a multiple-choice, a rolling-loglikelihood and a
generate_until task, data shipped as JSON Lines, no network) run on a tiny checkpoint through
lm-eval's own transformers backend and through infer's, with two few-shot examples and a
``max_length`` short enough that contexts are truncated from the left and the texts are cut into
several rolling windows. Every per-sample loglikelihood must be within 1e-4 nats (or 1e-5 of its
magnitude) of the hf backend's, every greedy flag and generated text the same, and the task
metrics equal.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

lm_eval = pytest.importorskip("lm_eval")

TASKS_DIR = Path(__file__).resolve().parents[1] / "data" / "eval_tasks"
TASKS = ["tiny_choices", "tiny_texts", "tiny_answers"]
MAX_LENGTH = 48  # tokens: the few-shot contexts are ~130, the texts up to ~220 (byte tokenizer)
ABS, REL = 1e-4, 1e-5


def evaluate(model: Any, model_args: str | None = None, **kwargs: Any) -> dict[str, Any]:
    from lm_eval.tasks import TaskManager

    import infer.evaluation  # noqa: F401  (registers "infer")

    tasks = TaskManager(include_path=str(TASKS_DIR))
    result: dict[str, Any] = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=TASKS, task_manager=tasks, num_fewshot=2,
        log_samples=True, batch_size=4, device="cpu", **kwargs,
    )  # fmt: skip
    return result


def scores(result: dict[str, Any], task: str) -> list[list[Any]]:
    """Each sample's responses (lm-eval's ``resps``: one list per request), by doc id."""
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> float:
    """The largest loglikelihood error; asserts the tolerance, the greedy flags, texts and metrics."""
    worst = 0.0
    for task in TASKS:
        a, b = scores(ours, task), scores(theirs, task)
        assert len(a) == len(b), task
        for doc, (x, y) in enumerate(zip(a, b, strict=True)):
            for r, (mine, ref) in enumerate(zip(x, y, strict=True)):
                mine, ref = mine[0], ref[0]
                if task == "tiny_answers":
                    assert mine == ref, f"{task} doc {doc}: generated {mine!r}, hf generated {ref!r}"
                    continue
                if task == "tiny_choices":
                    assert mine[1] == ref[1], f"{task} doc {doc} choice {r}: greedy {mine[1]}, hf {ref[1]}"
                    mine, ref = mine[0], ref[0]
                err = abs(mine - ref)
                worst = max(worst, err)
                assert err <= max(ABS, REL * abs(ref)), f"{task} doc {doc} request {r}: {mine} vs hf {ref}"
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float) and "perplexity" not in metric and "stderr" not in metric:
                assert math.isclose(ours["results"][task][metric], value, rel_tol=1e-6), (task, metric)
    return worst


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from infer.testing import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("eval-llama"), "llama")


@pytest.fixture(scope="module")
def hf_result(checkpoint: Path) -> dict[str, Any]:
    return evaluate("hf", f"pretrained={checkpoint},dtype=float32,max_length={MAX_LENGTH}")


@pytest.mark.slow
def test_registered_name_matches_hf(checkpoint: Path, hf_result: dict[str, Any]) -> None:
    """``model="infer"`` with ``model_args`` (loaded by the backend, deterministic mode)."""
    ours = evaluate(
        "infer", f"pretrained={checkpoint},dtype=float32,deterministic=True,max_length={MAX_LENGTH}"
    )
    worst = compare(ours, hf_result)
    print(f"model='infer' (deterministic) vs model='hf': largest loglikelihood error {worst:.2e} nats")


@pytest.mark.slow
def test_loaded_llm_matches_hf(checkpoint: Path, hf_result: dict[str, Any]) -> None:
    """``InferLM(llm)`` over an `infer.LLM` already loaded, in the default mode."""
    import infer
    from infer.evaluation import InferLM

    llm = infer.load(checkpoint, dtype="float32")
    ours = evaluate(InferLM(llm, max_length=MAX_LENGTH, batch_size=3))
    worst = compare(ours, hf_result)
    print(f"InferLM(llm) (default mode) vs model='hf': largest loglikelihood error {worst:.2e} nats")


def test_bad_arguments_are_named(checkpoint: Path) -> None:
    import infer
    from infer.evaluation import InferLM

    llm = infer.load(checkpoint, dtype="float32")
    with pytest.raises(ValueError, match="max_length"):
        InferLM(llm, max_length=10_000)
    with pytest.raises(ValueError, match="batch_size"):
        InferLM(llm, batch_size=0)
    with pytest.raises(TypeError, match="pretrained"):
        InferLM(None)
    with pytest.raises(ValueError, match="num_beams"):
        InferLM._sampling({"do_sample": False, "temperature": 0.0, "num_beams": 4})
    # Refused, not converted: a string deterministic turned the mode on, 2.7 became 2.
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        InferLM(str(checkpoint), deterministic="False")  # type: ignore[arg-type]
    for bad in (2.7, True, "x"):
        with pytest.raises(ValueError, match="batch_size"):
            InferLM(llm, batch_size=bad)  # type: ignore[arg-type]
    assert InferLM(llm, batch_size="3").batch == 3
    with pytest.raises(TypeError, match="max_length must be an int"):
        InferLM(llm, max_length="abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_gen_toks must be an int >= 1"):
        InferLM(llm, max_gen_toks=0)


def test_a_requests_seed_draws_as_alone_at_any_batch_size(checkpoint: Path) -> None:
    """lm-eval's ``seed`` gen_kwarg is the request's own: three equal seeded requests in one batch
    give the text the request gives alone (before, rows 1 and 2 drew derived seeds)."""
    from lm_eval.api.instance import Instance

    import infer
    from infer.evaluation import InferLM

    llm = infer.load(checkpoint, dtype="float32")
    kwargs = {"do_sample": True, "temperature": 0.8, "seed": 3, "max_gen_toks": 8}

    def request() -> Instance:
        return Instance("generate_until", {}, ("Once upon a time", dict(kwargs)), 0)

    alone = InferLM(llm, batch_size=1).generate_until([request()])
    batched = InferLM(llm, batch_size=3).generate_until([request(), request(), request()])
    print(alone, batched)
    assert batched == alone * 3


@pytest.mark.slow
def test_cli_prints_lm_evals_table_and_writes_the_samples(
    checkpoint: Path, hf_result: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``infer eval``: lm-eval's table on stdout; ``--output-path``'s samples are the hf backend's."""
    import json

    from infer.cli import main

    out = tmp_path / "results.json"
    code = main([
        "eval", str(checkpoint), "--tasks", "tiny_choices", "--include-path", str(TASKS_DIR), "--limit", "4",
        "--num-fewshot", "2", "--batch-size", "5", "--max-length", str(MAX_LENGTH), "--dtype", "float32",
        "--output-path", str(out), "--quiet",
    ])  # fmt: skip
    printed = capsys.readouterr().out
    print(printed)
    assert code == 0
    assert "tiny_choices" in printed and "acc" in printed and "|" in printed
    samples = {s["doc_id"]: s["resps"] for s in json.loads(out.read_text())["samples"]["tiny_choices"]}
    assert sorted(samples) == [0, 1, 2, 3]
    for s in hf_result["samples"]["tiny_choices"]:
        if s["doc_id"] in samples:
            for (mine,), (ref,) in zip(samples[s["doc_id"]], s["resps"], strict=True):
                assert abs(float(mine[0]) - ref[0]) <= ABS and bool(mine[1]) == ref[1]


def test_cli_names_an_unknown_task(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from infer.cli import main

    code = main(
        ["eval", str(checkpoint), "--tasks", "tiny_choices,no_such_task", "--include-path", str(TASKS_DIR)]
    )
    err = capsys.readouterr().err
    print(err)
    assert code == 1 and "no_such_task" in err and "--tasks" in err
    missing = main(
        ["eval", str(checkpoint), "--tasks", "tiny_choices", "--include-path", str(TASKS_DIR / "nope")]
    )
    err = capsys.readouterr().err
    assert missing == 2 and "--include-path" in err and "not a directory" in err
    from infer.cli import build_parser

    assert build_parser().parse_args(["eval", "--tasks", "x", "--batch-size", "auto"]).batch_size == "auto"
