"""Layer streaming benchmark: resident vs streamed vs transformers + accelerate offloading, one checkpoint.

Every configuration runs in its own subprocess (so peak memory is its own) on the same
generated Llama checkpoint: load, prefill a prompt (time to first token), decode
tokens. Reported per configuration: prefill time, time per decoded token, bytes moved
per token and the achieved bandwidth next to the machine's measured copy bandwidth
(NFR-001), the fraction of the load time hidden behind compute (NFR-003), the TTFT
ratio streamed / resident (NFR-004), and peak memory (anonymous memory on CPU,
``torch.cuda.max_memory_allocated`` on CUDA) above the process's fixed overhead.

    python benchmarks/streaming.py                      # CPU, ~600 MB float32 model, budget 1/4
    python benchmarks/streaming.py --big                # CPU, ~4 GB model, budget 1/4
    python benchmarks/streaming.py --device cuda        # GPU, bfloat16, host cache on
    python benchmarks/streaming.py --timeline docs/streaming_timeline.png

Checkpoints are generated once into ``.bench/streaming/`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


# --------------------------------------------------------------------------- child side


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"{field}:\s+(\d+) kB", f.read())
    return int(m.group(1)) * 1024 if m else 0


def _anon_bytes() -> int:
    return _status_bytes("RssAnon")


class PeakSampler:
    """Samples RssAnon every few milliseconds in a thread (CPU) or reads CUDA's peak counter."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = device == "cuda"
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _anon_bytes()
        self.peak = self.base
        self.rss_base = self.rss_peak = _status_bytes("VmRSS")
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        if not self.cuda:
            self.thread.start()

    def _run(self) -> None:
        while self.running:
            self.peak = max(self.peak, _anon_bytes())
            self.rss_peak = max(self.rss_peak, _status_bytes("VmRSS"))
            time.sleep(0.003)

    def stop(self) -> tuple[int, int]:
        """Peak device memory (anonymous memory on CPU) and peak resident set, above the start."""
        import torch

        self.running = False
        if self.cuda:
            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated() - self.base), 0
        self.thread.join()
        rss = max(self.rss_peak, _status_bytes("VmRSS")) - self.rss_base
        return max(self.peak, _anon_bytes()) - self.base, rss


def _warm_up(device: str, config: Any) -> None:
    """Start what every configuration pays once: thread pools, cuBLAS, the meta-device machinery."""
    import dataclasses

    import torch

    from infer.assembly.build import build_empty

    a = torch.randn(256, 256, device=device)
    (a @ a).sum().item()
    tiny = dataclasses.replace(
        config, hidden_size=64, intermediate_size=64, num_hidden_layers=1, vocab_size=16
    )
    build_empty(tiny)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def child(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from infer.loader.config import load_config

    torch.set_num_threads(job["threads"])
    device, path = job["device"], Path(job["path"])
    dtype = getattr(torch, job["dtype"])
    config = load_config(path)
    prompt = torch.tensor([[(7 * i + 3) % config.vocab_size for i in range(job["prompt"])]], device=device)
    if job["kind"] == "accelerate":
        return _child_accelerate(job, path, dtype, prompt)
    _warm_up(device, config)
    sampler = PeakSampler(device)
    t0 = time.perf_counter()
    from infer.assembly.build import ModelBuilder
    from infer.assembly.options import LoadOptions
    from infer.loader.weights import SafetensorsSource

    if job["kind"] == "resident":
        from infer.assembly.build import load_model

        options = LoadOptions(dtype=dtype, device=torch.device(device))
        model: Any = load_model(ModelBuilder(SafetensorsSource(path), config, options))
    else:
        from infer.streaming import StreamingConfig, build_streamed

        streaming = StreamingConfig(
            layer_group_size=job["group"],
            memory_budget=job["budget"],
            prefetch=job["prefetch"],
            host_memory_budget=job.get("host_budget", 0),
            max_context=job["prompt"] + job["new"] + 1,
            max_prefill_tokens=job["prompt"],
            trace=job.get("trace", False),
        )
        options = LoadOptions(device=torch.device(device), dtype=dtype, streaming=streaming)
        model = build_streamed(ModelBuilder(SafetensorsSource(path), config, options))
    _sync(device)
    load_s = time.perf_counter() - t0
    executor = model.executor if hasattr(model.executor, "plan") else None

    def generate(new: int) -> tuple[list[int], float, float, Any]:
        """Greedy prefill + ``new`` decode steps with a fresh cache: tokens, TTFT, seconds per token."""
        out: list[int] = []
        if executor:
            executor.reset_stats()
        with torch.inference_mode():
            cache = model.make_cache(1, job["prompt"] + job["new"] + 1)
            t0 = time.perf_counter()
            h = model.forward_hidden(prompt, cache)
            nxt = model.head(h[:, -1:])[:, -1].argmax(-1)  # [1]
            out.append(int(nxt.item()))
            ttft = time.perf_counter() - t0
            prefill = executor.stats if executor else None
            if executor:
                executor.reset_stats()
            t0 = time.perf_counter()
            for _ in range(new):
                h = model.forward_hidden(nxt[:, None], cache)
                nxt = model.head(h)[:, -1].argmax(-1)
                out.append(int(nxt.item()))
            return out, ttft, (time.perf_counter() - t0) / max(new, 1), prefill

    # The first request pays one-time costs (CUDA kernels loading lazily, the host cache filling):
    # reported as the cold TTFT; the timed request is the second one.
    _, cold_ttft, _, _ = generate(4)
    tokens, ttft, per_token, prefill_stats = generate(job["new"])
    peak, rss = sampler.stop()
    result: dict[str, Any] = {
        "load_s": load_s,
        "ttft_s": ttft,
        "cold_ttft_s": cold_ttft,
        "decode_s_per_token": per_token,
        "peak_bytes": peak,
        "rss_bytes": rss,
        "tokens": tokens,
    }
    if executor:
        s = executor.stats
        plan = executor.plan
        result.update(
            plan=plan.describe(),
            planned_bytes=plan.total,
            resident_layers=len(plan.resident_layers),
            bytes_per_token=s.bytes_loaded / job["new"],
            read_per_token=s.bytes_read / job["new"],
            load_s_per_token=s.load_seconds / job["new"],
            wait_s_per_token=s.wait_seconds / job["new"],
            compute_s_per_token=s.compute_seconds / job["new"],
            hidden_fraction=s.hidden_fraction,
            prefill_bytes=prefill_stats.bytes_loaded if prefill_stats else 0,
            prefill_wait_s=prefill_stats.wait_seconds if prefill_stats else 0.0,
            timeline=[[e.lane, e.unit, e.label, e.start, e.end] for e in s.timeline],
        )
    return result


def _child_accelerate(job: dict[str, Any], path: Path, dtype: Any, prompt: Any) -> dict[str, Any]:
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    device = job["device"]
    a = torch.randn(256, 256, device=device)
    (a @ a).sum().item()
    sampler = PeakSampler(device)
    max_memory: dict[Any, Any] = (
        {"cpu": job["budget"]} if device == "cpu" else {0: job["budget"], "cpu": "200GB"}
    )
    with tempfile.TemporaryDirectory(dir=ROOT / ".bench") as offload:
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(
            str(path), device_map="auto", max_memory=max_memory, offload_folder=offload, dtype=dtype
        )
        _sync(device)
        load_s = time.perf_counter() - t0
        placement: dict[str, int] = {}
        for where in cast(dict[str, object], model.hf_device_map).values():
            placement[str(where)] = placement.get(str(where), 0) + 1
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(prompt, max_new_tokens=1, do_sample=False, min_new_tokens=1)  # type: ignore[misc]  # cold, like ours
            _sync(device)
            cold_ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            first = model.generate(prompt, max_new_tokens=1, do_sample=False, min_new_tokens=1)  # type: ignore[misc]
            _sync(device)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(  # type: ignore[misc]
                prompt, max_new_tokens=job["new"] + 1, do_sample=False, min_new_tokens=job["new"] + 1
            )
            _sync(device)
            total = time.perf_counter() - t0
    peak, rss = sampler.stop()
    return {
        "load_s": load_s,
        "ttft_s": ttft,
        "cold_ttft_s": cold_ttft,
        "decode_s_per_token": max(0.0, total - ttft) / job["new"],
        "peak_bytes": peak,
        "rss_bytes": rss,
        "tokens": [int(first[0, -1]), *out[0, prompt.shape[1] + 1 :].tolist()],
        "placement": placement,
    }


# --------------------------------------------------------------------------- parent side


def copy_bandwidth(device: str, path: Path) -> dict[str, float]:
    """GB/s of the copies streaming makes (best of 5): checkpoint -> host buffer; pinned host -> device."""
    import os

    import torch

    from infer.loader.source import pread_into

    file = path / "model.safetensors"
    fd = os.open(file, os.O_RDONLY)
    n = min(256 * 2**20, file.stat().st_size)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=device == "cuda")

    def read() -> None:
        pread_into(fd, host, 0, str(file))

    read()  # the file is in the page cache, as it is for a streamed model after a token

    def best(fn: Callable[[], None], repeats: int = 5) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return n / min(times) / 1e9

    result = {"file_to_host_GBps": best(read)}
    if device == "cuda":
        gpu = torch.empty(n, dtype=torch.uint8, device="cuda")

        def h2d() -> None:
            gpu.copy_(host, non_blocking=True)
            torch.cuda.synchronize()

        h2d()
        result["host_to_device_GBps"] = best(h2d)
    os.close(fd)
    return result


def run_child(job: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP workers distort timings on shared cores
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(job)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        refused = [line for line in lines if "BudgetError" in line]
        if refused:
            what = refused[-1].split(": ", 2)[-1].split(" is too small")[0]
            need = next((line.strip(" -") for line in lines if "a memory_budget of at least" in line), "")
            return {"error": f"refused at load: {what} is too small; {need}"}
        return {"error": lines[-1] if lines else f"exit {proc.returncode}"}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def first_steps(entries: list[list[Any]], steps: int) -> list[list[Any]]:
    """The entries of the first ``steps`` forwards (a forward starts when unit 0 starts computing)."""
    starts = sorted(e[3] for e in entries if e[0] == "compute" and e[1] == 0)
    if len(starts) <= steps:
        return entries
    end = starts[steps]
    return [e for e in entries if e[3] < end]


def plot_timeline(result: dict[str, Any], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = result["timeline"]
    if not entries:
        return
    lanes = [lane for lane in ("read", "copy", "compute") if any(e[0] == lane for e in entries)]
    t0 = min(e[3] for e in entries)
    t1 = max(e[4] for e in entries)
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.7 * len(lanes)))
    cmap = plt.get_cmap("tab20")
    for row, lane in enumerate(lanes):
        for kind, unit, _label, start, end in entries:
            if kind != lane:
                continue
            ax.broken_barh(
                [((start - t0) * 1e3, (end - start) * 1e3)], (row - 0.35, 0.7), color=cmap(unit % 20)
            )
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) * 1e3)
    ax.set_xlabel("ms (colour = layer group / head chunk)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--size", default=None, help="checkpoint size (default 600MB, 4GB with --big)")
    parser.add_argument("--big", action="store_true", help="a checkpoint of several GB")
    parser.add_argument("--budget", default=None, help="memory budget (default: a quarter of the checkpoint)")
    parser.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    parser.add_argument(
        "--hidden", type=int, default=None, help="hidden size (512 CPU, 1024 --big, 2048 CUDA)"
    )
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--groups", default="1,4", help="layer group sizes to stream with")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--host-budget", default=None, help="pinned host cache (CUDA; default: the whole model)"
    )
    parser.add_argument("--no-resident", action="store_true")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers + accelerate")
    parser.add_argument(
        "--timeline", type=Path, default=None, help="write a PNG timeline of one streamed run"
    )
    parser.add_argument("--timeline-steps", type=int, default=3, help="decode steps shown in the timeline")
    parser.add_argument("--out", type=Path, default=None, help="write all results as JSON")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    import torch

    from infer.streaming import parse_bytes
    from infer.testing.synthetic import spec_for_size, write_synthetic_checkpoint

    dtype_name = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    dtype = getattr(torch, dtype_name)
    size = parse_bytes(
        args.size or ("4GB" if args.big else "2GB" if args.device == "cuda" else "600MB"), "--size"
    )
    hidden = args.hidden or (1024 if args.device == "cuda" or args.big else 512)
    spec = spec_for_size(size, dtype, hidden_size=hidden)
    path = ROOT / ".bench" / "streaming" / f"llama-{spec.num_hidden_layers}x{spec.hidden_size}-{dtype_name}"
    if not (path / "config.json").exists():
        print(f"writing {path} ...", file=sys.stderr)
        write_synthetic_checkpoint(path, spec, dtype=dtype)
    model_bytes = spec.nbytes(dtype)
    budget = parse_bytes(args.budget, "--budget") if args.budget else model_bytes // 4
    threads = args.threads or torch.get_num_threads()
    bandwidth = copy_bandwidth(args.device, path)
    base: dict[str, Any] = dict(
        device=args.device,
        path=str(path),
        dtype=dtype_name,
        prompt=args.prompt,
        new=args.new,
        threads=threads,
    )
    host_budget = parse_bytes(args.host_budget, "--host-budget") if args.host_budget else model_bytes
    jobs: list[tuple[str, dict[str, Any]]] = []
    if not args.no_resident:
        jobs.append(("resident", dict(base, kind="resident")))
    groups = [int(g) for g in args.groups.split(",")]
    for group in groups:
        for prefetch in (True, False):
            job = dict(base, kind="streamed", group=group, prefetch=prefetch, budget=budget)
            if args.device == "cuda":
                job["host_budget"] = host_budget
            job["trace"] = prefetch
            jobs.append((f"streamed g={group} {'prefetch' if prefetch else 'sync'}", job))
    if args.device == "cuda":
        jobs.append(
            (f"streamed g={groups[-1]} prefetch, no host cache", dict(jobs[-2][1], host_budget=0, trace=True))
        )
    if not args.no_peer:
        jobs.append(("transformers + accelerate", dict(base, kind="accelerate", budget=budget)))

    results: dict[str, dict[str, Any]] = {}
    for name, job in jobs:
        print(f"running {name} ...", file=sys.stderr)
        results[name] = run_child(job)
    resident = results.get("resident", {})
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    bw_key = "host_to_device_GBps" if args.device == "cuda" else "file_to_host_GBps"
    lines = [
        f"Checkpoint: synthetic Llama, {spec.num_hidden_layers} layers x {spec.hidden_size} hidden, "
        f"vocab {spec.vocab_size}, {fmt_bytes(model_bytes)} {dtype_name}; budget {fmt_bytes(budget)} "
        f"({model_bytes / budget:.1f}x smaller); prompt {args.prompt} tokens, {args.new} decoded tokens.",
        f"Machine: {args.device} ({device_name}), {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{threads} intra-op thread(s). Measured copy bandwidth: "
        + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bandwidth.items())
        + ".",
        "",
        "| configuration | cold TTFT (s) | TTFT (s) | TTFT / resident | s / token | MB moved / token "
        "| achieved GB/s (% of copy bw) | load hidden | overlap | peak memory | peak RSS "
        "| tokens = resident |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} ||||||||||")
            continue
        ratio = r["ttft_s"] / resident["ttft_s"] if resident.get("ttft_s") else float("nan")
        moved = r.get("bytes_per_token")
        if moved:
            achieved = moved / r["load_s_per_token"] / 1e9 if r["load_s_per_token"] else float("nan")
            bw = f"{achieved:.2f} ({100 * achieved / bandwidth[bw_key]:.0f}%)"
            hidden = f"{100 * r['hidden_fraction']:.0f}%"
            load, wait, compute = r["load_s_per_token"], r["wait_s_per_token"], r["compute_s_per_token"]
            hideable = min(load, compute)
            overlap = f"{100 * max(0.0, min(1.0, (load - wait) / hideable)):.0f}%" if hideable > 0 else "-"
            moved_s = f"{moved / 1e6:.0f}"
        else:
            bw = hidden = overlap = moved_s = "-"
        rss = fmt_bytes(r["rss_bytes"]) if args.device == "cpu" else "-"
        same = "yes" if resident.get("tokens") == r["tokens"] else ("-" if not resident else "no")
        lines.append(
            f"| {name} | {r['cold_ttft_s']:.3f} | {r['ttft_s']:.3f} | {ratio:.2f}x | "
            f"{r['decode_s_per_token']:.3f} | {moved_s} | "
            f"{bw} | {hidden} | {overlap} | {fmt_bytes(r['peak_bytes'])} | {rss} | {same} |"
        )
    lines.append("")
    for name, r in results.items():
        if "plan" in r:
            lines.append(f"- {name}: {r['plan']}")
        if "placement" in r:
            lines.append(f"- {name}: device map {r['placement']}")
    print("\n".join(lines))
    if args.timeline:
        traced = [(n, r) for n, r in results.items() if r.get("timeline")]
        for name, r in traced[-1:]:
            decode = first_steps(r["timeline"], args.timeline_steps)
            title = (
                f"{name}: {min(args.new, args.timeline_steps)} decode steps, {args.device}, "
                f"{fmt_bytes(model_bytes)} model, "
                f"budget {fmt_bytes(budget)}"
            )
            plot_timeline({"timeline": decode}, args.timeline, title)
            print(f"\ntimeline of '{name}' written to {args.timeline}", file=sys.stderr)
    if args.out:
        for r in results.values():
            r.pop("timeline", None)
        args.out.write_text(
            json.dumps({"bandwidth": bandwidth, "results": results, "summary": lines}, indent=1)
        )


if __name__ == "__main__":
    main()
