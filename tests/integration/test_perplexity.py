"""`infer.perplexity` / `infer perplexity`: llama-perplexity's recipe, checked against a hand computation.

The hand computation is written from the recipe (llama.cpp's ``perplexity``): the whole text
tokenized once (BOS in front when the tokenizer adds one), ``len // N`` chunks of ``N`` tokens,
each chunk's first token replaced by BOS (when the tokenizer adds one), the logits at
positions ``N/2 .. N-2`` scored against the next token, ``exp`` of the mean NLL. The logits
come from transformers' own model on the same weights, and from ``llm.model`` on whole chunks.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import infer
from infer.cli import main
from infer.perplexity import adds_bos, perplexity, read_text

TEXT = (
    "Perplexity is the exponential of the mean negative log-likelihood of the tokens a model "
    "is asked to predict; llama.cpp scores the second half of each chunk of N tokens. "
) * 3  # byte-level tokenizer: one token a byte, ~520 tokens


def hand_perplexity(
    tokens: list[int], context: int, bos: int | None, logits_of: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[float, int]:
    """``(ppl, scored tokens)`` from the recipe; ``logits_of(ids [1, N]) -> [N, V]``."""
    first = context // 2
    nlls: list[float] = []
    for c in range(len(tokens) // context):
        chunk = list(tokens[c * context : (c + 1) * context])
        if bos is not None:
            chunk[0] = bos
        logits = logits_of(torch.tensor([chunk])).double()
        logp = torch.log_softmax(logits, dim=-1)
        nlls += [-float(logp[j, chunk[j + 1]]) for j in range(first, context - 1)]
    return math.exp(sum(nlls) / len(nlls)), len(nlls)


def without_bos(path: Path, into: Path) -> Path:
    """A copy of checkpoint ``path`` whose tokenizer does not add BOS (no post-processor)."""
    target = into / "no-bos"
    shutil.copytree(path, target)
    tok = json.loads((target / "tokenizer.json").read_text())
    tok["post_processor"] = None
    (target / "tokenizer.json").write_text(json.dumps(tok))
    return target


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("bos", [True, False], ids=["adds-bos", "no-bos"])
@pytest.mark.parametrize("context", [32, 27])
def test_equals_the_hand_computation(
    arch: str,
    bos: bool,
    context: int,
    tiny_ckpt_factory: Callable[..., Path],
    hf_model_factory: Callable[..., Any],
    tmp_path: Path,
) -> None:
    path = tiny_ckpt_factory(arch)
    hf = hf_model_factory(path)
    if not bos:
        path = without_bos(path, tmp_path)
    llm = infer.load(path, dtype=torch.float32)
    assert adds_bos(llm.tokenizer) is bos
    result = llm.perplexity(TEXT, context)

    tokens = llm.tokenizer.encode(TEXT)  # the byte-level tokenizer: BOS + one token a byte
    assert tokens[0] == llm.tokenizer.bos_token_id if bos else len(tokens) == len(TEXT)
    bos_id = llm.tokenizer.bos_token_id if bos else None
    with torch.inference_mode():
        ref_hf, count = hand_perplexity(tokens, context, bos_id, lambda ids: hf(ids).logits[0])
        ref_ours, _ = hand_perplexity(tokens, context, bos_id, lambda ids: llm.model(ids)[0])
    n_chunks = len(tokens) // context
    assert (result.chunks, result.context, result.text_tokens) == (n_chunks, context, len(tokens))
    assert result.tokens == count == n_chunks * (context - context // 2 - 1)
    assert result.add_bos is bos
    err_hf = abs(result.ppl / ref_hf - 1)
    err_ours = abs(result.ppl / ref_ours - 1)
    print(
        f"\n{arch} N={context} bos={bos}: ppl {result.ppl:.6f}, transformers' logits {ref_hf:.6f} "
        f"(rel {err_hf:.2e}), whole-chunk logits {ref_ours:.6f} (rel {err_ours:.2e})"
    )
    assert err_hf < 1e-5  # float32 rounding of two implementations
    assert err_ours < 1e-9  # the same model: only the head's row count differs
    assert math.isclose(result.nll, math.log(result.ppl), rel_tol=1e-12)
    assert result.ppl_error > 0


def test_batches_and_max_chunks(tiny_ckpt_factory: Callable[..., Path]) -> None:
    llm = infer.load(tiny_ckpt_factory("llama"), dtype=torch.float32)
    one = perplexity(llm, TEXT, 32)
    seen: list[tuple[int, int, float]] = []
    batched = perplexity(llm, TEXT, 32, batch=3, progress=lambda *a: seen.append(a))
    print(f"\nbatch 1: {one.ppl:.8f}, batch 3: {batched.ppl:.8f}")
    assert math.isclose(batched.ppl, one.ppl, rel_tol=1e-6)
    assert [s[:2] for s in seen] == [(d, one.chunks) for d in range(3, one.chunks, 3)] + [
        (one.chunks, one.chunks)
    ]
    assert math.isclose(seen[-1][2], batched.ppl, rel_tol=1e-12)
    two = perplexity(llm, TEXT, 32, max_chunks=2)
    assert (two.chunks, two.tokens) == (2, 2 * 15)
    assert perplexity(llm, TEXT, 32, max_chunks=10_000).chunks == one.chunks


BAD_ARGUMENTS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"context": 2}, ValueError, "context must be an int in [3, 256], got 2"),
    ({"context": 257}, ValueError, "context must be an int in [3, 256], got 257"),
    ({"context": True}, TypeError, "context must be an int, got True (bool)"),
    ({"context": 32.0}, TypeError, "context must be an int, got 32.0 (float)"),
    ({"batch": 0}, ValueError, "batch must be an int >= 1, got 0"),
    ({"max_chunks": 0}, ValueError, "max_chunks must be an int >= 1, got 0"),
    ({"text": ""}, ValueError, "text is empty"),
    ({"text": b"bytes"}, TypeError, "text must be a string, got bytes"),
    ({"text": "short", "context": 4}, ValueError, "the text tokenizes to 6 tokens; a context of 4 needs"),
    ({"progress": 3}, TypeError, "progress must be callable, got int"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD_ARGUMENTS, ids=lambda v: str(v)[:40])
def test_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], message: str, tiny_ckpt_factory: Callable[..., Path]
) -> None:
    llm = infer.load(tiny_ckpt_factory("llama"), dtype=torch.float32)
    args: dict[str, Any] = {"text": TEXT, "context": 32, **kwargs}
    with pytest.raises(error) as info:
        perplexity(llm, **args)
    print(f"\n{type(info.value).__name__}: {info.value}")
    assert message in str(info.value)


def test_read_text(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("héllo\n\n", encoding="utf-8")
    assert read_text(f) == "héllo\n"  # one trailing newline dropped, as llama.cpp's -f does
    assert read_text(f, 2) == "h"  # the cut falls inside "é": the incomplete character is dropped
    assert read_text(f, 3) == "hé"
    (tmp_path / "bad.txt").write_bytes(b"ab\xffcd")
    with pytest.raises(ValueError, match=r"bad.txt: not UTF-8 text \(byte 2: invalid start byte\)"):
        read_text(tmp_path / "bad.txt")
    with pytest.raises(ValueError, match="max_bytes must be an int >= 1, got 0"):
        read_text(f, 0)


def test_cli_prints_the_api_result(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tiny_ckpt_factory("qwen3")
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT + "\n")
    argv = ["perplexity", str(path), str(text_file), "--context", "32", "--dtype", "float32"]
    assert main([*argv, "--quiet", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    llm = infer.load(path, dtype=torch.float32)
    expected = perplexity(llm, TEXT, 32, batch=2)
    assert main([*argv, "--quiet", "--bytes", "200", "--max-chunks", "3"]) == 0
    out_cut = capsys.readouterr().out
    print(f"\n{out.strip()}\n{out_cut.strip()}")
    assert out == f"{expected}\n"
    assert out.startswith(f"PPL = {expected.ppl:.4f} +/- {expected.ppl_error:.5f} (mean NLL ")
    assert out_cut == f"{perplexity(llm, TEXT[:200], 32, max_chunks=3)}\n"


def test_cli_errors(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tiny_ckpt_factory("llama"))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    assert main(["perplexity", path, str(short), "--context", "32", "--quiet"]) == 1
    err = capsys.readouterr().err
    print(f"\n{err.strip()}")
    assert err == (
        "infer: error: the text tokenizes to 10 tokens; a context of 32 needs at least 64 (two chunks): "
        "give a longer text or a smaller context\n"
    )
    assert main(["perplexity", path, str(tmp_path / "missing.txt"), "--quiet"]) == 1
    assert "No such file or directory" in capsys.readouterr().err
    assert main(["perplexity", path, str(short), "--context", "300", "--quiet"]) == 1
    assert capsys.readouterr().err == "infer: error: context must be an int in [3, 256], got 300\n"


@pytest.mark.parametrize(
    "option",
    [["--context", "2"], ["--context", "ten"], ["--batch", "0"], ["--max-chunks", "0"], ["--bytes", "-1"]],
)
def test_cli_bad_option_values_are_usage_errors(
    option: list[str], tiny_ckpt_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["perplexity", str(tiny_ckpt_factory("llama")), "text.txt", *option])
    err = capsys.readouterr().err
    print(f"\n{err.strip().splitlines()[-1]}")
    assert exit_info.value.code == 2
    assert f"error: argument {option[0]}: " in err and "Traceback" not in err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_cli_progress_bar_on_a_terminal(
    tiny_ckpt_factory: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("TQDM_NCOLS", "100")
    argv = ["perplexity", str(tiny_ckpt_factory("llama")), str(text_file), "--context", "32", "--batch", "5"]
    assert main(argv) == 0
    bar = err.getvalue()
    out = capsys.readouterr().out
    print(f"\n{bar.split(chr(13))[-2].strip()}")
    assert "perplexity: 100%" in bar and "15/15" in bar and "ppl " in bar
    assert out.startswith("PPL = ") and out.count("\n") == 1
    assert main([*argv, "--quiet"]) == 0
    assert "perplexity:" not in err.getvalue()[len(bar) :]
