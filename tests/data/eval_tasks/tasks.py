"""The datasets of the local lm-eval tasks (tests/integration/test_evaluation.py): read from the
JSON Lines files beside this one, so the tasks run without a network (``custom_dataset``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _split(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]


def _dataset(**splits: str) -> Any:
    import datasets

    return datasets.DatasetDict({k: datasets.Dataset.from_list(_split(v)) for k, v in splits.items()})


def choices(**kwargs: Any) -> Any:
    return _dataset(train="choices_train.jsonl", test="choices_test.jsonl")


def texts(**kwargs: Any) -> Any:
    return _dataset(test="texts.jsonl")


def answers(**kwargs: Any) -> Any:
    return _dataset(train="answers_train.jsonl", test="answers_test.jsonl")
