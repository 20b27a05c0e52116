"""The `infer` command line takes its options anywhere: before, between or after the positionals.

``infer generate MODEL.gguf --raw --max-new-tokens 8 "The capital of France is"`` exited 2
(``unrecognized arguments``): argparse filled both optional positionals (model, prompt) from the
first positional it met. Every order of each command that takes two positionals (generate: model
and prompt; perplexity: model and file) must run as the documented order does, and every order
of every command must parse to the same arguments.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infer.cli import build_parser, main
from infer.gguf.writer import write_gguf
from infer.testing import build_tokenizer, tiny_hf_model

PROMPT = "The capital of France is"
OPTIONS = ["--raw", "--max-new-tokens", "8", "--quiet"]
# Each order of `infer generate` with a model, as a user might type it: M model, P prompt.
GENERATE_ORDERS = {
    "model prompt options": ["M", "P", *OPTIONS],
    "model options prompt": ["M", *OPTIONS, "P"],
    "options model prompt": [*OPTIONS, "M", "P"],
    "option model options prompt": ["--raw", "M", "--max-new-tokens", "8", "--quiet", "P"],
    "model option prompt options": ["M", "--raw", "P", "--max-new-tokens", "8", "--quiet"],
}
PERPLEXITY_OPTIONS = ["--context", "16", "--max-chunks", "2", "--quiet"]
PERPLEXITY_ORDERS = {
    "model file options": ["M", "F", *PERPLEXITY_OPTIONS],
    "model options file": ["M", *PERPLEXITY_OPTIONS, "F"],
    "options model file": [*PERPLEXITY_OPTIONS, "M", "F"],
    "option model options file": ["--context", "16", "M", "--max-chunks", "2", "--quiet", "F"],
}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama GGUF and a text file."""
    root = tmp_path_factory.mktemp("orders")
    write_gguf(root / "model.gguf", tiny_hf_model("llama"), build_tokenizer(root / "tok"), qtype="Q8_0")
    (root / "text.txt").write_text("The history of the city begins in the Roman era. " * 20)
    return root


@pytest.fixture
def files(gguf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(gguf_dir / "cache"))
    yield {"M": str(gguf_dir / "model.gguf"), "F": str(gguf_dir / "text.txt"), "P": PROMPT}


def run(command: str, argv: list[str], files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> str:
    """``infer COMMAND ARGV`` (placeholders filled in): its stdout; it must exit 0."""
    code = main([command, *(files.get(a, a) for a in argv)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.mark.parametrize("order", GENERATE_ORDERS)
def test_generate_in_any_order(order: str, files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    got = run("generate", GENERATE_ORDERS[order], files, capsys)
    want = run("generate", GENERATE_ORDERS["model prompt options"], files, capsys)
    print(f"\n{order}: {got!r}")
    assert got == want and got.strip()


@pytest.mark.parametrize("order", PERPLEXITY_ORDERS)
def test_perplexity_in_any_order(
    order: str, files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    got = run("perplexity", PERPLEXITY_ORDERS[order], files, capsys)
    want = run("perplexity", PERPLEXITY_ORDERS["model file options"], files, capsys)
    print(f"\n{order}: {got!r}")
    assert got == want and "PPL" in got.upper()


# Orders that must parse alike, the first of each list the documented one (no model loaded).
PARSE_ORDERS = {
    "generate, the prompt alone": [
        ["P", "--raw", "--max-new-tokens", "8"],
        ["--raw", "--max-new-tokens", "8", "P"],
        ["--raw", "P", "--max-new-tokens", "8"],
    ],
    "generate, --debug and repeated --stop": [
        ["M", "P", "--stop", "x", "--stop", "y", "--debug"],
        ["M", "--stop", "x", "P", "--debug", "--stop", "y"],
        ["--debug", "--stop", "x", "M", "--stop", "y", "P"],
    ],
    "chat": [["M", "--quiet", "--max-new-tokens", "4"], ["--quiet", "M", "--max-new-tokens", "4"]],
    "inspect": [["M", "--dtype", "float32"], ["--dtype", "float32", "M"]],
    "serve": [["M", "--port", "9", "--quiet"], ["--port", "9", "M", "--quiet"]],
}


def parsed(argv: list[str]) -> dict[str, Any]:
    return vars(build_parser().parse_args([a if a not in ("M", "P") else f"<{a}>" for a in argv]))


@pytest.mark.parametrize(
    ("case", "index"), [(case, i) for case, orders in PARSE_ORDERS.items() for i in range(1, len(orders))]
)
def test_every_order_parses_alike(case: str, index: int) -> None:
    command = case.split(",")[0]
    orders = PARSE_ORDERS[case]
    want, got = parsed([command, *orders[0]]), parsed([command, *orders[index]])
    print(f"\n{case}: {orders[index]} -> {got}")
    assert got == want
