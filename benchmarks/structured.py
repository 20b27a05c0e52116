"""Structured output on the two real models: validity, tool calls, per-token overhead, compile time.

    INFER_AOT=off uv run python benchmarks/structured.py            # both models, everything
    INFER_AOT=off uv run python benchmarks/structured.py --quick    # 8 schemas, 1 timing round

For SmolLM2-135M-Instruct (Q4_1, 49,152 tokens) and Gemma 3 270M (Q4_K_M, 262,144 tokens):

1. **Validity**: each schema of `structured_schemas.SCHEMAS` (24: nested objects, arrays with
   minItems/maxItems, enums, const, pattern, number ranges, required, additionalProperties false,
   anyOf/oneOf, $ref, formats), greedy and sampled (temperature 0.7, top_p 0.95, a seed per
   schema), all the schemas of a mode submitted at once (the engine batches them, 16 rows at most):
   every output is parsed and validated with `jsonschema` (formats checked); an output cut by
   ``--max-tokens`` counts as a failure. SmolLM2 gets the schema in a chat turn; Gemma 3 270M is
   a base model without a chat template and gets a plain prompt.
2. **Tool calls** (SmolLM2; Gemma 3 270M has no chat template, so no chat endpoint): ``infer serve``'s
   app on 127.0.0.1, ``tool_choice: "required"``, streamed and not, ``--tool-requests`` prompts each:
   every response must carry a call whose arguments validate against the tool's parameters.
3. **Overhead**: the process CPU time per decode step of unconstrained requests and of requests
   under a JSON schema whose output cannot end within the run (so every row decodes as many
   tokens), at batch 1 and 16, greedy and sampled (temperature 0.8, top_p 0.95): the CPU time of a
   run of ``--tokens`` tokens less that of a run of 8 (prefill and set-up cancel), over the
   tokens between, with torch on ``--threads`` threads (1 by default: CPU time then counts work,
   not other processes' load or OpenMP's spinning, on a shared machine). Free and constrained runs
   alternate ``--rounds`` times; the median of the rounds. ``--wall`` also prints the wall-clock
   decode time per token (noisy on a shared machine).
4. **Compile time**: the vocabulary setup (once per model and process) and each schema's compile
   (llguidance; first time, no cache).

Steps run eagerly (``INFER_AOT=off``: no ahead-of-time packages, so both sides run the same code and
nothing is built in the background). Prints Markdown tables, the CPU and the load average;
``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from structured_schemas import SCHEMAS

ROOT = Path(__file__).resolve().parent.parent
# An object whose array needs more items than a run has tokens: every constrained row decodes them all.
LONG = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 60}},
    "required": ["items"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 60},
                "limit": {"type": "integer", "minimum": 1, "maximum": 10},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
TOOL_PROMPTS = [
    "What's the weather in Paris?",
    "Is it raining in Tokyo right now?",
    "Find recent news about the Mars rover.",
    "How warm is it in Cairo, in fahrenheit?",
    "Search for a pancake recipe.",
    "Weather in Oslo please.",
    "Look up the population of Brazil.",
    "Should I take an umbrella in London today?",
]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def models(names: list[str]) -> list[tuple[str, Path]]:
    from infer.realmodels import gemma3_270m_path, smollm2_path

    table = {
        "smollm2": ("SmolLM2-135M Q4_1", smollm2_path),
        "gemma3": ("Gemma 3 270M Q4_K_M", gemma3_270m_path),
    }
    return [(table[n][0], table[n][1]()) for n in names]


def prompt_for(llm: Any, hint: str, schema: dict[str, Any]) -> list[int]:
    if llm.tokenizer.chat_template:
        text = f"Give {hint} as a JSON object matching this JSON schema:\n{json.dumps(schema)}"
        ids: list[int] = llm.chat_prompt([{"role": "user", "content": text}])
        return ids
    plain: list[int] = llm.tokenizer.encode(f"Here is {hint}, as a JSON object: ")
    return plain


def validity(llm: Any, schemas: list[Any], max_tokens: int) -> dict[str, Any]:
    import jsonschema

    from infer.engine import SamplingParams, collect
    from infer.text.structured import Constraint

    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    out: dict[str, Any] = {}
    for mode in ("greedy", "sampled"):
        handles = []
        for i, (name, hint, schema, _) in enumerate(schemas):
            sampling: dict[str, Any] = (
                {"temperature": 0.7, "top_p": 0.95, "seed": i} if mode == "sampled" else {}
            )
            p = SamplingParams(max_tokens=max_tokens, constraint=Constraint.json_schema(schema), **sampling)
            handles.append((name, schema, llm.engine.submit(prompt_for(llm, hint, schema), p)))
        valid, failures, lengths = 0, [], []
        for name, schema, h in handles:
            ids, text = collect(h)
            lengths.append(len(ids))
            try:
                jsonschema.validate(json.loads(text), schema, format_checker=checker)
                valid += 1
            except Exception as e:  # a cut output does not parse; a bad one does not validate
                failures.append(
                    f"{name} ({h.finish_detail}): {type(e).__name__}: {str(e)[:80]} -- {text[:80]!r}"
                )
        out[mode] = {
            "valid": valid,
            "total": len(handles),
            "failures": failures,
            "tokens_median": statistics.median(lengths),
        }
        print(
            f"  {mode}: {valid}/{len(handles)} valid (median {statistics.median(lengths)} tokens)", flush=True
        )
        for f in failures:
            print(f"    FAIL {f}", flush=True)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def tool_calls(llm: Any, requests: int) -> dict[str, Any]:
    """``tool_choice: "required"`` through the served app, streamed and not."""
    import httpx
    import jsonschema
    import uvicorn

    from infer.serve import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(llm), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}  # type: ignore[index]
    out: dict[str, Any] = {}

    async def one(client: httpx.AsyncClient, prompt: str, stream: bool, seed: int) -> str | None:
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "tools": [WEATHER, SEARCH],
            "tool_choice": "required",
            "max_tokens": 160,
            "temperature": 0.7,
            "seed": seed,
            "stream": stream,
        }
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        calls: dict[int, dict[str, str]] = {}
        if stream:
            finish = None
            async with client.stream("POST", url, json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    for choice in json.loads(line[6:]).get("choices", []):
                        finish = choice.get("finish_reason") or finish
                        for tc in choice["delta"].get("tool_calls") or []:
                            slot = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                            slot["name"] += tc["function"].get("name") or ""
                            slot["arguments"] += tc["function"].get("arguments") or ""
        else:
            r = await client.post(url, json=body)
            choice = r.json()["choices"][0]
            finish = choice["finish_reason"]
            for i, tc in enumerate(choice["message"].get("tool_calls") or []):
                calls[i] = tc["function"]
        if finish != "tool_calls" or not calls:
            return f"{prompt!r}: finish {finish}, {len(calls)} calls"
        for c in calls.values():
            try:
                jsonschema.validate(json.loads(c["arguments"]), params[c["name"]])
            except Exception as e:
                return f"{prompt!r}: {c}: {type(e).__name__}: {str(e)[:80]}"
        return None

    async def run(stream: bool) -> list[str | None]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            prompts = [TOOL_PROMPTS[i % len(TOOL_PROMPTS)] for i in range(requests)]
            return await asyncio.gather(*(one(client, p, stream, i) for i, p in enumerate(prompts)))

    try:
        for stream in (False, True):
            errors = [e for e in asyncio.run(run(stream)) if e is not None]
            key = "streamed" if stream else "whole"
            out[key] = {"valid": requests - len(errors), "total": requests, "failures": errors}
            print(
                f"  tool_choice required, {key}: {requests - len(errors)}/{requests} valid calls", flush=True
            )
            for e in errors:
                print(f"    FAIL {e}", flush=True)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    return out


def run(llm: Any, batch: int, constrained: bool, sampled: bool, tokens: int) -> tuple[float, float]:
    """``(process CPU seconds, wall decode seconds per token)`` of ``batch`` requests of ``tokens``."""
    from infer.engine import SamplingParams, collect
    from infer.text.structured import Constraint

    prompt = prompt_for(llm, "a long list of fruit names", LONG)
    sampling: dict[str, Any] = {"temperature": 0.8, "top_p": 0.95} if sampled else {}
    constraint = Constraint.json_schema(LONG) if constrained else None
    params = [
        SamplingParams(max_tokens=tokens, ignore_eos=True, constraint=constraint, seed=i, **sampling)
        for i in range(batch)
    ]
    cpu = time.process_time()
    handles = [llm.engine.submit(prompt, p) for p in params]
    for h in handles:
        collect(h)
        assert len(h.token_ids) == tokens, (constrained, h.finish_detail, len(h.token_ids))
    cpu = time.process_time() - cpu
    return cpu, float(statistics.median(h.decode_seconds / (tokens - 1) for h in handles))


def per_step(llm: Any, batch: int, constrained: bool, sampled: bool, tokens: int) -> tuple[float, float]:
    """``(CPU seconds per decode step, wall seconds per token)``: runs of ``tokens`` and of 8, differenced."""
    short, _ = run(llm, batch, constrained, sampled, 8)
    long, wall = run(llm, batch, constrained, sampled, tokens)
    return (long - short) / (tokens - 8), wall


def overhead(llm: Any, tokens: int, rounds: int) -> list[dict[str, Any]]:
    rows = []
    run(llm, 1, True, False, 8)  # warm up both paths
    run(llm, 1, False, False, 8)
    for batch in (1, 16):
        for sampled in (False, True):
            free, constrained, walls = [], [], []
            for _ in range(rounds):
                f_cpu, f_wall = per_step(llm, batch, False, sampled, tokens)
                c_cpu, c_wall = per_step(llm, batch, True, sampled, tokens)
                free.append(f_cpu)
                constrained.append(c_cpu)
                walls.append((f_wall, c_wall))
            f, c = statistics.median(free), statistics.median(constrained)
            row = {
                "batch": batch,
                "sampling": "sampled" if sampled else "greedy",
                "free_ms": f * 1e3,
                "json_ms": c * 1e3,
                "overhead_pct": 100 * (c / f - 1),
                "free_all_ms": [x * 1e3 for x in free],
                "json_all_ms": [x * 1e3 for x in constrained],
                "wall_ms": [(a * 1e3, b * 1e3) for a, b in walls],
            }
            rows.append(row)
            wall = "".join(f" ({a * 1e3:.0f}/{b * 1e3:.0f})" for a, b in walls)
            print(
                f"  batch {batch:2d} {row['sampling']:7}: free {f * 1e3:7.1f} CPU ms/step, JSON schema "
                f"{c * 1e3:7.1f} CPU ms/step, overhead {row['overhead_pct']:+.1f}%; wall ms free/JSON{wall}",
                flush=True,
            )
    return rows


def compile_times(llm: Any, schemas: list[Any]) -> dict[str, Any]:
    from infer.text.structured import Constraint, Grammars

    t0 = time.perf_counter()
    grammars = Grammars(llm.tokenizer, llm.model.vocab_size, llm.eos_ids)
    _ = grammars.lltokenizer
    setup = time.perf_counter() - t0
    times = []
    for _, _, schema, _ in schemas:
        t0 = time.perf_counter()
        grammars.matcher(Constraint.json_schema(schema))
        times.append(time.perf_counter() - t0)
    out = {
        "vocabulary_s": setup,
        "compile_ms_median": statistics.median(times) * 1e3,
        "compile_ms_max": max(times) * 1e3,
    }
    print(
        f"  vocabulary {setup:.2f} s; schema compile median {out['compile_ms_median']:.2f} ms, "
        f"max {out['compile_ms_max']:.2f} ms",
        flush=True,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--quick", action="store_true", help="8 schemas, 1 timing round, 4 tool requests")
    ap.add_argument("--max-tokens", type=int, default=320, help="per validity request")
    ap.add_argument("--tokens", type=int, default=40, help="tokens per request when timing (> 8)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads while timing")
    ap.add_argument("--parts", default="compile,validity,tools,overhead", help="what to run")
    ap.add_argument("--tool-requests", type=int, default=8)
    ap.add_argument("--json", default=str(ROOT / ".bench" / "structured.json"))
    args = ap.parse_args()
    if os.environ.get("INFER_AOT") != "off":
        print("note: INFER_AOT is not 'off': steps may run ahead-of-time packages", flush=True)
    import torch

    import infer

    schemas = SCHEMAS[:8] if args.quick else SCHEMAS
    rounds = 1 if args.quick else args.rounds
    tool_requests = 4 if args.quick else args.tool_requests
    report: dict[str, Any] = {"cpu": cpu_name(), "cpus": os.cpu_count(), "load_before": os.getloadavg()}
    started = time.time()
    for name, path in models(args.models.split(",")):
        print(f"{name} ({path.name})", flush=True)
        llm = infer.load(path)
        parts = args.parts.split(",")
        entry: dict[str, Any] = {}
        if "compile" in parts:
            entry["compile"] = compile_times(llm, schemas)
        if "validity" in parts:
            entry["validity"] = validity(llm, schemas, args.max_tokens)
        if "tools" in parts and llm.tokenizer.chat_template:
            entry["tools"] = tool_calls(llm, tool_requests)
        if "overhead" in parts:
            threads = torch.get_num_threads()
            torch.set_num_threads(args.threads)
            try:
                entry["overhead"] = overhead(llm, args.tokens, rounds)
            finally:
                torch.set_num_threads(threads)
        report[name] = entry
        llm.engine.close()
    report["load_after"] = os.getloadavg()
    report["seconds"] = time.time() - started
    print(
        f"CPU: {report['cpu']} ({report['cpus']} logical CPUs); load average {report['load_before'][0]:.2f} "
        f"-> {report['load_after'][0]:.2f}; {report['seconds']:.0f} s",
        flush=True,
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
