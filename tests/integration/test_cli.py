"""The `infer` command line: generate, chat, inspect, one-line errors."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from infer.cli import main


def test_generate_streams_text(
    tiny_ckpt_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    import infer

    path = tiny_ckpt_factory("llama")
    assert main(["generate", str(path), "Hello", "--max-new-tokens", "12", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out == infer.load(path).generate("Hello", max_new_tokens=12).text + "\n"


def test_chat_keeps_the_conversation(
    tiny_ckpt_factory: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import infer

    path = tiny_ckpt_factory("qwen3")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nand more\n/exit\n"))
    assert main(["chat", str(path), "--max-new-tokens", "6", "--quiet"]) == 0
    lines = capsys.readouterr().out.split("\n")
    llm = infer.load(path)
    first = llm.chat([{"role": "user", "content": "hi"}], max_new_tokens=6).text
    second = llm.chat(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "and more"},
        ],
        max_new_tokens=6,
    ).text
    assert "\n".join(lines).startswith(first + "\n" + second + "\n")


def test_inspect(tiny_ckpt_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]) -> None:
    path = tiny_ckpt_factory("gemma3")
    assert main(["inspect", str(path), "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert "architecture  gemma3_text: 4 layers, hidden 64" in out
    assert "parameters    215,360" in out
    assert "KV cache      72.00 KiB for batch 1 x 64 tokens at float32 (ring buffers" in out
    assert "layer 1 (full_attention, 13 tensors" in out
    assert "model.layers.3.self_attn.q_norm.weight" in out


def test_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "/no/such/model", "Hello"]) == 1
    err = capsys.readouterr().err
    assert err == "infer: error: no such file or directory: /no/such/model\n"
    with pytest.raises(FileNotFoundError):
        main(["--debug", "generate", "/no/such/model", "Hello"])
