"""Faults found by probing main (issue 19): interrupts, usage errors, chat limits, paths.

Each test reproduces what a hostile user did and checks the documented answer: one line,
the CLI's exit status, the chat going on.
"""

from __future__ import annotations

import io
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import infer
from infer.cli import main

SRC = Path(__file__).resolve().parents[2] / "src"


# ---- 2. Ctrl-C at any moment: exit 130, one line ------------------------------------


# Put on the child's path (a `sitecustomize`, imported at its start-up): when `python -m infer`
# starts importing `infer.cli`, infer's SIGINT handler is installed (infer/__main__.py takes
# Ctrl-C, then imports the CLI), and the hook writes one byte to the pipe the test reads.
_READY_HOOK = """
import os, sys
_fd = int(os.environ.pop("INFER_TEST_READY_FD", "-1"))  # popped: the child's own children skip this


def _ready(event, args):
    global _fd
    if _fd >= 0 and event == "import" and args[0] == "infer.cli":
        fd, _fd = _fd, -1
        os.write(fd, b"!")
        os.close(fd)


if _fd >= 0:
    sys.addaudithook(_ready)
"""


def _interrupt_after(argv: list[str], delay: float | None, hook_dir: Path) -> tuple[int, str]:
    """Run ``python -m infer ARGV``; SIGINT ``delay`` s into infer's start-up (None: once text streams).

    The delay counts from the moment infer's own SIGINT handler is in place (the child says so
    through a pipe: `_READY_HOOK`), whatever the interpreter's start-up and the import of the
    ``infer`` package before it took: a Ctrl-C there is CPython's to report (~20 ms on an idle
    machine, several times that on a busy one).
    """
    (hook_dir / "sitecustomize.py").write_text(_READY_HOOK)
    read_end, write_end = os.pipe()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{hook_dir}{os.pathsep}{SRC}",
        "INFER_TEST_READY_FD": str(write_end),
    }
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "infer", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            pass_fds=(write_end,),
        )
        os.close(write_end)
        write_end = -1
        assert proc.stdout is not None
        if delay is None:
            proc.stdout.read(1)  # the first byte of generated text
        else:
            ready, _, _ = select.select([read_end], [], [], 120)
            if not ready or os.read(read_end, 1) != b"!":
                proc.kill()
                _, stderr = proc.communicate()
                pytest.fail(f"infer's handler was not installed (exit {proc.returncode}): {stderr!r}")
            time.sleep(delay)
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    proc.send_signal(signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("an interrupted `infer` did not exit within 60 s")
    return proc.returncode, stderr.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.parametrize(
    "delay",
    [0.05, 0.3, 0.8, 1.0, 1.2, 1.5, None],
    ids=["0.05s", "0.3s", "0.8s", "1s", "1.2s", "1.5s", "generating"],
)
@pytest.mark.slow
def test_interrupt_at_any_moment_exits_130_with_one_line(
    tiny_ckpt_factory: Callable[..., Path], delay: float | None, tmp_path: Path
) -> None:
    path = str(tiny_ckpt_factory("llama"))
    argv = ["generate", path, "Hello", "--max-new-tokens", "2000", "--quiet"]
    code, err = _interrupt_after(argv, delay, tmp_path)
    print(f"SIGINT after {delay} s: exit {code}, stderr {err!r}")
    assert "Traceback" not in err
    assert code == 130
    assert err == "infer: interrupted\n"


# ---- 3. the chat goes on: history trimmed, undecodable input replaced ---------------------


def test_chat_trims_the_oldest_turns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from infer.testing import build_checkpoint

    path = build_checkpoint(tmp_path / "short", "qwen3", max_position_embeddings=96)
    capsys.readouterr()
    turns = [f"turn {i}: " + "tell me more about the weather " * 2 for i in range(8)]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(turns) + "\n/exit\n"))
    code = main(["chat", str(path), "--system", "be brief", "--max-new-tokens", "8", "--quiet"])
    out, err = capsys.readouterr()
    print(err)
    assert code == 0, err
    assert out.count("\n") == len(turns)  # every turn answered
    notices = err.strip().splitlines()
    assert notices and all(n.startswith("infer: the conversation outgrew") for n in notices)


def test_history_trimming_keeps_the_system_prompt() -> None:
    from infer.text.chat_history import fit_history

    def encode(messages: list[dict[str, str]]) -> list[int]:
        return [0] * sum(10 for _ in messages)

    system = {"role": "system", "content": "s"}
    history = [system] + [{"role": r, "content": str(i)} for i in range(3) for r in ("user", "assistant")]
    history.append({"role": "user", "content": "last"})
    kept, dropped = fit_history(history, encode, limit=45)
    assert kept[0] == system and kept[-1]["content"] == "last"
    assert len(kept) == 4 and dropped == 4  # system + the last exchange + the new turn: 40 <= 45
    kept, dropped = fit_history([system, {"role": "user", "content": "x"}], encode, limit=15)
    assert kept == [] and dropped == 0  # even the new turn alone does not fit: refused


@pytest.mark.parametrize("errors", ["surrogateescape", "strict"])
def test_chat_replaces_invalid_utf8(
    tiny_ckpt_factory: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    errors: str,
) -> None:
    path = tiny_ckpt_factory("qwen3")
    capsys.readouterr()
    raw = io.BytesIO(b"caf\xe9 \xff\xfe ok\nhi\n/exit\n")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(raw, encoding="utf-8", errors=errors))
    code = main(["chat", str(path), "--max-new-tokens", "4", "--quiet"])
    out, err = capsys.readouterr()
    print(err)
    assert code == 0, err
    assert out.count("\n") == 2  # both lines answered
    assert err == "infer: input was not valid UTF-8: undecodable bytes replaced with U+FFFD\n"


# ---- 4. validation gaps -----------------------------------------------------------------


def test_lone_surrogates_are_value_errors(tiny_ckpt_factory: Callable[..., Path]) -> None:
    llm = infer.load(tiny_ckpt_factory("qwen3"))
    with pytest.raises(ValueError, match=r"prompt: .*'\\ud800'.* at index 2.*valid Unicode"):
        llm.generate("ab\ud800", max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt 1: .*'\\udcff'"):
        llm.generate(["ok", "x\udcff"], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"message 0: 'content'.*'\\ud800'"):
        llm.chat([{"role": "user", "content": "\ud800"}], max_new_tokens=2)


def test_top_k_beyond_int64_is_a_value_error(tiny_ckpt_factory: Callable[..., Path]) -> None:
    llm = infer.load(tiny_ckpt_factory("llama"))
    with pytest.raises(ValueError, match=r"top_k must be an int in \[0, 9223372036854775807\], got 2\*\*63"):
        llm.generate("hi", max_new_tokens=2, temperature=1.0, top_k=2**63)
    assert llm.generate("hi", max_new_tokens=2, temperature=1.0, top_k=2**63 - 1, seed=1).token_ids


def test_one_dimensional_input_ids_are_a_value_error(tiny_ckpt_factory: Callable[..., Path]) -> None:
    llm = infer.load(tiny_ckpt_factory("llama"))
    with pytest.raises(ValueError, match=r"input_ids: expected .*\[batch, length\].*got shape \(3,\)"):
        llm.model(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"input_ids: expected integer token ids, got torch.float32"):
        llm.model(torch.zeros(1, 3))


def test_unseeded_sampling_follows_torch_manual_seed(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """Without a seed a request draws its seed from torch's global generator: torch.manual_seed
    makes the run reproducible, and the caller's random stream goes on from it (torch.seed() used
    to reseed it at random: lm-eval's seeded runs of sampled tasks differed)."""
    llm = infer.load(tiny_ckpt_factory("llama"), dtype=torch.float32)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        tokens = llm.generate(["hello", "there"], max_new_tokens=6, temperature=1.0)
        runs.append(([r.token_ids for r in tokens], torch.rand(2).tolist()))
    print(runs)
    assert runs[0] == runs[1]


def test_token_ids_outside_the_vocabulary_are_a_value_error(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """Named before the lookup, for a dense embedding (which raised torch's bare IndexError) and the
    shipped GGUF's packed one (which wrapped -1 to the last row, and failed on a packed row index)."""
    for llm in (infer.load(tiny_ckpt_factory("llama")), infer.load("smollm2", compile=False)):
        vocab = llm.config.vocab_size
        for bad in (-1, vocab):
            with pytest.raises(
                ValueError, match=rf"input_ids: token id {bad} is out of range \[0, {vocab}\)"
            ):
                llm.model(torch.tensor([[1, bad]]))
            with pytest.raises(ValueError, match=rf"token id {bad} is out of range"):
                llm.model(torch.tensor([[1, bad]]), output_hidden_states=True)
        assert llm.model(torch.tensor([[1, vocab - 1]])).shape[-1] >= vocab


@pytest.mark.parametrize(
    ("argv", "option"),
    [(["--top-k", str(10**30)], "--top-k"), (["--stop", ""], "--stop")],
    ids=["top-k 10**30", "stop empty"],
)
def test_cli_usage_errors_exit_2(
    tiny_ckpt_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str], argv: list[str], option: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tiny_ckpt_factory("llama")), "Hi", "--quiet", *argv])
    err = capsys.readouterr().err
    print(err.strip().splitlines()[-1])
    assert exit_info.value.code == 2
    assert f"error: argument {option}" in err and "Traceback" not in err


# ---- 5. a missing local path is not a hub id ----------------------------------------------


def test_missing_path_with_one_slash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    start = time.monotonic()
    with pytest.raises(FileNotFoundError) as info:
        infer.load("no-such-dir/model.gguf")
    assert str(info.value) == (
        "no-such-dir/model.gguf: no such file or directory; not a hub id in the local cache"
    )
    assert main(["generate", "no-such-dir/model.gguf", "Hello"]) == 1
    assert capsys.readouterr().err == (
        "infer: error: no-such-dir/model.gguf: no such file or directory; not a hub id in the local cache\n"
    )
    assert time.monotonic() - start < 5


# ---- 6. what users are told -----------------------------------------------------------------


def test_tokenizer_repr(tiny_ckpt_factory: Callable[..., Path]) -> None:
    tok = infer.load(tiny_ckpt_factory("qwen3")).tokenizer
    text = repr(tok)
    print(text)
    assert text.startswith(f"Tokenizer(vocab_size={tok.vocab_size}, ")
    assert "eos=" in text and "bos=" in text and "pad=" in text


def test_stop_strings_hold_back_only_what_could_start_one(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """A stop string that never begins to form holds nothing back: the same pieces as without it."""
    llm = infer.load(tiny_ckpt_factory("llama"))
    plain = list(llm.stream("Hello", 24))
    never = list(llm.stream("Hello", 24, stop="\u2603\u2603\u2603\u2603"))
    assert never == plain
    text = "".join(plain)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    pieces = list(llm.stream("Hello", 24, stop=stop))
    assert "".join(pieces) == text[: text.find(stop)]


def test_an_interrupt_that_surfaces_as_another_error_exits_130(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C during an import can come out as a ModuleNotFoundError (a library catches the
    KeyboardInterrupt, a later import finds the module half-made): still exit 130, one line."""
    from infer import cli

    def command(args: object) -> int:
        cli._interrupt["raise"] = True  # as inside a command run as the program
        try:
            cli._on_interrupt(2, None)
        except KeyboardInterrupt:
            raise ModuleNotFoundError("No module named 'transformers.models.auto'") from None
        return 0

    monkeypatch.setattr(cli, "cmd_inspect", command)
    code = cli.main(["inspect", "any"])
    err = capfd.readouterr().err
    print(f"exit {code}, stderr {err!r}")
    assert code == 130
    assert err == "infer: interrupted\n"
