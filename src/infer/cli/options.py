"""The command line's options: argparse types that make a bad value a usage error (exit 2), and
the option groups and parsers the commands share (`infer.cli.build_parser` puts them together)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from infer.params import SEED_MAX, TOP_K_MAX  # torch-free: --help does not import torch

DEFAULT_MODEL_HELP = "checkpoint directory, .gguf file or hub id (default: SmolLM2-135M-Instruct, shipped)"
EXIT_CODES = (
    "exit status: 0 success, 1 error (one line; --debug shows the traceback), "
    "2 usage error (bad option or value, missing prompt), 130 interrupted"
)
# An option that takes one value: (flag, argparse type, default, help).
ValueOption = tuple[str, Callable[[str], Any], Any, str]


class UsageError(ValueError):
    """A command line that parses but does not make sense (a model path and no prompt, an option
    that needs another): `infer.cli.main` prints ``infer: error: MESSAGE`` and exits 2."""


def _auto_or(parse: Callable[[str], int]) -> Callable[[str], int | str]:
    """An option that takes "auto" (lm-eval's word) or what ``parse`` takes."""

    def parse_auto(text: str) -> int | str:
        return "auto" if text == "auto" else parse(text)

    parse_auto.__name__ = getattr(parse, "__name__", "value")
    return parse_auto


def int_option(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
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


def dtype_option(text: str) -> str:
    """An argparse type: a dtype name `infer.load` accepts."""
    from infer.api import resolve_dtype

    try:
        resolve_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


class IntermixedParser(argparse.ArgumentParser):
    """A subcommand's parser: options may come before, between or after its positionals.

    Plain argparse fills every optional positional (``model``, then ``prompt`` or ``file``) from
    the first run of positionals it meets, so ``generate MODEL --raw PROMPT`` left PROMPT
    unrecognized (exit 2). Parsed as ``parse_known_intermixed_args`` does, the options are taken
    out first and the positionals then filled from what is left, in order: every order a user
    types gives the same namespace.
    """

    _intermixing = False

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._intermixing:  # parse_known_intermixed_args' own passes
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def command(sub: Any, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand whose first positional is the (optional) model."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description, epilog=EXIT_CODES)
    p.add_argument("model", nargs="?", default=None, help=DEFAULT_MODEL_HELP)
    return p


def load_options(
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
        type=dtype_option,
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
    p.add_argument(
        "--group-size",
        type=int_option(1),
        default=None,
        help="layers per streamed group (>= 1; needs --memory-budget; default: chosen to fit the budget)",
    )
    if parallel is not None:
        p.add_argument(
            "--tensor-parallel",
            type=int_option(1),
            default=1,
            help=f"split each layer across this many processes ({parallel}; >= 1)",
        )
        p.add_argument(
            "--pipeline-parallel",
            type=int_option(1),
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
            type=int_option(0, 16),
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
            type=int_option(1, 32),
            default=None,
            metavar="K",
            help="tokens proposed per pass at most (1 to 32; default 16): each pass proposes what pays",
        )
    else:
        p.set_defaults(lookup=0, draft=None, speculative_tokens=None)
    p.add_argument("--deterministic", action="store_true", help=f"fixed-shape products: {deterministic}")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")


def _value_options(p: argparse.ArgumentParser, *options: ValueOption) -> None:
    """One ``p.add_argument(flag, type=..., default=..., help=...)`` per option, in order."""
    for flag, kind, default, text in options:
        p.add_argument(flag, type=kind, default=default, help=text)


def sampling_options(p: argparse.ArgumentParser) -> None:
    """The options `_sampling` reads (generate and chat)."""
    _value_options(
        p,
        ("--max-new-tokens", int_option(1), 256, "tokens to generate (>= 1)"),
        ("--temperature", _float_option(0.0), 0.0, "0 is greedy (the default); finite, >= 0"),
        ("--top-k", int_option(0, TOP_K_MAX), 0, "keep the k most likely tokens (0: all; at most 2**63-1)"),
        ("--top-p", _float_option(0.0, 1.0, open_min=True), 1.0, "nucleus sampling, in (0, 1]"),
        ("--seed", int_option(0, SEED_MAX), None, "sampling seed, 0 to 2**64-1"),
    )
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


def serve_parser(sub: Any) -> argparse.ArgumentParser:
    p = command(
        sub,
        "serve",
        help="OpenAI-compatible HTTP server with a chat page (docs/serving.md)",
        description="Serves /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics and a "
        "chat page at /. SIGTERM or Ctrl-C: stop admitting, finish running requests, exit 0.",
    )
    _value_options(
        p,
        ("--host", str, "127.0.0.1", "address to listen on (default 127.0.0.1: this machine only)"),
        ("--port", int_option(0, 65535), 8000, "port (0: any free one; default 8000)"),
        ("--max-batch", int_option(1), None, "requests generated together (>= 1)"),
        ("--max-waiting", int_option(0), None, "requests queued for a row; more are refused with 429 (>= 0)"),
        (
            "--api-key",
            str,
            None,
            "require 'Authorization: Bearer KEY' on every endpoint but /health (default: $INFER_API_KEY)",
        ),
        ("--served-model-name", str, None, "the model's name in the API (default: its file name)"),
        (
            "--shutdown-timeout",
            _float_option(0.0),
            30.0,
            "seconds running requests get to finish after SIGTERM before they are ended (default 30)",
        ),
        (
            "--max-body-bytes",
            int_option(1),
            None,
            "larger request bodies are refused with 413 before they are read (default 4 MiB)",
        ),
    )
    p.add_argument("--verbose", action="store_true", help="uvicorn's info log (one line per request)")
    load_options(
        p,
        deterministic="a request's tokens and logprobs do not depend on the other requests",
        parallel="under torchrun; rank 0 serves HTTP",
        compile=True,
    )
    return p


def perplexity_parser(sub: Any) -> argparse.ArgumentParser:
    from infer.perplexity import DEFAULT_CONTEXT

    p = command(
        sub,
        "perplexity",
        help="perplexity over a text file, as llama-perplexity -c N -b N computes it",
        description="Chunks of --context tokens; the second half of each chunk is scored; "
        "ppl = exp(mean negative log-likelihood). Prints PPL +/- its standard error.",
    )
    p.add_argument("file", nargs="?", default=None, help="UTF-8 text file")
    p.add_argument(
        "--context",
        type=int_option(3),
        default=DEFAULT_CONTEXT,
        help=f"tokens per chunk, llama.cpp's -c (>= 3; default {DEFAULT_CONTEXT})",
    )
    p.add_argument("--batch", type=int_option(1), default=1, help="chunks per forward pass (>= 1)")
    p.add_argument(
        "--max-chunks", type=int_option(1), default=None, help="score only the first chunks (>= 1)"
    )
    p.add_argument("--bytes", type=int_option(1), default=None, help="read only the first BYTES bytes (>= 1)")
    load_options(
        p,
        deterministic="the same figure whatever --batch is (slower)",
        parallel=None,
        compile=False,
        speculative=False,
    )
    return p


def eval_parser(sub: Any) -> argparse.ArgumentParser:
    p = command(
        sub,
        "eval",
        help="lm-evaluation-harness tasks on the model (needs infer[eval])",
        description="Runs lm-eval's evaluator with infer's backend (infer.evaluation: the hf backend's "
        "encoding and truncation, infer's forward and engine) and prints lm-eval's table.",
    )
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task (or group) names")
    p.add_argument("--include-path", default=None, metavar="DIR", help="a directory of task YAML files")
    p.add_argument("--num-fewshot", type=int_option(0), default=None, metavar="K", help="few-shot examples")
    p.add_argument(
        "--limit", type=_float_option(0.0, open_min=True), default=None, metavar="N",
        help="the first N documents of each task (a fraction when < 1)",
    )  # fmt: skip
    p.add_argument(
        "--batch-size", type=_auto_or(int_option(1)), default=16,
        help="requests per forward (>= 1, or auto: 16, as lm-eval's 'auto' means for infer)",
    )  # fmt: skip
    p.add_argument(
        "--max-length", type=int_option(1), default=None, help="tokens of context (default: the model's)"
    )
    p.add_argument("--apply-chat-template", action="store_true", help="render prompts with the chat template")
    p.add_argument(
        "--output-path", default=None, metavar="P", help="write the results (with samples) as JSON"
    )
    load_options(
        p, deterministic="scores whatever the batch (slower)", parallel=None, compile=True, speculative=False
    )
    return p
