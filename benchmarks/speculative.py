"""Speculative decoding (`infer.speculative`) against plain decoding, in the same run.

    uv run python benchmarks/speculative.py lookup --model smollm2   # n-gram lookup, + llama-server's
    uv run python benchmarks/speculative.py lookup --model gemma3
    uv run python benchmarks/speculative.py draft --model smollm2    # float32 verified against the Q4_1 GGUF
    uv run python benchmarks/speculative.py streamed                 # float32 streamed, Q4_1 draft resident
    uv run python benchmarks/speculative.py server                   # 16 streams, lookup on vs off
    uv run python benchmarks/speculative.py pair                     # Qwen2.5-Coder 0.5B drafts for 1.5B

Workloads (greedy, ``--tokens`` new tokens, stopping at EOS as a user's request does): three
where lookup pays — ``code`` (rewrite a ~300-token Python snippet with a variable renamed),
``summary`` (summarize a given text), ``quote`` (an answer that repeats its question) — and one
where it does not, ``story`` (open-ended). SmolLM2-135M-Instruct gets them through its chat
template; Gemma 3 270M (a base model) as completion prompts.

Every figure is decode tok/s of one request on a fresh engine (no prefix cache from the run
before), the median of ``--reps`` runs, plain and speculative alternating. "plain" is what
``infer.load(path)`` decodes with: ahead-of-time compiled packages when the cache holds them
(`infer.aot`; ``--packages`` builds them first, in a temporary cache, for the shapes the plain
runs take, and the verify passes' of one row), else eager steps; the table says which. Each row
also says whether the speculative tokens equal plain decoding's (the default mode may part at
near-ties: docs/numerics.md) and the acceptance (kept / proposed) and tokens per pass.

``lookup`` also runs ``llama-server`` (``../shared/peers/llamacpp.sh``) on the same GGUF and the
same prompt tokens, plain (``--spec-type none``) and with its n-gram lookup (``--spec-type
ngram-simple``, its defaults), and reports its own tok/s (``timings.predicted_per_second``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from llama_bin import llama_tool

import infer
from infer.engine import Engine, SamplingParams
from infer.realmodels import gemma3_270m_path, smollm2_path
from infer.speculative import Speculative

CODE = '''import csv
from dataclasses import dataclass


@dataclass
class Order:
    customer: str
    quantity: int
    unit_price: float
    discount: float = 0.0


def read_orders(path):
    """Read orders from a CSV file with customer, quantity, unit_price and discount columns."""
    orders = []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            orders.append(Order(row["customer"], int(row["quantity"]), float(row["unit_price"]),
                                float(row.get("discount") or 0.0)))
    return orders


def summarize_orders(orders, tax_rate=0.2):
    """Group orders by customer and return totals with tax."""
    totals = {}
    for order in orders:
        amount = order.quantity * order.unit_price * (1 - order.discount)
        totals[order.customer] = totals.get(order.customer, 0) + amount
    report = []
    for customer, total in sorted(totals.items()):
        tax = total * tax_rate
        report.append({"customer": customer, "total": round(total, 2), "tax": round(tax, 2)})
    return report
'''

TEXT = (
    "The town of Millbrook draws its water from two sources: a reservoir in the hills to the north, "
    "filled by spring rain and snowmelt, and three wells on the eastern edge of town. In a normal year "
    "the reservoir supplies about seventy percent of the water, and the wells supply the rest. Last "
    "summer was the driest in forty years. The reservoir fell to a third of its capacity by August, and "
    "the town council asked residents to water gardens only in the early morning and to stop washing "
    "cars at home. Water use fell by eighteen percent. The council also repaired two leaking mains under "
    "the high street, which engineers estimated had been losing enough water every day to fill a "
    "swimming pool. For next summer, the council plans to add a fourth well, to pay households that "
    "replace lawns with native plants, and to publish the reservoir level every week on the town "
    "website so that residents can see how much water is left."
)

QUESTION = (
    "My sourdough starter doubles in size within six hours at room temperature, but my bread comes out "
    "dense and flat even after a long overnight rise in the fridge. What am I doing wrong?"
)

WORKLOADS: dict[str, tuple[str, str]] = {  # name -> (chat message, completion prompt)
    "code": (
        f"Rewrite this code with the variable `totals` renamed to `sums`. Output only the code.\n\n"
        f"```python\n{CODE}```",
        f"Original code:\n```python\n{CODE}```\n\nThe same code with the variable `totals` renamed to "
        "`sums`:\n```python\n",
    ),
    "summary": (
        f"{TEXT}\n\nSummarize the text above in a few sentences, using its own words.",
        f"{TEXT}\n\nSummary of the text above, in its own words: The town of Millbrook",
    ),
    "quote": (
        f"First repeat my question word for word, then answer it.\n\n{QUESTION}",
        f'Question: {QUESTION}\n\nAnswer: You asked: "',
    ),
    "story": (
        "Write a story about a lighthouse keeper who finds a message in a bottle.",
        "Once upon a time, a lighthouse keeper found a message in a bottle. ",
    ),
}


def model_path(name: str) -> Path:
    return smollm2_path() if name == "smollm2" else gemma3_270m_path()


def float32_copy(gguf: Path) -> Path:
    """A float32 GGUF of ``gguf``'s weights (every tensor dequantized, the metadata as it is),
    written once next to the assembled real models: a float32 checkpoint of the same model."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    from infer.realmodels import models_dir

    out = models_dir() / f"{gguf.stem}.F32.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    reader = GGUFReader(gguf)
    writer = GGUFWriter(str(tmp), reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY and len(f.types) > 1 else None
        writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        data = (
            np.asarray(t.data)
            if t.tensor_type == GGMLQuantizationType.F32
            else dequantize(t.data, t.tensor_type)
        )
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        writer.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out


def prompt_ids(llm: infer.LLM, workload: str, chat: bool) -> list[int]:
    message, completion = WORKLOADS[workload]
    if chat:
        return llm.chat_prompt([{"role": "user", "content": message}])
    return llm.tokenizer.encode(completion)


def run_once(llm: infer.LLM, ids: list[int], tokens: int, spec: Speculative | None) -> dict[str, Any]:
    """One request on a fresh engine: its tokens, decode tok/s and the speculation counters."""
    llm.speculative = spec
    engine = Engine(llm)
    try:
        handle = engine.submit(ids, SamplingParams(max_tokens=tokens))
        for _ in handle:
            pass
        stats = engine.stats()
    finally:
        engine.close(drain=False)
        llm.speculative = None
    n = len(handle.token_ids)
    return {
        "tokens": list(handle.token_ids),
        "tok_s": (n - 1) / handle.decode_seconds if n > 1 and handle.decode_seconds > 0 else 0.0,
        "proposed": stats.get("spec_proposed", 0.0),
        "accepted": stats.get("spec_accepted", 0.0),
        "per_pass": stats.get("spec_tokens_per_pass", 0.0),
    }


def compare(llm: infer.LLM, ids: list[int], tokens: int, spec: Speculative, reps: int) -> dict[str, Any]:
    """Plain and speculative runs alternating: medians, and where the tokens part (if they do), with
    how close plain's top two logits were there (a full forward, no cache)."""
    plain, fast = [], []
    for _ in range(reps):
        plain.append(run_once(llm, ids, tokens, None))
        fast.append(run_once(llm, ids, tokens, spec))
    a, b = plain[0]["tokens"], fast[0]["tokens"]
    parts = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    gap = None
    if parts is not None:
        with torch.inference_mode():
            logits = llm.model(torch.tensor([ids + a[:parts]]))[0, -1].float()
        top = logits.topk(2).values
        gap = float(top[0] - top[1]) / float(logits.abs().max())
    proposed = sum(r["proposed"] for r in fast)
    return {
        "plain_tok_s": statistics.median(r["tok_s"] for r in plain),
        "spec_tok_s": statistics.median(r["tok_s"] for r in fast),
        "tokens": len(b),
        "acceptance": sum(r["accepted"] for r in fast) / proposed if proposed else 0.0,
        "per_pass": statistics.median(r["per_pass"] for r in fast),
        "parts_at": parts,
        "gap": gap,
    }


def same_text(r: dict[str, Any]) -> str:
    if r["parts_at"] is None:
        return "yes"
    return f"from token {r['parts_at']} (top two {r['gap']:.1e} apart)"


def use_packages(
    llm: infer.LLM, prompts: list[list[int]], tokens: int, directory: str, spec: Speculative | None = None
) -> None:
    """Plain decode steps (and, with ``spec``, verify passes) from ahead-of-time packages in
    ``directory``; those the runs of ``prompts`` miss are built first (kept there for the next run)."""
    import infer.aot as aot
    from infer.execution import Execution
    from infer.sampling import Sampling

    aot.settings.CACHE_DIR = Path(directory)
    if aot.settings.setting() != "on":  # INFER_AOT as unset: note what is missing; built here, not queued
        os.environ.pop("INFER_AOT", None)
    recipe = aot.Recipe(str(llm.source), None, None)
    cache = aot.PackageCache(llm.model, recipe, queue_missing=False)
    llm.execution = Execution(llm.model, compile="auto", packages=cache)
    for ids in prompts:
        run_once(llm, ids, tokens, None)  # notes the shapes
        if spec is not None:
            run_once(llm, ids, tokens, spec)
    t0 = time.perf_counter()
    for request in cache.missing.values():
        mode = Sampling(**request["mode"])
        aot.build(llm.model, request["batch"], mode, Path(request["out"]), request.get("width", 1))
    cache.missing.clear()
    cache._looked.clear()
    os.environ["INFER_AOT"] = "use"  # shapes missed later run eagerly; nothing is built at exit
    built = len(list(aot.cache_dir().glob("*.pt2")))
    print(f"{built} packages in {directory} ({time.perf_counter() - t0:.0f} s building)")


# ---- llama-server --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def llama_server_runs(
    gguf: Path, prompts: dict[str, list[int]], tokens: int, reps: int, spec: list[str]
) -> dict[str, Any]:
    """llama-server's decode tok/s per workload (median of ``reps``), started with ``spec``."""
    port = _free_port()
    threads = str(torch.get_num_threads())
    server_bin = str(llama_tool("llama-server"))
    cmd = [server_bin, "-m", str(gguf), "--port", str(port), "-t", threads, "-c", "4096", "-np", "1",
           "--no-webui", *spec]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise RuntimeError(f"llama-server did not start: {' '.join(cmd)}")
            time.sleep(0.5)
        out: dict[str, Any] = {}
        for name, ids in prompts.items():
            speeds, drafted, kept = [], 0, 0
            for _ in range(reps):
                body = {"prompt": ids, "n_predict": tokens, "temperature": 0.0, "cache_prompt": False}
                url = f"http://127.0.0.1:{port}/completion"
                req = urllib.request.Request(
                    url, json.dumps(body).encode(), {"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(req, timeout=600) as r:
                    timings = json.loads(r.read())["timings"]
                speeds.append(timings["predicted_per_second"])
                drafted += timings.get("draft_n", 0)
                kept += timings.get("draft_n_accepted", 0)
            out[name] = {"tok_s": statistics.median(speeds), "acceptance": kept / drafted if drafted else 0.0}
        return out
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


LLAMA_NGRAM = {  # llama-server's n-gram lookup: its defaults (12-token match, 48 drafted), and closer to ours
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-simple n=4 m=16": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                              "--spec-ngram-simple-size-m", "16"],
}  # fmt: skip


# ---- modes ---------------------------------------------------------------------------------


def mode_lookup(args: argparse.Namespace) -> None:
    path = model_path(args.model)
    llm = infer.load(path)
    chat = args.model == "smollm2"
    prompts = {w: prompt_ids(llm, w, chat) for w in WORKLOADS}
    if args.packages:
        use_packages(llm, list(prompts.values()), args.tokens, args.packages)
    run_once(llm, prompts["story"], 8, None)  # warm-up
    spec = Speculative(lookup=args.lookup, max_tokens=args.k)
    results = {w: compare(llm, ids, args.tokens, spec, args.reps) for w, ids in prompts.items()}
    packaged = llm.execution.packaged_steps > 0
    peers: dict[str, Any] = {}
    if args.llama_server and llama_tool("llama-server").is_file():
        peers["plain"] = llama_server_runs(path, prompts, args.tokens, args.reps, ["--spec-type", "none"])
        for name, flags in LLAMA_NGRAM.items():
            peers[name] = llama_server_runs(path, prompts, args.tokens, args.reps, flags)
    how = "from packages" if packaged else "eager (no packages)"
    print(f"\n{args.model}: lookup={args.lookup}, at most {args.k} tokens per pass; plain decode {how}; "
          f"{args.tokens} new tokens at most")  # fmt: skip
    print("| workload | prompt | tokens | plain tok/s | lookup tok/s | speed-up | kept/proposed "
          "| tokens/pass | same tokens |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for w, r in results.items():
        print(f"| {w} | {len(prompts[w])} | {r['tokens']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} "
              f"| {r['spec_tok_s'] / r['plain_tok_s']:.2f}x | {r['acceptance']:.2f} | {r['per_pass']:.2f} "
              f"| {same_text(r)} |")  # fmt: skip
    if peers:
        names = [n for n in peers if n != "plain"]
        print(f"\nllama-server, same prompt tokens: | workload | plain tok/s | {' | '.join(names)} |")
        for w in prompts:
            p0 = peers["plain"][w]["tok_s"]
            cells = [f"{peers[n][w]['tok_s']:.1f} ({peers[n][w]['tok_s'] / p0:.2f}x, "
                     f"{peers[n][w]['acceptance']:.2f} kept)" for n in names]  # fmt: skip
            print(f"| {w} | {p0:.1f} | {' | '.join(cells)} |")
    _save(
        args,
        {"mode": "lookup", "model": args.model, "packaged": packaged, "results": results, "peers": peers},
    )


def print_compared(results: dict[str, dict[str, Any]], plain: str, spec: str) -> None:
    """The table of `compare`'s results, one row a workload."""
    print(f"| workload | tokens | {plain} | {spec} | speed-up | kept/proposed | tokens/pass | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for w, r in results.items():
        print(f"| {w} | {r['tokens']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} "
              f"| {r['spec_tok_s'] / r['plain_tok_s']:.2f}x | {r['acceptance']:.2f} | {r['per_pass']:.2f} "
              f"| {same_text(r)} |")  # fmt: skip


def mode_draft(args: argparse.Namespace) -> None:
    path = model_path(args.model)
    target = infer.load(path, dtype=torch.float32)
    draft = infer.load(path)  # the GGUF's default: packed products
    chat = args.model == "smollm2"
    prompts = {w: prompt_ids(target, w, chat) for w in WORKLOADS}
    if args.packages:  # the draft's steps from packages, as its plain decode runs
        use_packages(draft, list(prompts.values()), args.tokens, args.packages)
    run_once(target, prompts["story"], 4, None)
    spec = Speculative(draft=draft, lookup=args.lookup, max_tokens=args.k)
    results = {w: compare(target, ids, args.tokens, spec, args.reps) for w, ids in prompts.items()}
    print(f"\n{args.model} float32 (the exact mode) verified against its GGUF's packed weights "
          f"(+ lookup {args.lookup}); at most {args.k} tokens per pass")  # fmt: skip
    print_compared(results, "float32 tok/s", "with the packed draft")
    _save(args, {"mode": "draft", "model": args.model, "results": results})


def mode_streamed(args: argparse.Namespace) -> None:
    path = model_path(args.model)
    f32 = float32_copy(path)
    size = f32.stat().st_size
    budget = size // 4
    target = infer.load(f32, streaming=infer.StreamingConfig(memory_budget=budget))
    draft = infer.load(path)
    if args.packages:
        use_packages(draft, [], args.tokens, args.packages)
    chat = args.model == "smollm2"
    prompts = {w: prompt_ids(target, w, chat) for w in ("code", "story")}
    rows: dict[str, dict[str, Any]] = {}
    for w, ids in prompts.items():
        for spec in (None, Speculative(draft=draft, lookup=args.lookup, max_tokens=args.k)):
            before = target.streaming_stats.forwards
            r = run_once(target, ids, args.tokens, spec)
            r["forwards"] = target.streaming_stats.forwards - before
            rows[f"{w}-{'draft' if spec else 'plain'}"] = r
    mib = f"{size / 2**20:.0f} MiB) streamed under {budget / 2**20:.0f} MiB"
    print(f"\n{args.model} float32 GGUF ({mib}, the original GGUF's packed weights resident as its "
          f"draft (+ lookup {args.lookup}), at most {args.k} per pass")  # fmt: skip
    print("| workload | tokens | plain streamed tok/s | with the draft | speed-up | streamed forwards "
          "(plain / draft, prefill included) | tokens per streamed decode pass |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for w in prompts:
        p, s = rows[f"{w}-plain"], rows[f"{w}-draft"]
        n = len(s["tokens"])
        prefill = p["forwards"] - (len(p["tokens"]) - 1)  # the prompt's chunks: the same in both
        per_pass = (n - 1) / max(1, s["forwards"] - prefill)
        print(f"| {w} | {n} | {p['tok_s']:.2f} | {s['tok_s']:.2f} | {s['tok_s'] / p['tok_s']:.2f}x "
              f"| {p['forwards']} / {s['forwards']} | {per_pass:.2f} |")  # fmt: skip
    for r in rows.values():
        del r["tokens"]
    _save(args, {"mode": "streamed", "budget": budget, "rows": rows})


def mode_server(args: argparse.Namespace) -> None:
    path = model_path(args.model)
    llm = infer.load(path)
    chat = args.model == "smollm2"
    prompts = [prompt_ids(llm, w, chat) for w in WORKLOADS] * 4  # 16 streams
    params = [SamplingParams(max_tokens=args.tokens)] * 16
    if args.packages:
        use_packages(llm, [], args.tokens, args.packages)
    runs: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for _ in range(args.reps):
        for on in (False, True):
            llm.speculative = Speculative(lookup=args.lookup, max_tokens=args.k) if on else None
            engine = Engine(llm, max_batch=16)
            t0 = time.perf_counter()
            handles = engine.submit_many(prompts, params, text=True, wait=True)
            for h in handles:
                for _ in h:
                    pass
            seconds = time.perf_counter() - t0
            stats = engine.stats()
            engine.close(drain=False)
            llm.speculative = None
            runs[on].append((stats["generated_tokens"] / seconds, stats.get("spec_steps", 0), stats["steps"]))
    off = statistics.median(r[0] for r in runs[False])
    on_ = statistics.median(r[0] for r in runs[True])
    passes = [f"{r[1]:.0f}/{r[2]:.0f}" for r in runs[True]]
    print(f"\n{args.model}: 16 streams through one engine (max_batch 16), {args.tokens} tokens at most each; "
          f"total tok/s (prefill included): lookup off {off:.1f}, on {on_:.1f} ({on_ / off - 1:+.1%}); "
          f"verify passes / steps with lookup on: {', '.join(passes)}")  # fmt: skip
    _save(args, {"mode": "server", "off": off, "on": on_, "runs": {str(k): v for k, v in runs.items()}})


def _save(args: argparse.Namespace, record: dict[str, Any]) -> None:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    cpu = cpu or platform.processor()
    record["machine"] = {"cpu": cpu, "threads": torch.get_num_threads(), "load": os.getloadavg()}
    print(f"CPU: {cpu}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1, default=str))


def mode_pair(args: argparse.Namespace) -> None:
    """The real draft pair: Qwen2.5-Coder-0.5B-Instruct drafting for the 1.5B (both Q4_K_M, one
    tokenizer; fetched once, `infer.realmodels.fetch`), both at ``infer.load``'s default, through
    their chat template."""
    from infer.realmodels import fetch

    target = infer.load(fetch("qwen-coder-1.5b"))
    draft = infer.load(fetch("qwen-coder-0.5b"))
    if target.tokenizer.encode("def fib(n):") != draft.tokenizer.encode("def fib(n):"):
        raise SystemExit("the 0.5B's tokenizer is not the 1.5B's: no draft pair")
    prompts = {w: prompt_ids(target, w, True) for w in ("code", "story")}
    if args.packages:
        use_packages(draft, list(prompts.values()), args.tokens, args.packages)
        use_packages(target, list(prompts.values()), args.tokens, args.packages)
    spec = Speculative(draft=draft, lookup=args.lookup, max_tokens=args.k)
    if args.packages:  # the target's verify passes too (the draft's own plain steps: above)
        use_packages(target, list(prompts.values()), args.tokens, args.packages, spec)
    results = {w: compare(target, ids, args.tokens, spec, args.reps) for w, ids in prompts.items()}
    print(f"\nQwen2.5-Coder-1.5B Q4_K_M with the 0.5B as its draft (+ lookup {args.lookup}), at most "
          f"{args.k} tokens per pass")  # fmt: skip
    print_compared(results, "plain tok/s", "with the draft")
    record: dict[str, Any] = {"mode": "pair", "model": "qwen-coder-1.5b", "results": results}
    if args.llama_server:  # the peer: llama.cpp's plain decode at the code prompt's depth
        peer = llama_bench_decode(fetch("qwen-coder-1.5b"), len(prompts["code"]), args.tokens)
        if peer is not None:
            code = results["code"]["spec_tok_s"]
            print(f"llama.cpp plain decode (llama-bench -n {args.tokens} -d {len(prompts['code'])}): "
                  f"{peer:.1f} tok/s; the pair on code: {code:.1f} tok/s = {code / peer:.2f}x")  # fmt: skip
            record["llama_cpp_decode"] = peer
    _save(args, record)


def llama_bench_decode(gguf: Path, depth: int, tokens: int) -> float | None:
    """llama.cpp's plain decode tok/s (``llama-bench -n tokens -d depth``), None without the peer."""
    bench = llama_tool("llama-bench")
    if not bench.exists():
        print(f"(no {bench}: build it with ../shared/peers/llamacpp.sh)")
        return None
    threads = str(torch.get_num_threads())
    cmd = [str(bench), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-d", str(depth), "-t", threads,
           "-r", "3", "-o", "json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        out = subprocess.run([*cmd, "--repack", "0"], capture_output=True, text=True, timeout=1800)
    rows = json.loads(out.stdout) if out.returncode == 0 else []
    speeds = [r["avg_ts"] for r in rows if r.get("n_gen")]
    return float(speeds[0]) if speeds else None


MODES = {
    "lookup": mode_lookup, "draft": mode_draft, "streamed": mode_streamed, "server": mode_server,
    "pair": mode_pair,
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("mode", choices=list(MODES))
    parser.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2")
    parser.add_argument("--tokens", type=int, default=192, help="new tokens per request at most")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--lookup", type=int, default=8, help="n-gram lookup size (0: off)")
    parser.add_argument("-k", type=int, default=16, help="tokens proposed per pass at most")
    what = "plain decode from ahead-of-time packages kept in DIR (built there first)"
    parser.add_argument("--packages", default=None, metavar="DIR", help=what)
    parser.add_argument("--no-llama-server", dest="llama_server", action="store_false")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    MODES[args.mode](args)


if __name__ == "__main__":
    main()
