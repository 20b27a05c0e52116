"""`infer serve` against llama.cpp's `llama-server`: concurrent streaming clients over loopback.

    uv run python benchmarks/serving.py                                  # both real models, 1/4/16 streams
    uv run python benchmarks/serving.py --models smollm2 --levels 1,16 --per-client 1 --chart ""

For SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M (`infer.realmodels`) each server runs in
its own process, started here on a free 127.0.0.1 port:

* ``infer serve MODEL --max-batch 16`` (the default mode: it queues its compiled steps' packages
  at start, and the script waits for them after the warm-up request, ``--build-timeout``, so the
  levels measure what a server gives minutes after it starts; ``OMP_NUM_THREADS=--threads``), and
  ``infer-det``: the same with ``--deterministic`` (eager fixed-tile steps, bitwise same answers);
* ``llama-server -m MODEL --parallel 16 -c 16*--ctx-per-slot -t --threads`` (built by
  ``../shared/peers/llamacpp.sh``; ``--llama-server`` or ``$LLAMA_SERVER`` names the binary). Its
  repacked weights segfault on some CPUs: if it does not come up, it is started again with
  ``--no-repack`` and the JSON (``repack``) and the table say so.

Per level (1, 4, 16 concurrent clients; each client sends ``--per-client`` requests one after the
other, ``--max-tokens`` greedy tokens each with ``ignore_eos`` so every request has the same length,
``temperature 0``, streamed from ``/v1/completions``): total output tokens/s (completion tokens of
the level / its wall time), time to first token p50/p95 (request sent to first token received),
inter-token latency p50/p95 (between consecutive token chunks of one stream), and the server
process's peak RSS (sampled every 20 ms by a thread, the whole run). One warm-up request first.

Prefix caching, measured the same way on both servers with ``/v1/completions`` text prompts: a
first turn of ~``--long-prompt`` tokens (its time to first token: the cold prefill), its 16-token
reply, then the second turn (first turn + reply + a new question) on the same server: "with" is
its time to first token (the median of three second turns with different questions). "without"
is the same second-turn prompt with a different first line (so no cached prefix applies): a cold
prefill of the same length. llama-server's second turn is also sent with ``cache_prompt: false``
(its own switch), reported beside it.

Prints a Markdown table with ratios infer / llama-server and the machine; writes ``--json`` and a
chart (``--chart``, matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil  # type: ignore[import-untyped]
from llama_bin import llama_tool

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "smollm2": "SmolLM2-135M Q4_1",
    "gemma3": "Gemma 3 270M Q4_K_M",
    "qwen-coder-1.5b": "Qwen2.5-Coder-1.5B Q4_K_M",  # on request (--models): fetched once, 1.1 GB
}
TOPICS = [
    "a lighthouse keeper",
    "a lost umbrella",
    "the first snow",
    "a robot gardener",
    "a train at night",
    "an old map",
    "a quiet library",
    "a mountain village",
    "a paper boat",
    "a clockmaker",
    "a desert well",
    "a city of bridges",
    "a forgotten song",
    "a winter market",
    "a sleeping volcano",
    "a talking parrot",
    "a broken violin",
    "a summer storm",
    "a glass garden",
    "the last bus",
]


def model_path(model: str) -> Path:
    import infer.realmodels as rm

    if model in rm.SPLIT_MODELS:
        return rm.fetch(model)
    return Path(rm.smollm2_path() if model == "smollm2" else rm.gemma3_270m_path())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``xs``, linear interpolation; nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def matmul_gflops(threads: int, seconds: float = 2.0) -> float:
    """float32 GFLOP/s of a 1024^3 matrix product on ``threads`` threads: the compute ceiling the
    table's 16-stream figures are set against (a token of a model of P parameters costs ~2P FLOPs)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        a @ b
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            n += 1
        return 2 * 1024**3 * n / (time.perf_counter() - t0) / 1e9
    finally:
        torch.set_num_threads(old)


class RssSampler:
    """Peak RSS of a process and its children, sampled every ``interval`` s in a thread."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.proc = psutil.Process(pid)
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def current(self) -> int:
        try:
            procs = [self.proc, *self.proc.children(recursive=True)]
            return sum(p.memory_info().rss for p in procs)
        except psutil.Error:
            return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@dataclass
class Server:
    name: str  # "infer", "infer-det" (--deterministic) or "llama-server"
    proc: subprocess.Popen[bytes]
    url: str
    rss: RssSampler
    log: Path
    notes: list[str] = field(default_factory=list)

    def stop(self) -> int:
        peak = self.rss.stop()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return peak


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return False


def start_server(kind: str, path: Path, args: argparse.Namespace, log_dir: Path) -> Server:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    attempts: list[tuple[list[str], list[str]]]
    if kind in ("infer", "infer-det"):
        base = [
            sys.executable,
            "-m",
            "infer",
            "serve",
            str(path),
            "--max-batch",
            str(args.parallel),
            "--quiet",
            *(["--deterministic"] if kind == "infer-det" else []),
        ]
        attempts = [(base, [])]
    else:
        base = [
            str(args.llama_server), "-m", str(path), "--parallel", str(args.parallel),
            "-c", str(args.parallel * args.ctx_per_slot), "-t", str(args.threads), "-tb", str(args.threads),
        ]  # fmt: skip
        attempts = [
            (base, []),
            ([*base, "--no-repack"], ["started with --no-repack (repacked weights crashed)"]),
        ]
    for cmd, notes in attempts:
        port = free_port()
        log = log_dir / f"{kind}-{path.stem}-{port}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=fh, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        if wait_ready(proc, url, args.start_timeout):
            return Server(kind, proc, url, RssSampler(proc.pid), log, notes)
        proc.kill()
        proc.wait()
        print(
            f"{kind} did not start (exit {proc.returncode}); log {log}:\n{log.read_text()[-2000:]}",
            file=sys.stderr,
        )
    raise SystemExit(f"{kind} on {path} did not start: see the logs in {log_dir}")


@dataclass
class Stream:
    ttft: float  # seconds, request sent to first token
    gaps: list[float]  # seconds between consecutive token chunks
    tokens: int
    prompt_tokens: int
    text: str


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Stream:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first: float | None = None
    last = t0
    gaps: list[float] = []
    chunks = 0
    usage: dict[str, int] = {}
    text: list[str] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread()).decode()[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data.strip() == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{url}: error event {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                piece = choice.get("text") or ""
                if piece or choice.get("token_ids"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    chunks += 1
                    text.append(piece)
    if first is None:
        raise RuntimeError(f"{url}: a stream ended without a token")
    return Stream(
        first - t0,
        gaps,
        int(usage.get("completion_tokens", chunks)),
        int(usage.get("prompt_tokens", -1)),
        "".join(text),
    )


def request_body(i: int, args: argparse.Namespace) -> dict[str, Any]:
    topic = TOPICS[i % len(TOPICS)]
    return {
        "prompt": f"Request {i}. Write a short story about {topic}, in the style of a fairy tale.",
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


async def run_level(url: str, clients: int, args: argparse.Namespace, offset: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:

        async def one_client(c: int) -> list[Stream]:
            out = []
            for r in range(args.per_client):
                out.append(
                    await stream_completion(client, url, request_body(offset + c * args.per_client + r, args))
                )
            return out

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_client(c) for c in range(clients)))
        wall = time.perf_counter() - t0
    streams = [s for per in results for s in per]
    ttft = [s.ttft for s in streams]
    gaps = [g for s in streams for g in s.gaps]
    tokens = sum(s.tokens for s in streams)
    short = [s.tokens for s in streams if s.tokens != args.max_tokens]
    return {
        "clients": clients,
        "requests": len(streams),
        "tokens": tokens,
        "short_streams": short,  # completion lengths that were not --max-tokens (should be none)
        "wall_s": wall,
        "tok_s": tokens / wall,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p95": pct(ttft, 0.95),
        "itl_p50": pct(gaps, 0.5),
        "itl_p95": pct(gaps, 0.95),
        "itl_max": max(gaps) if gaps else float("nan"),
    }


def long_text(tokens: int) -> str:
    """About ``tokens`` tokens of varied English lines (the servers report the real count)."""
    words = [
        "river", "stone", "lantern", "market", "winter", "garden", "copper", "window", "harbor", "meadow",
        "silver", "thunder", "orchard", "candle", "valley", "compass", "feather", "bridge", "forest",
        "mirror",
    ]  # fmt: skip
    lines = []
    n = 0
    i = 0
    while n < tokens * 0.57:  # SmolLM2's tokenizer: ~1.27 tokens a word of these lines
        a, b, c = words[i % 20], words[(i * 7 + 3) % 20], words[(i * 13 + 5) % 20]
        line = f"Note {i}: the {a} near the {b} was {c}-coloured on day {i * 3 % 31 + 1}."
        lines.append(line)
        n += len(line.split())
        i += 1
    return "\n".join(lines)


async def prefix_test(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    url = server.url
    history = long_text(args.long_prompt)
    turn1 = f"Session A.\n{history}\n\nQuestion: what was the colour of the first lantern?\nAnswer:"
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        base = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
        first = await stream_completion(client, url, {**base, "prompt": turn1})
        turn2 = f"{turn1}{first.text}\n\nQuestion: and the colour of the last mirror?\nAnswer:"
        with_cache = await stream_completion(client, url, {**base, "prompt": turn2})
        with_ttfts = [with_cache.ttft]
        for other in ("first river", "last garden"):  # other second turns after the same first turn
            again = f"{turn1}{first.text}\n\nQuestion: and the colour of the {other}?\nAnswer:"
            with_ttfts.append((await stream_completion(client, url, {**base, "prompt": again})).ttft)
        cold = await stream_completion(
            client, url, {**base, "prompt": "Session B." + turn2[len("Session A.") :]}
        )
        out: dict[str, Any] = {
            "turn1_prompt_tokens": first.prompt_tokens,
            "turn2_prompt_tokens": with_cache.prompt_tokens,
            "turn1_ttft": first.ttft,
            "turn2_ttft_with_each": with_ttfts,
            "turn2_ttft_with": sorted(with_ttfts)[1],  # the median of 3
            "turn2_ttft_without": cold.ttft,
            "ratio": sorted(with_ttfts)[1] / cold.ttft,
        }
        if server.name == "llama-server":
            off = await stream_completion(client, url, {**base, "prompt": turn2, "cache_prompt": False})
            out["turn2_ttft_cache_prompt_false"] = off.ttft
    return out


async def shared_test(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    """16 clients at once (``--levels``' largest), each a ~``--shared-prompt``-token system prompt
    and a question of its own: one system prompt for all ("shared"), then one each ("distinct",
    different from their first line on, so no prefix applies). Time to first token, tok/s, and
    (infer) the KV bytes the engine holds after the shared run (`/metrics`)."""
    clients = max(args.levels)
    system = long_text(args.shared_prompt)
    out: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        for variant in ("shared", "distinct"):

            def prompt(c: int, variant: str = variant) -> str:
                head = "System." if variant == "shared" else f"System {c}."
                return (
                    f"{head}\n{system}\n\nQuestion {c}: which {TOPICS[c % len(TOPICS)]} came first?\nAnswer:"
                )

            body = {"max_tokens": args.shared_tokens, "temperature": 0, "ignore_eos": True}
            t0 = time.perf_counter()
            streams = await asyncio.gather(
                *(
                    stream_completion(client, server.url, {**body, "prompt": prompt(c)})
                    for c in range(clients)
                )
            )
            wall = time.perf_counter() - t0
            ttft = [st.ttft for st in streams]
            out[variant] = {
                "prompt_tokens": [st.prompt_tokens for st in streams],
                "ttft_p50": pct(ttft, 0.5),
                "ttft_p95": pct(ttft, 0.95),
                "tok_s": sum(st.tokens for st in streams) / wall,
                "wall_s": wall,
            }
            if variant == "shared" and server.name.startswith("infer"):
                metrics = (await client.get(server.url + "/metrics")).text
                for line in metrics.splitlines():
                    if line.startswith("infer_engine_kv_bytes "):
                        out["shared"]["kv_bytes"] = float(line.split()[1])
                # what the workload holds: one copy of the common prefix, and each stream's rest
                prompts = out["shared"]["prompt_tokens"]
                common = min(prompts) - 30  # the question and "Answer:" are the streams' own (~30)
                held = common + sum(n - common + args.shared_tokens for n in prompts)
                out["shared"]["held_tokens"] = held
    out["ttft_p95_ratio"] = out["shared"]["ttft_p95"] / out["distinct"]["ttft_p95"]
    return out


def kv_bytes_per_token(path: Path, f16: bool) -> int:
    """K/V bytes per token of every layer (f16: llama-server's default; else infer's float32 default)."""
    import infer

    c = infer.load(path, compile=False).config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.computed_head_dim * (2 if f16 else 4)


def wait_for_builds(timeout: float) -> float:
    """Seconds until the package cache's builder has nothing left to build (`infer.aot.building`):
    the compiled steps `infer serve` queued at start (`infer.serve.server.prepare_packages`) and
    on its warm-up; the machine is otherwise idle meanwhile. nan if they were not done by then."""
    import infer.aot as aot

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not aot.building():
            return time.monotonic() - t0
        time.sleep(1.0)
    return float("nan")


async def bench_server(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:  # warm-up
        await stream_completion(client, server.url, {**request_body(10_000, args), "max_tokens": 8})
    built = float("nan")
    if server.name.startswith("infer") and args.build_timeout > 0:
        built = wait_for_builds(args.build_timeout)
        print(f"  infer: its compiled steps were built {built:.0f} s after the warm-up", file=sys.stderr)
        server.rss.peak = 0  # the peak of serving, not of the background build (a child process)
    levels = []
    for k, clients in enumerate(args.levels):
        level = await run_level(server.url, clients, args, offset=1000 * (k + 1))
        print(
            f"  {server.name} {clients:>2} streams: {level['tok_s']:.1f} tok/s,"
            f" TTFT p95 {level['ttft_p95']:.2f} s, ITL p50 {level['itl_p50'] * 1000:.0f} ms",
            file=sys.stderr,
            flush=True,
        )
        levels.append(level)
    prefix = await prefix_test(server, args) if args.long_prompt > 0 else {}
    if prefix:
        print(f"  {server.name} prefix: {prefix}", file=sys.stderr, flush=True)
    shared = await shared_test(server, args) if args.shared_prompt > 0 else {}
    if shared:
        print(f"  {server.name} shared prefix: {shared}", file=sys.stderr, flush=True)
    return {"levels": levels, "prefix": prefix, "shared": shared, "build_wait_s": built}


def run_model(model: str, args: argparse.Namespace, log_dir: Path, results: dict[str, Any]) -> dict[str, Any]:
    """Both servers on ``model``; ``results`` (with this model's part so far) goes to ``--json``
    after each server, so a run cut short keeps what it measured."""
    path = model_path(model)
    out: dict[str, Any] = {"path": str(path)}
    results["models"][model] = out
    for kind in args.servers:  # llama-server's f16 KV; infer's default (the activations' float32)
        out[f"kv_bytes_per_token_{kind}"] = kv_bytes_per_token(path, f16=kind == "llama-server")
    for kind in args.servers:
        print(f"{MODELS[model]}: {kind}", file=sys.stderr, flush=True)
        server = start_server(kind, path, args, log_dir)
        try:
            result = asyncio.run(bench_server(server, args))
        finally:
            result_rss = server.stop()
        result["peak_rss"] = result_rss
        result["notes"] = server.notes
        out[kind] = result
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return out


def fmt(x: float, unit: str = "") -> str:
    return "n/a" if x != x else f"{x:.2f}{unit}"


def ratio(a: float, b: float) -> str:
    return "n/a" if not (a == a and b == b and b) else f"{a / b:.2f}x"


def table(results: dict[str, Any], args: argparse.Namespace) -> str:
    servers = args.servers
    peer = "llama-server" if "llama-server" in servers else None
    ours = [k for k in servers if k != "llama-server"]
    head = "| model | streams | " + " | ".join(f"{k} tok/s" for k in servers)
    head += (
        "".join(f" | {k} / llama" for k in ours if peer)
        + " | "
        + " | ".join(f"{k} TTFT p50 / p95 (s) | {k} ITL p50 / p95 (ms)" for k in servers)
        + " |"
    )
    ncol = 2 + len(servers) + (len(ours) if peer else 0) + 2 * len(servers)
    rows = [head, "|" + "---|" * ncol]
    for model, res in results["models"].items():
        for i, clients in enumerate(args.levels):
            lv = {k: res[k]["levels"][i] for k in servers if k in res}

            def g(k: str, key: str, lv: dict[str, Any] = lv) -> float:
                return float(lv[k][key]) if k in lv else float("nan")

            cells = [MODELS[model], str(clients)] + [fmt(g(k, "tok_s")) for k in servers]
            if peer:
                cells += [ratio(g(k, "tok_s"), g(peer, "tok_s")) for k in ours]
            for k in servers:
                cells.append(f"{fmt(g(k, 'ttft_p50'))} / {fmt(g(k, 'ttft_p95'))}")
                cells.append(f"{g(k, 'itl_p50') * 1e3:.0f} / {g(k, 'itl_p95') * 1e3:.0f}")
            rows.append("| " + " | ".join(cells) + " |")
    rows += [
        "",
        f"| model | server | {args.levels[-1]}/{args.levels[0]}-stream tok/s | peak RSS (MiB) "
        "| turn-1 prompt tokens "
        "| cold prefill TTFT (s) | 2nd turn TTFT without cache (s) | with prefix cache (s) "
        "| with / without |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, res in results["models"].items():
        for kind in servers:
            r = res[kind]
            lv = r["levels"]
            scale = ratio(lv[-1]["tok_s"], lv[0]["tok_s"]) if len(lv) > 1 else "n/a"
            p = r["prefix"]
            without = fmt(p.get("turn2_ttft_without", float("nan")))
            if "turn2_ttft_cache_prompt_false" in p:
                without += f" ({fmt(p['turn2_ttft_cache_prompt_false'])} with `cache_prompt: false`)"
            note = f" ({'; '.join(r['notes'])})" if r["notes"] else ""
            rows.append(
                f"| {MODELS[model]} | {kind}{note} | {scale} | {r['peak_rss'] / 2**20:.0f} "
                f"| {p.get('turn1_prompt_tokens', 'n/a')} | {fmt(p.get('turn1_ttft', float('nan')))} "
                f"| {without} "
                f"| {fmt(p.get('turn2_ttft_with', float('nan')))} "
                f"| {fmt(100 * p['ratio'], '%') if 'ratio' in p else 'n/a'} |"
            )
    if args.shared_prompt > 0:
        rows += [
            "",
            "| model | server | shared prompt: TTFT p50 / p95 (s), tok/s | distinct prompts: TTFT p50 / p95 "
            "(s), tok/s | TTFT p95 shared / distinct | KV bytes after the shared run | per token | "
            "tokens held | KV / (one prefix + the rest) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for model, res in results["models"].items():
            per_token = {k: res.get(f"kv_bytes_per_token_{k}") for k in servers}
            for kind in servers:
                sh = res[kind].get("shared") or {}
                if not sh:
                    continue
                a, b = sh["shared"], sh["distinct"]
                kv = a.get("kv_bytes")
                bpt = per_token.get(kind) or 0
                held = a.get("held_tokens")
                kv_txt = (
                    f"{kv / 2**20:.0f} MiB"
                    if kv
                    else (
                        f"{bpt * args.parallel * args.ctx_per_slot / 2**20:.0f} MiB allocated"
                        if bpt
                        else "n/a"
                    )
                )
                share = f"{kv / (bpt * held):.2f}x" if kv and held and bpt else "n/a"
                rows.append(
                    f"| {MODELS[model]} | {kind} | {fmt(a['ttft_p50'])} / {fmt(a['ttft_p95'])}, "
                    f"{a['tok_s']:.1f} | {fmt(b['ttft_p50'])} / {fmt(b['ttft_p95'])}, {b['tok_s']:.1f} "
                    f"| {ratio(a['ttft_p95'], b['ttft_p95'])} | {kv_txt} | {bpt} | {held or 'n/a'} "
                    f"| {share} |"
                )
    return "\n".join(rows)


def chart(results: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart", file=sys.stderr)
        return
    models = list(results["models"])
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 7), squeeze=False)
    for j, model in enumerate(models):
        res = results["models"][model]
        for row, (key, label) in enumerate([("tok_s", "total output tok/s"), ("ttft_p95", "TTFT p95 (s)")]):
            ax = axes[row][j]
            width = 0.8 / len(args.servers)
            for s, kind in enumerate(args.servers):
                vals = [lv[key] for lv in res[kind]["levels"]]
                xs = [i + (s - (len(args.servers) - 1) / 2) * width for i in range(len(vals))]
                bars = ax.bar(xs, vals, width, label=kind)
                ax.bar_label(bars, fmt="%.1f" if key == "tok_s" else "%.2f", fontsize=7)
            ax.set_xticks(range(len(args.levels)), [str(c) for c in args.levels])
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel(label)
            ax.set_title(f"{MODELS[model]}: {label}", fontsize=9)
            ax.legend(fontsize=8)
    fig.suptitle(
        f"infer serve vs llama-server, {args.max_tokens} greedy tokens per request, {results['cpu']}, "
        f"{args.threads} threads",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"chart: {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,gemma3", help="comma-separated: " + ", ".join(MODELS))
    p.add_argument(
        "--servers",
        default="infer,infer-det,llama-server",
        help="comma-separated: infer (the default mode), infer-det (--deterministic), llama-server",
    )
    p.add_argument("--levels", default="1,4,16", help="concurrent streaming clients, comma-separated")
    p.add_argument("--per-client", type=int, default=2, help="requests each client sends, one after another")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per request (ignore_eos)")
    p.add_argument("--parallel", type=int, default=16, help="infer --max-batch / llama-server --parallel")
    p.add_argument("--ctx-per-slot", type=int, default=4096, help="llama-server context per slot")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t and infer's OMP_NUM_THREADS")
    p.add_argument(
        "--long-prompt", type=int, default=2000, help="first-turn tokens of the prefix test (0: skip)"
    )
    p.add_argument(
        "--shared-prompt",
        type=int,
        default=2000,
        help="system-prompt tokens of the shared-prefix test (0: skip)",
    )
    p.add_argument("--shared-tokens", type=int, default=32, help="greedy tokens per request of that test")
    p.add_argument("--llama-server", type=Path, default=None)
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server gets to come up")
    p.add_argument(
        "--build-timeout",
        type=float,
        default=1800.0,
        help="seconds to wait after infer's warm-up for the compiled steps it queued (0: measure it cold)",
    )
    p.add_argument("--json", type=Path, default=ROOT / ".bench" / "serve.json")
    p.add_argument("--chart", default=str(ROOT / "docs" / "serving_bench.png"), help="PNG path ('' for none)")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.servers = [s for s in args.servers.split(",") if s]
    args.levels = [int(c) for c in args.levels.split(",")]
    for m in args.models:
        if m not in MODELS:
            p.error(f"--models: {m!r} is not one of {', '.join(MODELS)}")
    for s in args.servers:
        if s not in ("infer", "infer-det", "llama-server"):
            p.error(f"--servers: {s!r} is not one of infer, infer-det, llama-server")
    if args.llama_server is None:
        args.llama_server = Path(os.environ.get("LLAMA_SERVER") or llama_tool("llama-server"))
    if "llama-server" in args.servers and not args.llama_server.is_file():
        p.error(
            f"--llama-server: {args.llama_server} does not exist (build it with ../shared/peers/llamacpp.sh)"
        )
    log_dir = ROOT / ".bench" / "serve-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "cpu": cpu_name(),
        "load_average_before": os.getloadavg(),
        "matmul_gflops": matmul_gflops(args.threads),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "models": {},
    }
    t0 = time.perf_counter()
    for model in args.models:
        run_model(model, args, log_dir, results)
    results["load_average_after"] = os.getloadavg()
    results["seconds"] = time.perf_counter() - t0
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(table(results, args))
    print(
        f"\nMachine: {results['cpu']}, {os.cpu_count()} logical CPUs, {args.threads} threads per server; "
        f"load average {results['load_average_before'][0]:.2f} before, "
        f"{results['load_average_after'][0]:.2f} after; "
        f"{results['seconds']:.0f} s; a float32 1024^3 matmul on {args.threads} threads: "
        f"{results['matmul_gflops']:.0f} GFLOP/s. JSON: {args.json}"
    )
    if args.chart:
        chart(results, args, Path(args.chart))
    short = [
        (m, k, lv["clients"], lv["short_streams"])
        for m, r in results["models"].items()
        for k in args.servers
        for lv in r[k]["levels"]
        if lv["short_streams"]
    ]
    if short:
        print(
            f"warning: streams shorter than --max-tokens (model, server, level, lengths): {short}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
