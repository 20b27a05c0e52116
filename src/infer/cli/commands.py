"""What each `infer` command does (`cmd_generate`, `cmd_chat`, `cmd_serve`, `cmd_inspect`,
`cmd_perplexity`, `cmd_eval`), and what they share: loading the model from the options, and printing from
one rank only when several run the same generation (torchrun)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.cli.options import UsageError
from infer.text.chat_history import fit_history, repair_utf8

if TYPE_CHECKING:
    from infer.api import SamplingOptions


def _default_model() -> str:
    from infer.realmodels import smollm2_path

    return str(smollm2_path())


def _progress_bar(enabled: bool) -> tuple[Callable[[int, int], None] | None, Callable[[], None]]:
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if "bar" not in bar:
            bar["bar"] = tqdm(
                total=total, desc="loading weights", unit="tensor", leave=False, file=sys.stderr
            )
        bar["bar"].n = done
        bar["bar"].refresh()

    def close() -> None:
        if "bar" in bar:
            bar["bar"].close()

    return update, close


def primary() -> bool:
    """Whether this process prints: always, except on ranks other than 0 of a torchrun launch."""
    return os.environ.get("RANK", "0") == "0"


# `infer.load`'s keywords that are options of the same name (every command that loads has them).
LOAD_OPTIONS = (
    "device", "dtype", "quantize", "tensor_parallel", "pipeline_parallel", "compile", "deterministic",
    "lookup", "draft", "speculative_tokens", "kv_dtype",
)  # fmt: skip
# `infer.serve.serve`'s keywords that are `infer serve` options of the same name.
SERVE_OPTIONS = ("host", "port", "max_batch", "max_waiting", "max_body_bytes", "shutdown_timeout")


def _model_path(text: str) -> bool:
    """Whether ``text`` names a model on disk: an existing ``.gguf`` file, or a directory that
    holds a checkpoint (``config.json`` or a ``.gguf`` file) or is written as a path (``./out``,
    ``/data/m``, ``~/m``: a one-word prompt such as ``src`` stays a prompt)."""
    try:  # a prompt may be no possible path at all (too long a name, a NUL)
        path = Path(text).expanduser()
        if path.suffix.lower() == ".gguf" and path.is_file():
            return True
        if not path.is_dir():
            return False
        written_as_path = "/" in text or os.sep in text or text.startswith((".", "~"))
        return written_as_path or (path / "config.json").is_file() or any(path.glob("*.gguf"))
    except (OSError, ValueError, RuntimeError):  # RuntimeError: "~nosuchuser"
        return False


def _is_dir(text: str) -> bool:
    """Whether ``text`` names an existing directory (False for what can be no path)."""
    try:
        return Path(text).expanduser().is_dir()
    except (OSError, ValueError, RuntimeError):
        return False


def _positionals(args: argparse.Namespace, second: str, usage: str) -> None:
    """Fill ``args.model`` and ``args.<second>`` (the prompt, or the text file) from the
    positionals, as ``usage`` (``infer generate [MODEL] PROMPT``) reads them: one alone is the
    second. `UsageError` when it is missing, or when the one given is a model path (a directory
    or a ``.gguf`` file): the user gave the model and forgot the rest."""
    what = "prompt" if second == "prompt" else "text file"
    if getattr(args, second) is None:
        args.model, only = None, args.model
        setattr(args, second, only)
        if only is not None and _model_path(only):
            raise UsageError(f"a model path ({only}) and no {what}: give the {what} after the model: {usage}")
    if getattr(args, second) is None:
        raise UsageError(f"no {what} given: {usage}")


def _check_streaming(args: argparse.Namespace) -> None:
    """`UsageError` for --group-size without --memory-budget (it sizes the streamed groups only)."""
    if getattr(args, "group_size", None) is not None and not getattr(args, "memory_budget", None):
        raise UsageError(
            f"--group-size {args.group_size} applies only to layer streaming: give --memory-budget "
            "too (or leave --group-size out)"
        )


def _load(args: argparse.Namespace) -> Any:
    import infer

    _check_streaming(args)
    model = args.model if args.model is not None else _default_model()
    streaming = None
    if getattr(args, "memory_budget", None):
        streaming = infer.StreamingConfig(layer_group_size=args.group_size, memory_budget=args.memory_budget)
    progress, close = _progress_bar(sys.stderr.isatty() and not args.quiet and primary())
    try:
        options = {name: getattr(args, name) for name in LOAD_OPTIONS}
        return infer.load(model, streaming=streaming, progress=progress, **options)
    finally:
        close()


def _write(text: str) -> None:
    """Model output to stdout, from one rank only when several run the same generation."""
    if primary():
        sys.stdout.write(text)
        sys.stdout.flush()


def _read_line(llm: Any, prompt: str) -> str:
    """A line of stdin ("" at its end); under torchrun rank 0 reads it and sends it to the others."""
    line = ""
    if primary():
        if prompt:
            _write(prompt)
        line, replaced = repair_utf8(sys.stdin.readline())
        if replaced:
            print("infer: input was not valid UTF-8: undecodable bytes replaced with U+FFFD", file=sys.stderr)
    if llm.parallel is not None:
        from infer.distributed.runtime import broadcast_object

        line = broadcast_object(llm.parallel, line)
    return line


def _sampling(args: argparse.Namespace) -> SamplingOptions:
    options: SamplingOptions = {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop or None,
    }
    if args.json_schema is not None:
        options["json_schema"] = args.json_schema
    if args.grammar is not None:
        options["grammar"] = args.grammar
    if args.regex is not None:
        options["regex"] = args.regex
    return options


def cmd_generate(args: argparse.Namespace) -> int:
    _positionals(args, "prompt", "infer generate [MODEL] PROMPT")
    from infer.text.prompts import prompt_ids

    llm = _load(args)
    prompt = prompt_ids(llm, args.prompt, raw=args.raw, system=args.system)
    for piece in llm.stream(prompt, args.max_new_tokens, **_sampling(args)):
        _write(piece)
    _write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from infer.text.prompts import chat_ids

    if hasattr(sys.stdin, "reconfigure"):  # bad bytes arrive as surrogates, then become U+FFFD
        sys.stdin.reconfigure(errors="surrogateescape")
    llm = _load(args)
    context = llm.config.max_position_embeddings
    room = context - min(args.max_new_tokens, context // 2)  # prompt tokens that leave room to reply
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    prompt = "> " if sys.stdin.isatty() else ""
    while True:
        line = _read_line(llm, prompt)
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": text})
        kept, dropped = fit_history(messages, lambda m: chat_ids(llm, m), room)
        if not kept or dropped:
            what = "this message was not sent" if not kept else f"dropped its {dropped} oldest message(s)"
            _notice(f"the conversation outgrew the model's {context}-token context: {what}")
        if not kept:
            messages.pop()
            continue
        messages = kept
        ids = chat_ids(llm, messages)
        reply = []
        for piece in llm.stream(ids, args.max_new_tokens, **_sampling(args)):
            reply.append(piece)
            _write(piece)
        _write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    api_key = args.api_key if args.api_key is not None else os.environ.get("INFER_API_KEY") or None
    llm = _load(args)
    if not llm.primary:  # under torchrun: rank 0 serves; this rank runs its engine's steps
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 drains, then tells this rank to stop
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        llm.ranks.follow()
        return 0
    from infer.serve import serve

    options = {name: getattr(args, name) for name in SERVE_OPTIONS}
    log_level = "info" if args.verbose else "warning"
    return serve(llm, api_key=api_key, model_name=args.served_model_name, log_level=log_level, **options)


def _notice(text: str) -> None:
    if primary():
        print(f"infer: {text}", file=sys.stderr)


def cmd_inspect(args: argparse.Namespace) -> int:
    from infer.inspect import inspect_checkpoint

    model = args.model if args.model is not None else _default_model()
    print(inspect_checkpoint(model, context=args.context, batch_size=args.batch_size, dtype=args.dtype))
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    from infer.perplexity import perplexity, read_text

    _positionals(args, "file", "infer perplexity [MODEL] FILE")
    _check_streaming(args)
    if _is_dir(args.file):
        raise UsageError(f"FILE: expected a UTF-8 text file, found a directory: {args.file}")
    text = read_text(args.file, args.bytes)
    llm = _load(args)
    bar: Any = None
    if sys.stderr.isatty() and not args.quiet and primary():
        from tqdm import tqdm

        bar = tqdm(desc="perplexity", unit="chunk", leave=False, file=sys.stderr)

    def progress(done: int, total: int, ppl: float) -> None:
        if bar is not None:
            bar.total = total
            bar.n = done
            bar.set_postfix_str(f"ppl {ppl:.4f}")

    try:
        result = perplexity(
            llm, text, args.context, batch=args.batch, max_chunks=args.max_chunks, progress=progress
        )
    finally:
        if bar is not None:
            bar.close()
    _write(f"{result}\n")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """lm-eval's evaluator over `infer.evaluation.InferLM`; lm-eval's table on stdout."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import handle_non_serializable, make_table
    except ImportError:
        raise ValueError("infer eval needs lm-eval: pip install 'infer[eval]'") from None
    import json

    from infer.evaluation import InferLM

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise UsageError(f"--include-path: {args.include_path}: not a directory")
    manager = TaskManager(include_path=args.include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" (nor in {args.include_path})" if args.include_path else ""
        raise ValueError(f"--tasks: no lm-eval task named {', '.join(unknown)}{where}")
    llm = _load(args)
    lm = InferLM(llm, batch_size=args.batch_size, max_length=args.max_length)
    limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else args.limit
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        limit=limit,
        task_manager=manager,
        apply_chat_template=args.apply_chat_template,
        log_samples=args.output_path is not None,
    )  # fmt: skip  (lm-eval's seeds: its defaults, as its own CLI's)
    if results is None:  # another rank's (lm-eval reports on rank 0 only)
        return 0
    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    _write(table + "\n")
    if args.output_path is not None:
        with open(args.output_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
    return 0
