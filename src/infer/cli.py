"""The `infer` command: generate, chat, inspect."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_MODEL_HELP = "checkpoint directory, .gguf file or hub id (default: SmolLM2-135M-Instruct, shipped)"


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


def _load(args: argparse.Namespace) -> Any:
    import infer

    model = args.model if args.model is not None else _default_model()
    streaming = None
    if getattr(args, "memory_budget", None):
        streaming = infer.StreamingConfig(layer_group_size=args.group_size, memory_budget=args.memory_budget)
    progress, close = _progress_bar(sys.stderr.isatty() and not args.quiet)
    try:
        return infer.load(
            model,
            device=args.device,
            dtype=args.dtype,
            quantize=args.quantize,
            streaming=streaming,
            progress=progress,
            compile=args.compile,
        )
    finally:
        close()


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop or None,
    }


def cmd_generate(args: argparse.Namespace) -> int:
    if args.prompt is None:  # `infer generate "prompt"`: the one positional is the prompt
        args.model, args.prompt = None, args.model
    if args.prompt is None:
        raise ValueError("no prompt given: infer generate [MODEL] PROMPT")
    llm = _load(args)
    for piece in llm.stream(args.prompt, args.max_new_tokens, **_sampling(args)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _load(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
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
        ids = llm.chat_prompt(messages)
        reply = []
        for piece in llm.stream(ids, args.max_new_tokens, **_sampling(args)):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from infer.inspect import inspect_checkpoint

    model = args.model if args.model is not None else _default_model()
    print(inspect_checkpoint(model, context=args.context, batch_size=args.batch_size, dtype=args.dtype))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer", description="Pure-PyTorch LLM inference.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", default="cpu")
        p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the checkpoint's)")
        p.add_argument("--quantize", choices=["q4_0", "int8"], default=None)
        p.add_argument("--memory-budget", default=None, help="stream layers under this budget, e.g. 2GB")
        p.add_argument("--group-size", type=int, default=4, help="layers per streamed group")
        p.add_argument("--max-new-tokens", type=int, default=256)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.add_argument(
            "--compile",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="compile the generation step with torch.compile (resident models; default: off)",
        )
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")

    g = sub.add_parser("generate", help="continue a prompt, streaming to the terminal")
    g.add_argument("model", nargs="?", default=None, help=DEFAULT_MODEL_HELP)
    g.add_argument("prompt", nargs="?", default=None)
    common(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat (keeps the conversation; /reset, /exit)")
    c.add_argument("model", nargs="?", default=None, help=DEFAULT_MODEL_HELP)
    c.add_argument("--system", default=None, help="system prompt")
    common(c)
    c.set_defaults(func=cmd_chat)

    i = sub.add_parser("inspect", help="architecture, parameters, tensors, memory estimates")
    i.add_argument("model", nargs="?", default=None, help=DEFAULT_MODEL_HELP)
    i.add_argument("--context", type=int, default=None, help="context length for the KV-cache estimate")
    i.add_argument("--batch-size", type=int, default=1)
    i.add_argument("--dtype", default=None)
    i.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    i.set_defaults(func=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one clear line, unless --debug
        if args.debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"infer: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["build_parser", "main"]
