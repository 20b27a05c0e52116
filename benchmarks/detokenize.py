"""Per-token cost of turning tokens into text, before and after the engine's split (issue 35).

    uv run python benchmarks/detokenize.py                  # Qwen2.5-Coder-0.5B's tokenizer, 16 x 512
    uv run python benchmarks/detokenize.py --tokens 2048

Before: on the thread that runs the model, each generated token of each stream decoded the whole
generation twice (`TextStream.push`, then the stop-string check `cut_at_stop(decode(all))`), so a
token's cost grew with the tokens before it. After: the model's thread decodes nothing; each
stream's handle decodes a window of its last tokens (`infer.text.stream.TextStream`) on its
reader's thread (the server's event loop), and finds stop strings in the new text only.

The token streams are real text (this repository's docs, tokenized), ``--streams`` of them, each
cut to ``--tokens`` tokens; both sides get one stop string that never occurs. Prints the CPU, the
microseconds per token (mean over the run, and at the last token) of each side, and checks that
both sides' text is the same.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from infer.loading import open_checkpoint
from infer.realmodels import fetch
from infer.text.stream import TextStream, cut_at_stop, stop_prefix


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def before(tokenizer: object, tokens: list[int], stops: list[str]) -> tuple[str, list[float]]:
    """The old path, per token: the whole generation decoded for the stream and for the stop check."""
    decode = tokenizer.decode  # type: ignore[attr-defined]
    emitted, times = "", []
    for n in range(1, len(tokens) + 1):
        t0 = time.perf_counter()
        cut_at_stop(decode(tokens[:n]), stops)  # the engine's stop check
        full = decode(tokens[:n])  # TextStream.push
        if full.endswith("\ufffd"):
            full = full.rstrip("\ufffd")
        safe = full[: max(len(emitted), len(full) - stop_prefix(full, stops))]
        emitted += safe[len(emitted) :] if safe.startswith(emitted) else ""
        times.append(time.perf_counter() - t0)
    final = cut_at_stop(decode(tokens), stops)[0]
    return emitted + (final[len(emitted) :] if final.startswith(emitted) else ""), times


def after(tokenizer: object, tokens: list[int], stops: list[str]) -> tuple[str, list[float]]:
    stream = TextStream(tokenizer)  # type: ignore[arg-type]
    text, times = "", []
    for n in range(1, len(tokens) + 1):
        t0 = time.perf_counter()
        text += stream.push(tokens[:n], stops)
        times.append(time.perf_counter() - t0)
    return text + stream.finish(tokens, stops), times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="qwen-coder-0.5b", help="an infer.realmodels name or a checkpoint path"
    )
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    path = Path(args.model) if Path(args.model).exists() else fetch(args.model)
    tokenizer = open_checkpoint(path).tokenizer()
    text = "\n".join(p.read_text() for p in sorted(Path(__file__).parents[1].glob("docs/*.md")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    streams = [ids[i * args.tokens : (i + 1) * args.tokens] for i in range(args.streams)]
    stops = ["\u2603 never \u2603"]
    print(f"{cpu_name()}; {args.streams} streams x {args.tokens} tokens; tokenizer of {path.name}\n")
    print("| | model thread, us/token (mean) | at the last token | reader thread, us/token (mean) |")
    print("|---|---|---|---|")
    results = {}
    for name, fn in (("before", before), ("after", after)):
        texts, all_times, last = [], [], []
        for s in streams:
            out, times = fn(tokenizer, s, stops)
            texts.append(out)
            all_times += times
            last.append(times[-1])
        results[name] = texts
        mean = 1e6 * sum(all_times) / len(all_times)
        at_end = 1e6 * sum(last) / len(last)
        if name == "before":
            print(f"| before (whole generation per token) | {mean:.0f} | {at_end:.0f} | 0 |")
        else:
            print(f"| after (incremental, on the reader) | 0 | 0 | {mean:.0f} (last token {at_end:.0f}) |")
    assert results["before"] == results["after"], "the two paths' texts differ"
    print("\nsame text on both sides")


if __name__ == "__main__":
    main()
