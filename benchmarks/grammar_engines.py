"""Grammar engines compared on the two real vocabularies: why infer uses llguidance.

    uv run --with xgrammar --with outlines-core python benchmarks/grammar_engines.py
    uv run --with xgrammar --with outlines-core python benchmarks/grammar_engines.py --quick

For SmolLM2-135M (49,152 tokens) and Gemma 3 270M (262,144 tokens), and each engine
installed (llguidance, xgrammar, outlines-core), it reports:

* the one-time vocabulary setup (per model and process);
* the compile time of each schema of `structured_schemas.SCHEMAS` (first time, no cache), and
  which schemas the engine refuses;
* the mask time per token: along the tokens of each schema's valid instance (the model's own
  tokenization of its compact JSON), the time to compute the next-token mask into a packed
  bitmask plus the time to advance the matcher by the token — what a decode step pays per
  constrained row, median and p95 over all tokens of all schemas.

Only llguidance is a dependency of infer; the others are brought in by ``uv run --with``.
Each engine runs with one thread (``OMP_NUM_THREADS``/``RAYON_NUM_THREADS`` honoured) so the
figures compare like with like on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RAYON_NUM_THREADS", "1")

from structured_schemas import SCHEMAS


@dataclass
class Result:
    engine: str
    model: str
    setup_s: float = 0.0
    compile_s: list[float] = field(default_factory=list)
    mask_us: list[float] = field(default_factory=list)
    first_us: list[float] = field(
        default_factory=list
    )  # the first mask of each schema (lazy engines build here)
    refused: list[str] = field(default_factory=list)


def real_tokenizers(quick: bool) -> list[tuple[str, Any]]:
    from infer.gguf.config import config_from_gguf
    from infer.gguf.reader import GGUFFile
    from infer.gguf.tokenizer import gguf_tokenizer
    from infer.realmodels import gemma3_270m_path, smollm2_path

    out = []
    for name, path in (("SmolLM2-135M", smollm2_path()), ("Gemma 3 270M", gemma3_270m_path())):
        g = GGUFFile(path)
        cfg = config_from_gguf(g)
        out.append((name, (gguf_tokenizer(g, cfg), cfg.vocab_size)))
    return out


def llguidance_engine(tokenizer: Any, vocab: int) -> tuple[float, Callable[..., Any]]:
    import llguidance
    import torch

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tokenizer.hf._tk.to_str(), n_vocab=vocab, eos_token=tokenizer.eos_token_ids)
    setup = time.perf_counter() - t0
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def run(schema: dict[str, Any], tokens: list[int]) -> tuple[float, list[float]]:
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        m = llguidance.LLMatcher(lt, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        compile_s = time.perf_counter() - t0
        if not tokens:
            m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            if m.is_error():
                raise ValueError(m.get_error())
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            ok = m.consume_token(t)
            times.append(time.perf_counter() - t0)
            if not ok:
                raise ValueError(f"token {t} refused: {m.get_error()}")
        return compile_s, times

    return setup, run


def xgrammar_engine(tokenizer: Any, vocab: int) -> tuple[float, Callable[..., Any]]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer.hf.transformers(), vocab_size=vocab, stop_token_ids=tokenizer.eos_token_ids
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, vocab)

    def run(schema: dict[str, Any], tokens: list[int]) -> tuple[float, list[float]]:
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
        m = xgr.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - t0
        if not tokens:
            m.fill_next_token_bitmask(mask)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            ok = m.accept_token(t)
            times.append(time.perf_counter() - t0)
            if not ok:
                raise ValueError(f"token {t} refused")
        return compile_s, times

    return setup, run


def outlines_engine(tokenizer: Any, vocab: int) -> tuple[float, Callable[..., Any]]:
    import outlines_core as oc
    import torch

    t0 = time.perf_counter()
    eos = tokenizer.eos_token_ids[0]
    table: dict[bytes, list[int]] = {}
    for i, b in enumerate(vocabulary_bytes(tokenizer, vocab)):
        if b is not None and i != eos:
            table.setdefault(b, []).append(i)
    vocabulary = oc.Vocabulary(eos, table)
    setup = time.perf_counter() - t0
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def run(schema: dict[str, Any], tokens: list[int]) -> tuple[float, list[float]]:
        t0 = time.perf_counter()
        regex = oc.json_schema.build_regex_from_schema(json.dumps(schema))
        index = oc.Index(regex, vocabulary)
        guide = oc.Guide(index)
        compile_s = time.perf_counter() - t0
        if not tokens:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
            guide.advance(t)
            times.append(time.perf_counter() - t0)
        return compile_s, times

    return setup, run


def vocabulary_bytes(tokenizer: Any, vocab: int) -> list[bytes | None]:
    """Each token id's bytes (None for special tokens and ids past the tokenizer): byte-level
    BPE pieces through GPT-2's byte alphabet, SentencePiece pieces with ``▁`` as a space and
    ``<0xHH>`` as one byte (outlines-core takes the vocabulary as bytes)."""
    from infer.serve.logprobs import byte_decoder as _byte_decoder

    tk = tokenizer.hf._tk
    byte_level = json.loads(tk.to_str()).get("decoder", {}).get("type") == "ByteLevel"
    special = {i for i, t in tk.get_added_tokens_decoder().items() if t.special}
    decoder = _byte_decoder()
    out: list[bytes | None] = []
    for i in range(vocab):
        piece = tk.id_to_token(i)
        if piece is None or i in special:
            out.append(None)
        elif byte_level:
            out.append(
                bytes(decoder[c] for c in piece) if all(c in decoder for c in piece) else piece.encode()
            )
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("\u2581", " ").encode())
    return out


# JSON Schema keywords beyond the benchmark set: does the engine compile a schema using each?
FEATURES: dict[str, dict[str, Any]] = {
    "recursive $ref": {"$defs": {"n": {"type": "object", "required": ["next"], "properties": {
                       "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}}, "$ref": "#/$defs/n"},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "minProperties/maxProperties": {"type": "object", "minProperties": 1, "maxProperties": 2},
    "patternProperties": {"type": "object", "patternProperties": {"^x-": {"type": "string"}}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
    "contains": {"type": "array", "contains": {"const": 1}},
    "not": {"not": {"type": "string"}},
    "if/then/else": {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
    "format: date-time": {"type": "string", "format": "date-time"},
    "format: ipv4": {"type": "string", "format": "ipv4"},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                          "dependentRequired": {"a": ["b"]}},
}  # fmt: skip


def coverage(name: str, tokenizer: Any, vocab: int) -> dict[str, bool]:
    """Which of `FEATURES` the engine compiles (and gives a first mask for)."""
    _, run = ENGINES[name](tokenizer, vocab)
    out = {}
    for feature, schema in FEATURES.items():
        try:
            run(schema, [])
            out[feature] = True
        except Exception:
            out[feature] = False
    return out


ENGINES = {"llguidance": llguidance_engine, "xgrammar": xgrammar_engine, "outlines-core": outlines_engine}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the first 8 schemas only")
    ap.add_argument("--engines", nargs="*", default=list(ENGINES))
    ap.add_argument("--compile-timeout", type=float, default=120.0, help="skip an engine's later schemas "
                    "for a model once its compile time in total passes this (seconds)")  # fmt: skip
    args = ap.parse_args()
    schemas = SCHEMAS[:8] if args.quick else SCHEMAS
    results: list[Result] = []
    for model, (tokenizer, vocab) in real_tokenizers(args.quick):
        for name in args.engines:
            try:
                setup, run = ENGINES[name](tokenizer, vocab)
            except ImportError as e:
                print(f"{name}: not installed ({e}); skipped", flush=True)
                continue
            r = Result(name, model, setup)
            for sname, _, schema, example in schemas:
                if sum(r.compile_s) > args.compile_timeout:
                    r.refused.append(f"{sname} (not run: compile budget spent)")
                    continue
                tokens = tokenizer.encode(
                    json.dumps(example, separators=(",", ":")), add_special_tokens=False
                )
                try:
                    compile_s, times = run(schema, tokens)
                except Exception as e:
                    r.refused.append(f"{sname} ({type(e).__name__}: {str(e)[:80]})")
                    continue
                r.compile_s.append(compile_s)
                r.first_us.append(times[0] * 1e6)
                r.mask_us += [t * 1e6 for t in times[1:]]
            results.append(r)
            q = statistics.quantiles(r.mask_us, n=20)[-1] if len(r.mask_us) > 1 else float("nan")
            ready = [c * 1e3 + f / 1e3 for c, f in zip(r.compile_s, r.first_us, strict=True)]
            print(
                f"{model:14} {name:14} setup {r.setup_s:6.2f} s | compile+first mask median "
                f"{statistics.median(ready) if ready else float('nan'):8.1f} ms max "
                f"{max(ready, default=float('nan')):8.1f} ms | later tokens: mask+advance mean "
                f"{statistics.fmean(r.mask_us) if r.mask_us else float('nan'):6.1f} us median "
                f"{statistics.median(r.mask_us) if r.mask_us else float('nan'):6.1f} us p95 {q:7.1f} us | "
                f"refused {len(r.refused)}/{len(schemas)}",
                flush=True,
            )
            for line in r.refused:
                print(f"    refused: {line}")
    tokenizer, vocab = real_tokenizers(args.quick)[0][1]
    for name in args.engines:
        try:
            cov = coverage(name, tokenizer, vocab)
        except ImportError:
            continue
        missing = [f for f, ok in cov.items() if not ok]
        refused = ", ".join(missing) or "-"
        print(f"{name:14} compiles {sum(cov.values())}/{len(cov)} extra keywords; refuses: {refused}")
    print(f"CPU: {platform.processor() or platform.machine()}; {os.cpu_count()} logical CPUs")


if __name__ == "__main__":
    main()
