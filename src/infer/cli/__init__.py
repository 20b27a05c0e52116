"""The `infer` command: generate, chat, serve, inspect, perplexity, eval.

Exit status: 0 success, 1 error (one line on stderr; ``--debug`` raises it with its
traceback), 2 usage error (unknown option, an option value out of range, a missing prompt
or an option that needs another), 130 interrupted (Ctrl-C).

This module is the program: `main` (exit status, Ctrl-C, torchrun's SIGTERM) and `build_parser`
(which command runs which handler). The options are defined in `infer.cli.options`, what each
command does in `infer.cli.commands`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import types
from collections.abc import Sequence

from infer.cli.commands import (
    cmd_chat,
    cmd_eval,
    cmd_generate,
    cmd_inspect,
    cmd_perplexity,
    cmd_serve,
    primary,
)
from infer.cli.options import (
    EXIT_CODES,
    IntermixedParser,
    UsageError,
    command,
    dtype_option,
    eval_parser,
    int_option,
    load_options,
    perplexity_parser,
    sampling_options,
    serve_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infer", description="Pure-PyTorch LLM inference.", epilog=EXIT_CODES
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=IntermixedParser)

    def common(p: argparse.ArgumentParser) -> None:
        sampling_options(p)
        load_options(
            p,
            deterministic="output bitwise the same in any batch (slower at batch 1)",
            parallel="run under torchrun",
            compile=True,
        )

    g = command(
        sub,
        "generate",
        help="answer a prompt (as a chat turn when the model has a chat template; --raw continues it)",
    )
    g.add_argument("prompt", nargs="?", default=None)
    g.add_argument(
        "--raw",
        action="store_true",
        help="continue the prompt as plain text (default: as a user message in the model's chat "
        "template, when it has one)",
    )
    g.add_argument("--system", default=None, help="system prompt (chat template only)")
    common(g)
    g.set_defaults(func=cmd_generate)

    c = command(sub, "chat", help="interactive chat (keeps the conversation; /reset, /exit)")
    c.add_argument("--system", default=None, help="system prompt")
    common(c)
    c.set_defaults(func=cmd_chat)

    i = command(sub, "inspect", help="architecture, parameters, tensors, memory estimates")
    i.add_argument(
        "--context", type=int_option(1), default=None, help="context length for the KV-cache estimate (>= 1)"
    )
    i.add_argument("--batch-size", type=int_option(1), default=1, help="batch size for the estimate (>= 1)")
    i.add_argument("--dtype", type=dtype_option, default=None)
    i.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    i.set_defaults(func=cmd_inspect)
    perplexity_parser(sub).set_defaults(func=cmd_perplexity)
    serve_parser(sub).set_defaults(func=cmd_serve)
    eval_parser(sub).set_defaults(func=cmd_eval)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``infer ARGV``; the exit status. Ctrl-C at any moment exits 130 with one line.

    As the program (``argv`` None, the main thread), SIGINT raises `KeyboardInterrupt`
    while the command runs (so its cleanup runs) and exits 130 at once before and after
    it, and on a second Ctrl-C.
    """
    program = argv is None and threading.current_thread() is threading.main_thread()
    _interrupt["told"] = _interrupt["signalled"] = False
    if program:
        signal.signal(signal.SIGINT, _on_interrupt)
        _interrupt["raise"] = True
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun ends the others when one rank fails
            signal.signal(signal.SIGTERM, _on_terminate)
    try:
        try:
            return _run(argv)
        except Exception as e:
            if _interrupt["signalled"]:  # an interrupt that surfaced as another error before the
                raise KeyboardInterrupt from e  # command ran (an import it cut short)
            raise
    except KeyboardInterrupt:
        _interrupt["raise"] = False
        _say_interrupted()
        if program:
            # A Ctrl-C that landed while CPython ran code through PyRun_String (inside some
            # extension's import) leaves a flag by which CPython ends the process by SIGINT at
            # exit although it was handled here: leave now with the promised 130.
            sys.stdout.flush()
            os._exit(130)
        return 130
    finally:
        _interrupt["raise"] = False  # from here until the process ends Ctrl-C exits 130 at once


_interrupt = {"raise": False, "told": False, "signalled": False}


def _say_interrupted() -> None:
    if not _interrupt["told"]:
        _interrupt["told"] = True
        os.write(2, b"infer: interrupted\n")


def _on_interrupt(signum: int, frame: object) -> None:
    """SIGINT: a `KeyboardInterrupt` inside the command, else one line and exit 130 now.

    Inside an import (a module's top-level code, or importlib's own) it exits at once too: an
    exception raised there can land in an extension's C++ (torch's pybind11 imports: a
    ``terminate``, SIGABRT) or in an importlib callback that ignores it (the run went on and
    exited 0), and an import holds nothing to clean up."""
    if _interrupt["raise"] and not _importing(frame):
        _interrupt["raise"] = False  # a second Ctrl-C, during the cleanup, exits at once
        _interrupt["signalled"] = True
        raise KeyboardInterrupt
    _say_interrupted()
    try:
        sys.stdout.flush()
    finally:
        os._exit(130)


def _importing(frame: object) -> bool:
    """Whether `frame` or a caller runs a module's top-level code (other than ``__main__``'s) or
    importlib's."""
    f = frame if isinstance(frame, types.FrameType) else None
    while f is not None:
        code = f.f_code
        if code.co_filename.startswith("<frozen importlib"):
            return True
        if code.co_name == "<module>" and f.f_globals.get("__name__") != "__main__":
            return True
        f = f.f_back
    return False


def _on_terminate(signum: int, frame: object) -> None:
    """SIGTERM from torchrun, which stops every rank once one has failed: one line saying which."""
    if not _interrupt["told"]:
        _interrupt["told"] = True
        runtime = sys.modules.get("infer.distributed.runtime")
        lost = runtime.lost_ranks() if runtime is not None else None
        reason = lost or "another rank failed"
        rank = os.environ.get("RANK", "?")
        os.write(2, f"infer: rank {rank}: {reason}; torchrun stopped this rank\n".encode())
    os._exit(128 + signal.SIGTERM)


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except Exception as e:  # one clear line, unless --debug
        if _interrupt["signalled"]:
            # The interrupt surfaced as another error: an import it cut short (a library that
            # catches the KeyboardInterrupt, then a ModuleNotFoundError), a cleanup it broke.
            raise KeyboardInterrupt from e
        if args.debug:
            raise
        if isinstance(e, UsageError):  # the command line itself: exit 2, as argparse's errors
            if primary():
                print(f"infer: error: {_error_message(e)}", file=sys.stderr)
            return 2
        if primary() or _every_rank_tells(e):  # every rank of a parallel run raises the same error
            prefix = f"rank {os.environ.get('RANK')}: " if not primary() else ""
            print(f"infer: error: {prefix}{_error_message(e)}", file=sys.stderr)
            _interrupt["told"] = True  # a SIGTERM from torchrun after this adds no line
        return 1


def _every_rank_tells(e: Exception) -> bool:
    """A peer that stopped answering is news on every rank (each says which rank it lost)."""
    return type(e).__name__ == "RankFailedError"


def _error_message(e: Exception) -> str:
    """The error in one line; all of a `BudgetError`, whose later lines say what would fit.

    The first line, and while what it has so far ends with a colon (it introduces the reason on
    the next line: torch's "... Got graph break/error:"), the next non-blank line after it."""
    from infer.streaming.plan import BudgetError

    text = str(e).strip()
    if not text:
        return type(e).__name__
    if isinstance(e, BudgetError):
        return text
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    message = lines[0]
    for line in lines[1:]:
        if not message.endswith(":"):
            break
        message = f"{message} {line}"
    return message


__all__ = [
    "build_parser",
    "cmd_chat",
    "cmd_eval",
    "cmd_generate",
    "cmd_inspect",
    "cmd_perplexity",
    "cmd_serve",
    "main",
]
