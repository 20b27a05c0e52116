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
    assert main(["generate", str(path), "Hello", "--max-new-tokens", "12", "--quiet", "--raw"]) == 0
    out = capsys.readouterr().out
    assert out == infer.load(path).generate("Hello", max_new_tokens=12).text + "\n"


def test_generate_applies_the_chat_template(
    tiny_ckpt_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """An instruct model (its tokenizer has a chat template) answers the prompt as a user turn (mlx-lm)."""
    import infer

    path = tiny_ckpt_factory("llama")
    llm = infer.load(path)
    assert llm.tokenizer.chat_template is not None
    assert main(["generate", str(path), "Hello", "--max-new-tokens", "12", "--quiet"]) == 0
    templated = capsys.readouterr().out
    ids = llm.chat_prompt([{"role": "user", "content": "Hello"}])
    assert templated == llm.generate(ids, max_new_tokens=12).text + "\n"
    argv = ["generate", str(path), "Hello", "--max-new-tokens", "12", "--quiet", "--system", "Be brief."]
    assert main(argv) == 0
    with_system = capsys.readouterr().out
    ids = llm.chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert with_system == llm.generate(ids, max_new_tokens=12).text + "\n"
    raw = llm.generate("Hello", max_new_tokens=12).text + "\n"
    print(f"templated {templated!r}, raw {raw!r}")
    assert templated != raw  # the template is applied (a different prompt gives other tokens)


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
    # What generation allocates (no rings), then what rings on the sliding layers would need.
    kv = "KV cache      128.00 KiB for batch 1 x 64 tokens at float32"
    assert f"{kv} (ring buffers on sliding layers would need 72.00 KiB)" in out
    assert "layer 1 (full_attention, 13 tensors" in out
    assert "model.layers.3.self_attn.q_norm.weight" in out


def test_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "/no/such/model", "Hello"]) == 1
    err = capsys.readouterr().err
    assert err == "infer: error: no such file or directory: /no/such/model\n"
    with pytest.raises(FileNotFoundError):
        main(["--debug", "generate", "/no/such/model", "Hello"])


BAD_OPTIONS = [
    ["inspect", "MODEL", "--context", "-5", "--batch-size", "0"],
    ["inspect", "MODEL", "--batch-size", "0"],
    ["inspect", "MODEL", "--context", "ten"],
    ["generate", "MODEL", "Hi", "--max-new-tokens", "0"],
    ["generate", "MODEL", "Hi", "--max-new-tokens", "2.5"],
    ["generate", "MODEL", "Hi", "--temperature", "nan"],
    ["generate", "MODEL", "Hi", "--temperature", "-1"],
    ["generate", "MODEL", "Hi", "--temperature", "inf"],
    ["generate", "MODEL", "Hi", "--top-k", "1.5"],
    ["generate", "MODEL", "Hi", "--top-k", "-1"],
    ["generate", "MODEL", "Hi", "--top-p", "0"],
    ["generate", "MODEL", "Hi", "--top-p", "1.5"],
    ["generate", "MODEL", "Hi", "--seed", str(2**70)],
    ["generate", "MODEL", "Hi", "--seed", "-1"],
    ["generate", "MODEL", "Hi", "--group-size", "0"],
    ["generate", "MODEL", "Hi", "--memory-budget", "9" * 400],
    ["generate", "MODEL", "Hi", "--memory-budget", "12XB"],
    ["generate", "MODEL", "Hi", "--dtype", "int8"],
    ["generate", "MODEL", "Hi", "--lookup", "-1"],
    ["generate", "MODEL", "Hi", "--speculative-tokens", "0"],
    ["chat", "MODEL", "--max-new-tokens", "-3"],
    ["serve", "MODEL", "--spec-draft-n-max", "33"],
    ["serve", "MODEL", "--port", "70000"],
    ["serve", "MODEL", "--max-batch", "0"],
    ["serve", "MODEL", "--max-waiting", "-1"],
    ["serve", "MODEL", "--shutdown-timeout", "nan"],
]


@pytest.mark.parametrize(
    "argv", BAD_OPTIONS, ids=lambda a: " ".join(a[2:] if a[0] == "generate" else a[1:])[:60]
)
def test_bad_option_values_are_usage_errors(
    argv: list[str], tiny_ckpt_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(tiny_ckpt_factory("llama")) if a == "MODEL" else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    print(f"\n{err.strip().splitlines()[-1]}")
    assert exit_info.value.code == 2
    assert "error: argument --" in err and len(err) < 2000
    assert "Traceback" not in err


def test_budget_error_advice_is_printed_in_full(
    tiny_ckpt_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tiny_ckpt_factory("llama"))
    capsys.readouterr()  # what writing the checkpoint printed (transformers' progress bar) is not the CLI's
    assert main(["generate", path, "Hello", "--memory-budget", "1KB", "--quiet"]) == 1
    err = capsys.readouterr().err
    print(f"\n{err}")
    assert err.startswith("infer: error: ")
    assert len(err.strip().splitlines()) > 1  # the "what would fit" lines follow the first
    assert "Traceback" not in err


def test_exit_codes_are_documented(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["generate", "--help"], ["inspect", "--help"], ["serve", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        out = " ".join(capsys.readouterr().out.split())
        assert (
            "exit status: 0 success, 1 error" in out and "2 usage error" in out and "130 interrupted" in out
        )


def test_interrupt_exits_130(monkeypatch: pytest.MonkeyPatch, tiny_ckpt_factory: Callable[..., Path]) -> None:
    import infer

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(infer, "load", interrupted)
    assert main(["generate", str(tiny_ckpt_factory("llama")), "Hello"]) == 130


def test_runtime_errors_stay_one_line(
    tiny_ckpt_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tiny_ckpt_factory("llama"))
    assert main(["generate", path, "", "--quiet"]) == 1
    assert capsys.readouterr().err == "infer: error: prompt is empty (an empty string)\n"


# torch's message when a nested compile region met inputs sharing a storage (issue 40): the
# first line ends with a colon, the reason is on the next line after a blank one.
DYNAMO_ERROR = (
    "This higher order operator doesn't work unless it is captured completely with torch.compile. "
    "Got graph break/error:\n\nEncountered aliasing during higher order op tracing\n"
    "  Higher Order Operator: torch.ops.higher_order.invoke_subgraph\n"
    "  Explanation: Higher order ops do not support aliasing. Found in invoke_subgraph\n"
)


@pytest.mark.parametrize(
    ("message", "line"),
    [
        (
            DYNAMO_ERROR,
            "This higher order operator doesn't work unless it is captured completely with torch.compile. "
            "Got graph break/error: Encountered aliasing during higher order op tracing",
        ),
        ("missing tensors:\n  model.norm.weight\n  lm_head.weight", "missing tensors: model.norm.weight"),
        ("bad header\nat byte 12", "bad header"),
    ],
    ids=["reason after a colon", "a list after a colon", "detail after a sentence"],
)
def test_a_one_line_error_keeps_its_reason(
    message: str,
    line: str,
    monkeypatch: pytest.MonkeyPatch,
    tiny_ckpt_factory: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    import infer

    def failing(*args: object, **kwargs: object) -> None:
        raise RuntimeError(message)

    monkeypatch.setattr(infer, "load", failing)
    argv = ["generate", str(tiny_ckpt_factory("llama")), "Hello", "--quiet"]
    capsys.readouterr()  # (building the checkpoint wrote a progress bar)
    assert main(argv) == 1
    err = capsys.readouterr().err
    print(f"\n{err}")
    assert err == f"infer: error: {line}\n"
    with pytest.raises(RuntimeError) as raised:
        main([*argv, "--debug"])  # the traceback, the whole message
    assert str(raised.value) == message


# ---- positionals, and options that need another -------------------------------------------


def _forbid_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """A usage error must come before any model loads: `infer.load` fails the test if called."""
    import infer

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing may load")

    monkeypatch.setattr(infer, "load", no_load)


@pytest.mark.parametrize(
    ("command", "what"), [("generate", "prompt"), ("perplexity", "text file")], ids=["generate", "perplexity"]
)
@pytest.mark.parametrize("kind", ["checkpoint", "gguf", "directory"])
def test_a_model_path_and_no_prompt_is_a_usage_error(
    command: str,
    what: str,
    kind: str,
    tiny_ckpt_factory: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one positional names a model on disk: the user forgot the prompt (or the file); the
    shipped model must not run with the path as its prompt."""
    _forbid_loading(monkeypatch)
    path = tiny_ckpt_factory("llama")
    if kind == "gguf":
        path = tmp_path / "model.gguf"
        path.write_bytes(b"GGUF")
    elif kind == "directory":  # no checkpoint in it, but written as a path
        path = tmp_path / "out"
        path.mkdir()
    capsys.readouterr()
    assert main([command, str(path), "--max-new-tokens" if command == "generate" else "--bytes", "6"]) == 2
    err = capsys.readouterr().err
    usage = "infer generate [MODEL] PROMPT" if command == "generate" else "infer perplexity [MODEL] FILE"
    assert err == (
        f"infer: error: a model path ({path}) and no {what}: give the {what} after the model: {usage}\n"
    )


def test_a_prompt_alone_still_runs_the_default_model(
    tiny_ckpt_factory: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``infer generate PROMPT``: the one positional is the prompt (also one too long to be a path)."""
    import infer
    from infer.cli import commands

    path = tiny_ckpt_factory("llama")
    monkeypatch.setattr(commands, "_default_model", lambda: str(path))
    (tmp_path / "notes").mkdir()
    monkeypatch.chdir(tmp_path)
    for prompt in ("Hello", "x" * 200, "notes"):  # "notes": a directory here, but no model, no path
        assert main(["generate", prompt, "--max-new-tokens", "4", "--quiet", "--raw"]) == 0
        assert capsys.readouterr().out == infer.load(path).generate(prompt, max_new_tokens=4).text + "\n"
    for prompt in ("x" * 5000, "a\0b", "~no-such-user-here/x"):  # no possible path: never a model
        assert not commands._model_path(prompt)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate"], "no prompt given: infer generate [MODEL] PROMPT"),
        (["perplexity"], "no text file given: infer perplexity [MODEL] FILE"),
        (["perplexity", "MODEL", "DIR"], "FILE: expected a UTF-8 text file, found a directory: DIR"),
    ],
    ids=["generate", "perplexity", "perplexity of a directory"],
)
def test_missing_positionals_are_usage_errors(
    argv: list[str],
    message: str,
    tiny_ckpt_factory: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    names = {"MODEL": str(tiny_ckpt_factory("llama")), "DIR": str(tmp_path)}
    capsys.readouterr()
    assert main([names.get(a, a) for a in argv]) == 2
    assert capsys.readouterr().err == f"infer: error: {message.replace('DIR', str(tmp_path))}\n"


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "perplexity"])
def test_group_size_without_a_memory_budget_is_a_usage_error(
    command: str,
    tiny_ckpt_factory: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--group-size sizes the streamed groups only: alone it used to be ignored."""
    _forbid_loading(monkeypatch)
    text = tmp_path / "text.txt"
    text.write_text("some text")
    extra = {"generate": ["Hello"], "perplexity": [str(text)]}.get(command, [])
    capsys.readouterr()
    assert main([command, str(tiny_ckpt_factory("llama")), *extra, "--group-size", "3", "--quiet"]) == 2
    assert capsys.readouterr().err == (
        "infer: error: --group-size 3 applies only to layer streaming: give --memory-budget too "
        "(or leave --group-size out)\n"
    )


def test_group_size_defaults_to_the_chosen_one(
    tiny_ckpt_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --group-size the streamed groups are StreamingConfig's default (None: chosen to fit)."""
    import infer

    seen: list[object] = []

    def record(*args: object, streaming: object = None, **kwargs: object) -> None:
        seen.append(streaming)
        raise RuntimeError("recorded")

    monkeypatch.setattr(infer, "load", record)
    path = str(tiny_ckpt_factory("llama"))
    assert main(["generate", path, "Hi", "--memory-budget", "1GB", "--quiet"]) == 1
    assert main(["generate", path, "Hi", "--memory-budget", "1GB", "--group-size", "2", "--quiet"]) == 1
    groups = [getattr(s, "layer_group_size", "missing") for s in seen]
    assert groups == [infer.StreamingConfig(memory_budget="1GB").layer_group_size, 2] == [None, 2]
