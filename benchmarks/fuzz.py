"""Feed mutated checkpoints to the public entry points; count what happens.

Each input is derived from ``(--seed, index)`` by `infer.testing.fuzzing` (structured mutations
of a tiny GGUF file, a safetensors header, an index json and config.json) and run by a
worker process: `GGUFFile` or `load_config`, `inspect_checkpoint`, `infer.load` (10% of
them streaming), and a two-token `generate`. Workers run one input at a time under a
memory cap (``RLIMIT_AS`` = the worker's address space after warm-up + ``--mem-gib``)
and a per-input timeout (``--timeout``, enforced by this process, which kills and
replaces a worker that overruns). Outcomes:

- ``loaded``: every entry point succeeded;
- ``rejected``: a documented error (``ValueError``, ``OSError``) naming the input;
  ``rejected-unnamed``: the same types, the input not named in the message;
- ``memory-capped``: an allocation refused under the cap (``MemoryError`` / torch's
  "can't allocate memory");
- ``undocumented``: any other exception (type and innermost ``infer`` source file kept);
- ``crashed``: the worker died from a signal; ``hung``: the input ran past 80% of the
  timeout (interrupted with SIGALRM, so where it was is known) or the worker did not
  answer within the timeout (killed and replaced).

Exceptions are attributed to the innermost ``infer`` source file in their traceback. Run::

    uv run python benchmarks/fuzz.py --n 100000 --workers 2          # table + .bench/fuzz/fuzz.json
    uv run python benchmarks/fuzz.py --seed 0 --only 1234 --save /tmp/case   # reproduce one input
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / ".bench" / "fuzz"


# --------------------------------------------------------------------------- worker


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def _warm_up(mutator: Any, seeds: Any) -> None:
    """Import and build everything a first case would (so no case pays seconds of imports)."""
    import transformers

    import infer
    from infer.testing.fuzzing import Case, run_case

    for model_type in ("llama", "qwen3", "gemma3_text", "gemma3", "gpt2", "mistral"):
        transformers.AutoConfig.for_model(model_type)
    for kind, path in (("gguf", seeds.gguf), ("safetensors", seeds.safetensors), ("index", seeds.sharded)):
        for streaming in (False, True):
            outcome = run_case(Case(-1, kind, path, "seed", streaming))
            if outcome.outcome != "loaded":
                raise RuntimeError(f"seed {path} does not load: {outcome}")
    for model_type in ("llama", "gemma3_text", "gpt2", "mistral"):  # tokenizer classes per model type
        config = json.loads((seeds.safetensors / "config.json").read_text())
        directory = Path(tempfile.mkdtemp(dir=mutator.work))
        shutil.copytree(seeds.safetensors, directory, dirs_exist_ok=True)
        (directory / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        with contextlib.suppress(Exception):  # only the imports matter
            infer.load(directory)
        shutil.rmtree(directory)


def worker(args: argparse.Namespace) -> None:
    import torch

    from infer.testing.fuzzing import Mutator, Seeds, run_case

    torch.set_num_threads(1)
    work = Path(args.work)
    cache = work / "cache"
    os.environ["XDG_CACHE_HOME"] = str(cache)
    seeds = Seeds(*(Path(p) for p in json.loads(args.seeds)))
    mutator = Mutator(seeds, work, args.seed, tuple(args.kinds.split(",")))
    _warm_up(mutator, seeds)
    keep = set((cache / "infer" / "tokenizers").glob("*"))
    baseline = _vm_size()
    cap = baseline + int(args.mem_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))
    print(json.dumps({"ready": True, "baseline_vm": baseline, "cap": cap}), flush=True)
    for done, line in enumerate(sys.stdin):
        index = int(line)
        outcome = run_case(mutator.case(index), time_limit=args.timeout * 0.8).as_dict()
        outcome["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # What earlier inputs left behind (a streamed model that is never freed keeps its reader
        # thread, ~72 MiB of address space with its stack and malloc arena): past half the cap,
        # this worker is replaced, so that the cap keeps measuring one input at a time.
        outcome["reader_threads"] = sum(t.name == "infer-streaming-reader" for t in threading.enumerate())
        outcome["recycle"] = _vm_size() > baseline + args.mem_gib * 2**30 / 2
        print(json.dumps(outcome), flush=True)
        if outcome["recycle"]:
            return
        if done % 200 == 199:  # tokenizers built for mutated headers: keep the cache small
            for entry in (cache / "infer" / "tokenizers").glob("*"):
                if entry not in keep:
                    shutil.rmtree(entry, ignore_errors=True)


# --------------------------------------------------------------------------- parent


class Worker:
    def __init__(self, args: argparse.Namespace, seeds: list[str], number: int, out: Path) -> None:
        self.work = Path(tempfile.mkdtemp(prefix=f"fuzz-w{number}-", dir=out))
        cmd = [
            sys.executable, __file__, "--worker", "--seed", str(args.seed), "--kinds", args.kinds,
            "--mem-gib", str(args.mem_gib), "--timeout", str(args.timeout), "--work", str(self.work),
            "--seeds", json.dumps(seeds),
        ]  # fmt: skip
        self.log = (self.work / "stderr.log").open("w")
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TMPDIR": str(self.work)}  # temp files go too
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            start_new_session=True, env=env,
        )  # fmt: skip
        self.ready = False
        self.index: int | None = None
        self.started = 0.0
        self.info: dict[str, Any] = {}

    def send(self, index: int) -> None:
        assert self.proc.stdin is not None
        self.index, self.started = index, time.monotonic()
        self.proc.stdin.write(f"{index}\n")
        self.proc.stdin.flush()

    def kill(self, grace: float = 0.0) -> int:
        """Stop the worker (after ``grace`` seconds for it to exit on its own) and remove its directory."""
        if grace:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        code = self.proc.wait()
        self.log.close()
        shutil.rmtree(self.work, ignore_errors=True)
        return code


def run(args: argparse.Namespace) -> dict[str, Any]:
    from infer.testing.fuzzing import build_seeds

    out = Path(args.out).parent
    out.mkdir(parents=True, exist_ok=True)
    seeds = build_seeds(out / "seeds")
    seed_paths = [str(seeds.gguf), str(seeds.safetensors), str(seeds.sharded)]
    todo = list(range(args.n))[::-1]
    results: list[dict[str, Any]] = []
    selector = selectors.DefaultSelector()
    workers: list[Worker] = []
    spawned = 0
    recycled: list[int] = []  # reader threads alive in each worker replaced for its address space

    def spawn() -> None:
        nonlocal spawned
        w = Worker(args, seed_paths, spawned, out)
        spawned += 1
        workers.append(w)
        assert w.proc.stdout is not None
        selector.register(w.proc.stdout, selectors.EVENT_READ, w)

    def retire(w: Worker, outcome: str, detail: str) -> None:
        selector.unregister(w.proc.stdout)  # type: ignore[arg-type]
        workers.remove(w)
        code = w.kill(grace=10 if not outcome else 0)
        if w.index is not None:
            results.append({"index": w.index, "outcome": outcome, "error": detail or f"exit {code}"})
        if todo:
            spawn()

    for _ in range(args.workers):
        spawn()
    start = last_report = time.monotonic()
    while len(results) < args.n:
        for key, _ in selector.select(timeout=0.2):
            w = key.data
            if w not in workers:
                continue
            line = w.proc.stdout.readline()
            if not line:  # the worker died
                code = w.proc.wait()
                name = signal.Signals(-code).name if code < 0 else f"exit {code}"
                if not w.ready:
                    raise RuntimeError(f"worker failed to start ({name}); see {w.work / 'stderr.log'}")
                retire(w, "crashed", name)
                continue
            record = json.loads(line)
            if record.get("ready"):
                w.ready, w.info = True, record
            else:
                results.append(record)
                w.index = None
                if record.get("recycle"):  # it exits on its own: replace it
                    recycled.append(record.get("reader_threads", 0))
                    retire(w, "", "")
                    continue
            if todo and w.index is None:
                w.send(todo.pop())
        now = time.monotonic()
        for w in list(workers):
            if w.index is not None and now - w.started > args.timeout:
                retire(w, "hung", f"no answer within {args.timeout} s")
        if now - last_report > 60:
            last_report = now
            rate = len(results) / (now - start)
            counts = dict(Counter(r["outcome"] for r in results))
            print(f"  {len(results)}/{args.n} inputs, {rate:.1f}/s, {counts}")
            sys.stdout.flush()
    for w in workers:
        w.kill(grace=30)
    return {
        "results": results,
        "seconds": time.monotonic() - start,
        "workers_spawned": spawned,
        "recycled": recycled,
        "worker_info": [w.info for w in workers],
        "seed_paths": seed_paths,
    }


def _describe_lost(args: argparse.Namespace, raw: dict[str, Any]) -> None:
    """Crashed / hung inputs come back without a description: derive it again."""
    from infer.testing.fuzzing import Mutator, Seeds

    lost = [r for r in raw["results"] if "kind" not in r]
    if not lost:
        return
    with tempfile.TemporaryDirectory() as work:
        seeds = Seeds(*(Path(p) for p in raw["seed_paths"]))
        mutator = Mutator(seeds, Path(work), args.seed, tuple(args.kinds.split(",")))
        for r in lost:
            case = mutator.case(r["index"])
            r["kind"], r["mutation"] = case.kind, case.mutation + (" [streaming]" if case.streaming else "")
            r.setdefault("message", r.get("error", ""))


def summarize(args: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    results = sorted(raw["results"], key=lambda r: r["index"])
    by_outcome = Counter(r["outcome"] for r in results)
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    for r in results:
        by_kind[r.get("kind", "?")][r["outcome"]] += 1
    rejected = Counter(r["error"] for r in results if r["outcome"] == "rejected")
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        if r["outcome"] not in ("loaded", "rejected"):
            groups[(r["outcome"], r.get("error", ""), r.get("origin", ""), r.get("stage", ""))].append(r)
    slowest: dict[str, Any] = max(results, key=lambda r: r.get("seconds", 0.0), default={})
    return {
        "command": " ".join(["uv run python benchmarks/fuzz.py", *sys.argv[1:]]),
        "n": len(results),
        "seed": args.seed,
        "seconds": raw["seconds"],
        "workers": args.workers,
        "workers_spawned": raw["workers_spawned"],
        "workers_recycled": len(raw["recycled"]),
        "leaked_reader_threads_at_recycle": raw["recycled"],
        "max_reader_threads": max((r.get("reader_threads", 0) for r in results), default=0),
        "timeout_s": args.timeout,
        "mem_cap_gib_over_baseline": args.mem_gib,
        "max_worker_rss_mib": max((r.get("maxrss_kb", 0) for r in results), default=0) / 1024,
        "slowest": {k: slowest.get(k) for k in ("index", "kind", "mutation", "outcome", "seconds")},
        "outcomes": dict(by_outcome),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "rejected_by_error": dict(rejected.most_common()),
        "findings": [
            {
                "outcome": key[0],
                "error": key[1],
                "origin": key[2],
                "stage": key[3],
                "count": len(rs),
                "examples": [{k: r.get(k) for k in ("index", "kind", "mutation", "message")} for r in rs[:3]],
            }
            for key, rs in sorted(groups.items(), key=lambda kv: -len(kv[1]))
        ],
        "machine": _machine(),
    }


def _machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def print_table(summary: dict[str, Any]) -> None:
    n = summary["n"]
    seconds = summary["seconds"]
    print(f"\n{n} inputs in {seconds:.0f} s ({n / seconds:.1f}/s), {summary['workers']} workers")
    print(f"machine: {summary['machine']}")
    print(f"\n{'outcome':20s} {'count':>8s} {'share':>7s}")
    for outcome in (
        "loaded",
        "rejected",
        "rejected-unnamed",
        "memory-capped",
        "undocumented",
        "crashed",
        "hung",
    ):
        count = summary["outcomes"].get(outcome, 0)
        print(f"{outcome:20s} {count:8d} {count / max(n, 1):7.2%}")
    print("\nby kind: " + "; ".join(f"{k}: {dict(v)}" for k, v in summary["by_kind"].items()))
    print("rejected by error type: " + ", ".join(f"{k} {v}" for k, v in summary["rejected_by_error"].items()))
    print(f"max worker RSS {summary['max_worker_rss_mib']:.0f} MiB; slowest input {summary['slowest']}")
    print(
        f"workers replaced at half their address-space cap: {summary['workers_recycled']} "
        f"(streaming reader threads left alive by earlier inputs: up to {summary['max_reader_threads']})"
    )
    if summary["findings"]:
        print(f"\n{'count':>6s}  {'outcome':16s} {'error':28s} {'stage':18s} origin")
        for f in summary["findings"]:
            print(f"{f['count']:6d}  {f['outcome']:16s} {f['error'][:28]:28s} {f['stage']:18s} {f['origin']}")
            ex = f["examples"][0]
            print(f"        e.g. #{ex['index']} {ex['kind']} {ex['mutation']}: {str(ex['message'])[:150]!r}")


def reproduce(args: argparse.Namespace) -> None:
    """Write input ``--only`` of run ``--seed`` to ``--save`` and run it here, with its traceback."""
    import traceback

    from infer.testing.fuzzing import Mutator, build_seeds, run_case

    seeds = build_seeds(Path(args.out).parent / "seeds")
    target = Path(args.save)
    mutator = Mutator(seeds, target, args.seed, tuple(args.kinds.split(",")))
    case = mutator.case(args.only)
    streaming = ", streaming" if case.streaming else ""
    print(f"input #{args.only} ({case.kind}, {case.mutation}{streaming}): {case.path}")
    outcome = run_case(case)
    print(json.dumps(outcome.as_dict(), indent=1))
    if outcome.outcome not in ("loaded", "rejected"):
        try:
            run_case(case, reraise=True)
        except Exception:
            traceback.print_exc()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=100_000, help="inputs to run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per input")
    parser.add_argument(
        "--mem-gib", type=float, default=2.0, help="address space per worker over its baseline"
    )
    parser.add_argument("--kinds", default="gguf,safetensors,index,config")
    parser.add_argument("--out", default=str(BENCH_DIR / "fuzz.json"))
    parser.add_argument("--only", type=int, help="reproduce this input (with --save)")
    parser.add_argument("--save", default=str(BENCH_DIR / "case"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--seeds", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.only is not None:
        reproduce(args)
        return
    raw = run(args)
    _describe_lost(args, raw)
    summary = summarize(args, raw)
    print_table(summary)
    out = Path(args.out)
    out.write_text(json.dumps({**summary, "results": raw["results"]}, indent=None))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
