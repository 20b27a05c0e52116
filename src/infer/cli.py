"""The `infer` command: generate, chat, serve, inspect, perplexity.

Exit status: 0 success, 1 error (one line on stderr; ``--debug`` raises it with its
traceback), 2 usage error (unknown option, or an option value out of range),
130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from infer.chat_history import fit_history, repair_utf8

if TYPE_CHECKING:
    from infer.api import SamplingOptions

DEFAULT_MODEL_HELP = "checkpoint directory, .gguf file or hub id (default: SmolLM2-135M-Instruct, shipped)"
EXIT_CODES = (
    "exit status: 0 success, 1 error (one line; --debug shows the traceback), "
    "2 usage error (bad option or value), 130 interrupted"
)
SEED_MAX = 2**64 - 1
TOP_K_MAX = 2**63 - 1  # infer.generate.TOP_K_MAX (not imported here: that imports torch)


def _int_option(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in ``[minimum, maximum]`` (out of range is a usage error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    return parse


def _float_option(
    minimum: float, maximum: float | None = None, *, open_min: bool = False
) -> Callable[[str], float]:
    """An argparse type: a finite float >= ``minimum`` (> with ``open_min``) and <= ``maximum``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = value > minimum if open_min else value >= minimum
        if not math.isfinite(value) or not low_ok or (maximum is not None and value > maximum):
            low = f"> {minimum}" if open_min else f">= {minimum}"
            bound = low if maximum is None else f"{low} and <= {maximum}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    return parse


def _stop_option(text: str) -> str:
    """An argparse type: a non-empty stop string."""
    if not text:
        raise argparse.ArgumentTypeError("must be a non-empty string (an empty one would stop at once)")
    return text


def _text_file(text: str) -> str:
    """An argparse type: the contents of a UTF-8 text file (a grammar)."""
    try:
        with open(text, encoding="utf-8") as f:
            content = f.read()
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"{text}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"{text}: {e}") from None
    if not content.strip():
        raise argparse.ArgumentTypeError(f"{text}: the file is empty")
    return content


def _json_file(text: str) -> Any:
    """An argparse type: the JSON object a file holds (a JSON schema)."""
    import json

    content = _text_file(text)
    try:
        value = json.loads(content)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text}: a JSON schema must be an object, got {type(value).__name__}"
        )
    return value


def _bytes_option(text: str) -> str:
    """An argparse type: a size such as ``2GB`` (kept as text; parsed again by StreamingConfig)."""
    from infer.streaming.config import parse_bytes

    try:
        value = parse_bytes(text)
    except OverflowError:
        raise argparse.ArgumentTypeError(f"size {text[:24]!r}... is too large") from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).splitlines()[0][:300]) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return text


def _dtype_option(text: str) -> str:
    """An argparse type: a dtype name `infer.load` accepts."""
    from infer.api import resolve_dtype

    try:
        resolve_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


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


def _primary() -> bool:
    """Whether this process prints: always, except on ranks other than 0 of a torchrun launch."""
    return os.environ.get("RANK", "0") == "0"


def _load(args: argparse.Namespace) -> Any:
    import infer

    model = args.model if args.model is not None else _default_model()
    streaming = None
    if getattr(args, "memory_budget", None):
        streaming = infer.StreamingConfig(layer_group_size=args.group_size, memory_budget=args.memory_budget)
    progress, close = _progress_bar(sys.stderr.isatty() and not args.quiet and _primary())
    try:
        return infer.load(
            model,
            device=args.device,
            dtype=args.dtype,
            quantize=args.quantize,
            streaming=streaming,
            progress=progress,
            tensor_parallel=args.tensor_parallel,
            pipeline_parallel=args.pipeline_parallel,
            compile=args.compile,
            deterministic=args.deterministic,
            lookup=args.lookup,
            draft=args.draft,
            speculative_tokens=args.speculative_tokens,
            kv_dtype=args.kv_dtype,
        )
    finally:
        close()


def _write(text: str) -> None:
    """Model output to stdout, from one rank only when several run the same generation."""
    if _primary():
        sys.stdout.write(text)
        sys.stdout.flush()


def _read_line(llm: Any, prompt: str) -> str:
    """A line of stdin ("" at its end); under torchrun rank 0 reads it and sends it to the others."""
    line = ""
    if _primary():
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
    if args.prompt is None:  # `infer generate "prompt"`: the one positional is the prompt
        args.model, args.prompt = None, args.model
    if args.prompt is None:
        raise ValueError("no prompt given: infer generate [MODEL] PROMPT")
    from infer.prompts import prompt_ids

    llm = _load(args)
    prompt = prompt_ids(llm, args.prompt, raw=args.raw, system=args.system)
    for piece in llm.stream(prompt, args.max_new_tokens, **_sampling(args)):
        _write(piece)
    _write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from infer.prompts import chat_ids

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
    target: Any = llm
    if llm.parallel is not None:  # under torchrun: rank 0 serves, the others run its requests' steps
        from infer.serve.parallel import RankZeroEngine, follow

        if not _primary():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 drains, then tells this rank to stop
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            return follow(llm)
        if args.max_batch not in (None, 1):
            raise ValueError("a tensor/pipeline-parallel server runs one request at a time: --max-batch 1")
        target = RankZeroEngine(
            llm, **({} if args.max_waiting is None else {"max_waiting": args.max_waiting})
        )
        args.max_batch = args.max_waiting = None
    from infer.serve import serve

    return serve(
        target,
        host=args.host,
        port=args.port,
        api_key=api_key,
        model_name=args.served_model_name,
        max_batch=args.max_batch,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        log_level="info" if args.verbose else "warning",
    )


def _command(sub: Any, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand whose first positional is the (optional) model."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description, epilog=EXIT_CODES)
    p.add_argument("model", nargs="?", default=None, help=DEFAULT_MODEL_HELP)
    return p


def _load_options(
    p: argparse.ArgumentParser,
    *,
    deterministic: str,
    parallel: str | None,
    compile: bool,
    speculative: bool = True,
) -> None:
    """The options `_load` reads, shared by generate, chat, perplexity and serve.

    ``deterministic``: what --deterministic buys for this command; ``parallel``: a note for the
    --tensor-parallel / --pipeline-parallel help (None: the command runs in one process, so the
    options are absent and default to 1); ``compile``: whether --compile is offered (else None);
    ``speculative``: whether --lookup / --draft / --speculative-tokens are offered (else off).
    """
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype",
        type=_dtype_option,
        default=None,
        help="float32, bfloat16, float16 (default: the checkpoint's)",
    )
    p.add_argument("--quantize", choices=["q4_0", "int8"], default=None)
    p.add_argument(
        "--kv-dtype",
        choices=["float32", "bfloat16", "float16", "int8"],
        default=None,
        help="what the KV cache holds (int8: ~0.27x float32's bytes; default: the compute dtype, "
        "docs/engine.md)",
    )
    p.add_argument(
        "--memory-budget", type=_bytes_option, default=None, help="stream layers under this budget, e.g. 2GB"
    )
    p.add_argument("--group-size", type=_int_option(1), default=4, help="layers per streamed group (>= 1)")
    if parallel is not None:
        p.add_argument(
            "--tensor-parallel",
            type=_int_option(1),
            default=1,
            help=f"split each layer across this many processes ({parallel}; >= 1)",
        )
        p.add_argument(
            "--pipeline-parallel",
            type=_int_option(1),
            default=1,
            help=f"split the layers into this many stages of processes ({parallel}; >= 1)",
        )
    else:
        p.set_defaults(tensor_parallel=1, pipeline_parallel=1)
    if compile:
        p.add_argument(
            "--compile",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="--compile: every step through torch.compile in this process; --no-compile: eager; "
            "default: decode steps from ahead-of-time compiled packages on CPU (infer.aot)",
        )
    else:
        p.set_defaults(compile=None)
    if speculative:
        p.add_argument(
            "--lookup",
            type=_int_option(0, 16),
            default=0,
            help="speculative decoding by n-gram lookup in the prompt and the text so far: "
            "match the last N tokens, then fewer (0: off; docs/speculative.md)",
        )
        p.add_argument(
            "--draft",
            "--model-draft",
            "-md",
            default=None,
            metavar="MODEL",
            help="speculative decoding with a draft model of the same tokenizer (a path or hub id; "
            "'self': this model's weights packed)",
        )
        p.add_argument(
            "--speculative-tokens",
            "--spec-draft-n-max",
            type=_int_option(1, 32),
            default=None,
            metavar="K",
            help="tokens proposed per pass at most (1 to 32; default 16): each pass proposes what pays",
        )
    else:
        p.set_defaults(lookup=0, draft=None, speculative_tokens=None)
    p.add_argument("--deterministic", action="store_true", help=f"fixed-shape products: {deterministic}")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")


def _sampling_options(p: argparse.ArgumentParser) -> None:
    """The options `_sampling` reads (generate and chat)."""
    p.add_argument("--max-new-tokens", type=_int_option(1), default=256, help="tokens to generate (>= 1)")
    p.add_argument(
        "--temperature",
        type=_float_option(0.0),
        default=0.0,
        help="0 is greedy (the default); finite, >= 0",
    )
    p.add_argument(
        "--top-k",
        type=_int_option(0, TOP_K_MAX),
        default=0,
        help="keep the k most likely tokens (0: all; at most 2**63-1)",
    )
    p.add_argument(
        "--top-p",
        type=_float_option(0.0, 1.0, open_min=True),
        default=1.0,
        help="nucleus sampling, in (0, 1]",
    )
    p.add_argument("--seed", type=_int_option(0, SEED_MAX), default=None, help="sampling seed, 0 to 2**64-1")
    p.add_argument(
        "--stop",
        type=_stop_option,
        action="append",
        default=[],
        help="stop string (non-empty; repeatable)",
    )
    structured = p.add_mutually_exclusive_group()
    structured.add_argument(
        "--json-schema", type=_json_file, default=None, metavar="FILE",
        help="answer with JSON matching the JSON schema in FILE (docs/structured.md)",
    )  # fmt: skip
    structured.add_argument(
        "--grammar", type=_text_file, default=None, metavar="FILE",
        help="answer in the grammar in FILE (llguidance Lark, or GBNF as llama.cpp takes it)",
    )  # fmt: skip
    structured.add_argument(
        "--regex", default=None, metavar="RE", help="answer with text matching the regular expression RE"
    )


def _serve_parser(sub: Any) -> None:
    p = _command(
        sub,
        "serve",
        help="OpenAI-compatible HTTP server with a chat page (docs/serving.md)",
        description="Serves /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics and a "
        "chat page at /. SIGTERM or Ctrl-C: stop admitting, finish running requests, exit 0.",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    p.add_argument(
        "--port", type=_int_option(0, 65535), default=8000, help="port (0: any free one; default 8000)"
    )
    p.add_argument(
        "--max-batch", type=_int_option(1), default=None, help="requests generated together (>= 1)"
    )
    p.add_argument(
        "--max-waiting",
        type=_int_option(0),
        default=None,
        help="requests queued for a row; more are refused with 429 (>= 0)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: $INFER_API_KEY)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: its file name)"
    )
    p.add_argument(
        "--shutdown-timeout",
        type=_float_option(0.0),
        default=30.0,
        help="seconds running requests get to finish after SIGTERM before they are ended (default 30)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_int_option(1),
        default=None,
        help="larger request bodies are refused with 413 before they are read (default 4 MiB)",
    )
    p.add_argument("--verbose", action="store_true", help="uvicorn's info log (one line per request)")
    _load_options(
        p,
        deterministic="a request's tokens and logprobs do not depend on the other requests",
        parallel="under torchrun; rank 0 serves HTTP",
        compile=True,
    )
    p.set_defaults(func=cmd_serve)


def _notice(text: str) -> None:
    if _primary():
        print(f"infer: {text}", file=sys.stderr)


def cmd_inspect(args: argparse.Namespace) -> int:
    from infer.inspect import inspect_checkpoint

    model = args.model if args.model is not None else _default_model()
    print(inspect_checkpoint(model, context=args.context, batch_size=args.batch_size, dtype=args.dtype))
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    from infer.perplexity import perplexity, read_text

    if args.file is None:  # `infer perplexity FILE`: the one positional is the file
        args.model, args.file = None, args.model
    if args.file is None:
        raise ValueError("no text file given: infer perplexity [MODEL] FILE")
    text = read_text(args.file, args.bytes)
    llm = _load(args)
    bar: Any = None
    if sys.stderr.isatty() and not args.quiet and _primary():
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


def _perplexity_parser(sub: Any) -> None:
    from infer.perplexity import DEFAULT_CONTEXT

    p = _command(
        sub,
        "perplexity",
        help="perplexity over a text file, as llama-perplexity -c N -b N computes it",
        description="Chunks of --context tokens; the second half of each chunk is scored; "
        "ppl = exp(mean negative log-likelihood). Prints PPL +/- its standard error.",
    )
    p.add_argument("file", nargs="?", default=None, help="UTF-8 text file")
    p.add_argument(
        "--context",
        type=_int_option(3),
        default=DEFAULT_CONTEXT,
        help=f"tokens per chunk, llama.cpp's -c (>= 3; default {DEFAULT_CONTEXT})",
    )
    p.add_argument("--batch", type=_int_option(1), default=1, help="chunks per forward pass (>= 1)")
    p.add_argument(
        "--max-chunks", type=_int_option(1), default=None, help="score only the first chunks (>= 1)"
    )
    p.add_argument(
        "--bytes", type=_int_option(1), default=None, help="read only the first BYTES bytes (>= 1)"
    )
    _load_options(
        p,
        deterministic="the same figure whatever --batch is (slower)",
        parallel=None,
        compile=False,
        speculative=False,
    )
    p.set_defaults(func=cmd_perplexity)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infer", description="Pure-PyTorch LLM inference.", epilog=EXIT_CODES
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        _sampling_options(p)
        _load_options(
            p,
            deterministic="output bitwise the same in any batch (slower at batch 1)",
            parallel="run under torchrun",
            compile=True,
        )

    g = _command(
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

    c = _command(sub, "chat", help="interactive chat (keeps the conversation; /reset, /exit)")
    c.add_argument("--system", default=None, help="system prompt")
    common(c)
    c.set_defaults(func=cmd_chat)

    i = _command(sub, "inspect", help="architecture, parameters, tensors, memory estimates")
    i.add_argument(
        "--context", type=_int_option(1), default=None, help="context length for the KV-cache estimate (>= 1)"
    )
    i.add_argument("--batch-size", type=_int_option(1), default=1, help="batch size for the estimate (>= 1)")
    i.add_argument("--dtype", type=_dtype_option, default=None)
    i.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    i.set_defaults(func=cmd_inspect)
    _perplexity_parser(sub)
    _serve_parser(sub)
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
        if _primary() or _every_rank_tells(e):  # every rank of a parallel run raises the same error
            prefix = f"rank {os.environ.get('RANK')}: " if not _primary() else ""
            print(f"infer: error: {prefix}{_error_message(e)}", file=sys.stderr)
            _interrupt["told"] = True  # a SIGTERM from torchrun after this adds no line
        return 1


def _every_rank_tells(e: Exception) -> bool:
    """A peer that stopped answering is news on every rank (each says which rank it lost)."""
    return type(e).__name__ == "RankFailedError"


def _error_message(e: Exception) -> str:
    """The first line of the error; all of a `BudgetError`, whose later lines say what would fit."""
    from infer.streaming.plan import BudgetError

    text = str(e).strip()
    if not text:
        return type(e).__name__
    return text if isinstance(e, BudgetError) else text.splitlines()[0]


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["build_parser", "main"]
