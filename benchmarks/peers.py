"""infer (default, first run, compiled) against transformers and llama.cpp: one invocation, one machine.

    uv run python benchmarks/peers.py                      # both real GGUF models + the bf16 model
    uv run python benchmarks/peers.py --threads 1 --reps 5 --json out.json --chart docs/peers.png
    uv run python benchmarks/peers.py --models smollm2 --prompts 128 --reps 1 --chart ""   # a quick look

For SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M (`infer.realmodels`), and with
``--models qwen-coder-1.5b`` Qwen2.5-Coder-1.5B-Instruct Q4_K_M (fetched once), every runtime
runs in its own fresh process (so peak RSS and ready time are honest) and reports:

* ready: seconds from process start to a model ready to generate (imports included);
* first token: ready plus the first prefill + decode step (compiles them when compiled);
* prefill: tokens/s of a prompt of each of ``--prompts`` lengths (default 128, 2048, 4096;
  nothing cached before it), with the peak RSS once that length has run (the lengths run in
  increasing order, so it shows how memory grows with the prompt). infer: ``llm.generate(prompt,
  max_new_tokens=1)``, through the engine as a user's prompt goes (chunked, sliding windows
  trimmed); transformers: one forward;
* decode: tokens/s of greedy one-token steps at depth 128 (after a 128-token prompt; infer:
  ``llm.execution``'s steps, the ones the engine runs);
* peak RSS of the process.

Runtimes: "infer default" is what a user gets: ``infer.load(path)`` with no flags, generating
through ``llm.execution``, in a second process on the machine. Its caches (``XDG_CACHE_HOME``: the
tokenizer, the repacked GGUF matrices, the ahead-of-time compiled decode steps of `infer.aot`)
are a temporary directory that "infer first run" filled (with ``INFER_AOT=on``: the model is
assembled under it, and a temporary checkpoint's shapes are built only when asked): that run
found it empty, so it decoded eagerly and queued the build of the decode step it ran; the benchmark
waits for that build (`infer.aot.building`) before the second process. The JSON records how many
steps ran from a package (``packaged_steps``). Beside them ``infer.load(path, compile=True)``
twice: "compiled cold" with an empty inductor cache, then
"compiled warm" with the cache the cold run left (their speeds are the same graphs; ready,
first token and compile seconds differ). Then transformers (``from_pretrained(gguf_file=...)``,
float32) and llama.cpp's ``llama-bench`` (built by ``../shared/peers/llamacpp.sh``: ``-p L`` for
each prompt length and ``-n 64 -d 128``; its "ready" is the wall time of a 1-token run, model
load included). llama.cpp's repacked weights segfault on some CPUs (Intel Xeons with AMX): a
short ``llama-bench`` probe runs first, and if it fails every run uses ``--repack 0``; the JSON
(``repack``) and the table say which. Also the SmolLM2-shaped Llama with random bfloat16
weights from safetensors (`infer.testing.SMOLLM2_SHAPE`), infer vs transformers at bfloat16.

Speeds are the median of ``--reps`` repetitions after a warm-up. Prints the table with
ratios to llama.cpp (GGUF models) and to transformers (the bf16 model), and the machine.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / ".bench"
PEERS_SCRIPT = ROOT.parent / "shared" / "peers" / "llamacpp.sh"
DEPTH = 128  # decode runs after a prompt of this many tokens
DECODE = 64
PROMPTS = (128, 2048, 4096)
MODELS = {
    "smollm2": "SmolLM2-135M Q4_1",
    "gemma3": "Gemma 3 270M Q4_K_M",
    "qwen-coder-1.5b": "Qwen2.5-Coder-1.5B Q4_K_M",
    "bf16": "SmolLM2-shaped bf16",
}
INFER_SIDES = ("infer default", "infer first run", "infer compiled warm", "infer compiled cold")


def model_path(model: str) -> Path:
    if model == "bf16":
        from infer.testing import SMOLLM2_SHAPE, build_checkpoint

        path = BENCH_DIR / "smol-shaped-llama-bf16"
        if not (path / "config.json").is_file():
            import torch

            build_checkpoint(path, "llama", dtype=torch.bfloat16, **SMOLLM2_SHAPE)
        return path
    import infer.realmodels as rm

    if model in rm.SPLIT_MODELS:
        return rm.fetch(model)  # downloaded and checked once (`infer.realmodels.fetch`)
    return rm.smollm2_path() if model == "smollm2" else rm.gemma3_270m_path()


def prompt_ids(vocab: int, length: int) -> list[int]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(100, min(vocab, 20000), (length,), generator=gen).tolist()


def peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(
    prefill: Any, decode_step: Any, prompts: list[int], reps: int, timed_prefill: Any = None
) -> dict[str, Any]:
    """Median seconds of ``timed_prefill(n)`` (default ``prefill``) per prompt length and of one
    ``decode_step(state)`` at depth `DEPTH` after ``prefill(DEPTH)`` (which returns the state);
    the first repetition of each warms up."""
    timed_prefill = timed_prefill or prefill
    dec = []
    for _ in range(reps + 1):
        state = prefill(DEPTH)
        t0 = time.perf_counter()
        for _ in range(DECODE):
            state = decode_step(state)
        dec.append((time.perf_counter() - t0) / DECODE)
    prefill_tok_s, rss_at = {}, {}
    for n in sorted(prompts):
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            timed_prefill(n)
            times.append(time.perf_counter() - t0)
        prefill_tok_s[str(n)] = n / statistics.median(times[1:])
        rss_at[str(n)] = peak_rss()
    return {
        "prefill_tok_s": prefill_tok_s,
        "peak_rss_at": rss_at,
        "decode_tok_s": 1 / statistics.median(dec[1:]),
    }


def run_infer(path: Path, compiled: bool, prompts: list[int], reps: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import infer
    from infer.execution import MIN_PREFILL, StepFeed
    from infer.kv.cache import KVCache, bucket
    from infer.sampling import Sampling

    t_load = time.perf_counter()
    llm = infer.load(path, compile=True) if compiled else infer.load(path)  # the default: no flags
    ready = time.perf_counter()
    execution = llm.execution
    vocab = llm.model.config.vocab_size
    ones, zeros = torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    greedy = Sampling()

    def prefill(n: int) -> Any:
        # Right-padded and sized as the engine buckets a compiled execution's steps (`Execution.bucketed`).
        length = bucket(n, MIN_PREFILL) if execution.bucketed else n
        ids = F.pad(torch.tensor([prompt_ids(vocab, n)]), (0, length - n))
        # The engine's kind of cache (`infer.kv.KVSlots`: no ring buffers, which packages
        # never serve): `model.make_cache` would give Gemma 3's sliding-window layers rings.
        m = llm.model
        capacity = needed = length + DECODE + 1
        if execution.bucketed:
            capacity = max(needed, min(bucket(needed), m.config.max_position_embeddings))
        cache = KVCache(m.config, 1, capacity, dtype=m.cache_dtype, device=m.device, layers=m.kv_layers,
                        rings=False)  # fmt: skip
        out = execution(cache, StepFeed(ids, torch.tensor([n]), torch.tensor([n - 1]), greedy, None, None))
        out.tokens.tolist()
        return cache, out

    def decode_step(state: Any) -> Any:
        cache, out = state
        out = execution(cache, StepFeed(out.tokens[:, None], ones, zeros, greedy, None, None))
        out.tokens.tolist()  # the host reads each token, as generation does
        return cache, out

    fresh = iter(range(1, 1 << 30))

    def generate_prefill(n: int) -> None:
        """A prompt of ``n`` tokens through `LLM.generate` (its engine: chunked as it chunks, no
        ring buffers, sliding windows trimmed), a new first token each call: no prefix reuse."""
        ids = prompt_ids(vocab, n)
        ids[0] = 100 + next(fresh)
        llm.generate(ids, max_new_tokens=1)

    t0 = time.perf_counter()
    decode_step(prefill(DEPTH))  # compiles the prefill and decode graphs when compiled
    first_call = time.perf_counter() - t0
    result = measure(prefill, decode_step, prompts, reps, generate_prefill)
    return {
        "ready_s": ready - T_START,
        "load_s": ready - t_load,
        "first_token_s": ready - T_START + first_call,
        "compiled": llm.compiled,
        "compile_s": execution.compile_seconds,
        "packaged_steps": execution.packaged_steps,
        **result,
    }


def run_transformers(path: Path, prompts: list[int], reps: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    t_load = time.perf_counter()
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    model.eval()  # type: ignore[no-untyped-call]
    ready = time.perf_counter()

    def prefill(n: int) -> Any:
        out = model(torch.tensor([prompt_ids(model.config.vocab_size, n)]), use_cache=True)
        return out.logits[:, -1:].argmax(-1), out.past_key_values

    def decode_step(state: Any) -> Any:
        nxt, past = state
        out = model(nxt, past_key_values=past, use_cache=True)
        return out.logits[:, -1:].argmax(-1), out.past_key_values

    with torch.inference_mode():
        result = measure(prefill, decode_step, prompts, reps)
    return {"ready_s": ready - T_START, "load_s": ready - t_load, **result}


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    path = model_path(args.model)
    prompts = parse_prompts(args.prompts)
    if args.side == "transformers":
        result = run_transformers(path, prompts, args.reps)
    else:
        result = run_infer(path, args.side == "compiled", prompts, args.reps)
    result["peak_rss"] = peak_rss()
    print("RESULT " + json.dumps(result))


def spawn(
    model: str, side: str, args: argparse.Namespace, env: dict[str, str] | None = None
) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--side", side]
    cmd += ["--reps", str(args.reps), "--threads", str(args.threads), "--prompts", args.prompts]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            data: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return data
    raise RuntimeError(f"{model} / {side} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def run_default(model: str, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(first, second)``: the default load in a process with empty caches, then, once the build
    the first one started has ended, in a second process."""
    from infer.aot import building

    home = Path(tempfile.mkdtemp(prefix="infer-peers-cache-"))
    # The default, except for INFER_AOT=on: a model under a temporary directory (the models
    # directory may be one) has its shapes built only when asked (infer.aot). A fresh cache
    # for the first run, but the models where they are: a 1 GB model is not fetched again.
    import infer.realmodels as rm

    env = os.environ | {"INFER_AOT": "on", "XDG_CACHE_HOME": str(home)}
    env["INFER_MODELS_DIR"] = str(rm.models_dir())
    if args.packages is not None:  # packages built elsewhere: the first run is then no first run
        (home / "infer" / "aot").mkdir(parents=True)
        for package in args.packages.glob("*.pt2"):
            shutil.copy2(package, home / "infer" / "aot" / package.name)
    try:
        first = spawn(model, "default", args, env)
        t0 = time.perf_counter()
        while building(home / "infer" / "aot") and time.perf_counter() - t0 < 3600:
            time.sleep(1)
        first["build_wait_s"] = time.perf_counter() - t0
        second = spawn(model, "default", args, env)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return first, second


def run_compiled(model: str, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(cold, warm)``: a process with an empty inductor cache, then one with the cache it left."""
    cache_dir = Path(tempfile.mkdtemp(prefix="infer-peers-inductor-"))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    try:
        cold = spawn(model, "compiled", args, env)
        warm = spawn(model, "compiled", args, env)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return cold, warm


def llama_bench(bin_dir: Path, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``llama-bench``: prefill ``-p L`` per prompt length, decode ``-n 64 -d 128``; peak RSS of
    each via a wrapper process. A short probe first: if llama.cpp's repacked weights crash
    (a segfault on some CPUs with AMX), every run uses ``--repack 0``."""

    def bench(extra: list[str], check: bool = True) -> tuple[list[dict[str, Any]], int, float]:
        cmd = [str(bin_dir / "llama-bench"), "-m", str(path), "-t", str(args.threads), "-o", "json", *extra]
        wrapper = (
            "import resource, subprocess, sys, time; t = time.perf_counter(); "
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print(p.stdout); print('WALL', time.perf_counter() - t); "
            "print('RSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); "
            "sys.stderr.write(p.stderr[-2000:]); sys.exit(p.returncode)"
        )
        proc = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True)
        if proc.returncode != 0:
            if not check:
                return [], 0, 0.0
            raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        out = proc.stdout
        rss = int(out[out.rindex("RSS ") + 4 :].split()[0])
        wall = float(out[out.rindex("WALL ") + 5 :].split()[0])
        return json.loads(out[: out.rindex("WALL ")]), rss, wall

    probe, _, _ = bench(["-p", "16", "-n", "0", "-r", "1"], check=False)
    repack = bool(probe)
    flags = [] if repack else ["--repack", "0"]
    if not repack:
        print("  llama.cpp's repacked weights failed a short llama-bench run: using --repack 0", flush=True)
    reps = str(args.reps)
    prefill_tok_s, rss_at = {}, {}
    for n in sorted(parse_prompts(args.prompts)):
        pre, rss, _ = bench(["-p", str(n), "-n", "0", "-r", reps, *flags])
        prefill_tok_s[str(n)] = float(pre[0]["avg_ts"])
        rss_at[str(n)] = rss
    dec, rss_dec, _ = bench(["-p", "0", "-n", str(DECODE), "-d", str(DEPTH), "-r", reps, *flags])
    _, _, ready = bench(["-p", "0", "-n", "1", "-r", "1", *flags])
    return {
        "ready_s": ready,
        "repack": repack,
        "prefill_tok_s": prefill_tok_s,
        "peak_rss_at": rss_at,
        "decode_tok_s": float(dec[0]["avg_ts"]),
        "peak_rss": max([rss_dec, *rss_at.values()]),
    }


def parse_prompts(text: str) -> list[int]:
    try:
        prompts = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise SystemExit(f"--prompts: expected comma-separated integers, got {text!r}") from None
    if not prompts or prompts[0] < 1:
        raise SystemExit(f"--prompts: expected prompt lengths >= 1, got {text!r}")
    return prompts


def machine(threads: int) -> str:
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import torch

    load = os.getloadavg()
    return (
        f"{cpu}, {os.cpu_count()} CPUs, {threads} threads, torch {torch.__version__}, "
        f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}"
    )


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def side_label(side: str, r: dict[str, Any]) -> str:
    if side == "llama.cpp" and not r.get("repack", True):
        return "llama.cpp --repack 0"
    if side.startswith("infer default"):
        how = "compiled" if r.get("compiled") else "packaged" if r.get("packaged_steps") else "eager"
        return f"{side} ({how})"
    return side


def print_table(results: dict[str, dict[str, dict[str, Any]]], prompts: list[int]) -> None:
    pre_cols = "".join(f" {'prefill ' + str(n):>13}" for n in prompts)
    print("(prefill and decode in tokens/s; 'RSS at longest': peak RSS once the longest prompt has run)")
    head = f"{'model':<21} {'runtime':<36} {'ready s':>8} {'1st tok s':>9}{pre_cols} {'decode':>8}"
    print(head + f" {'peak RSS':>9} {'RSS at longest':>15} {'compile s':>9}")
    for model, sides in results.items():
        ref_name = "transformers" if model == "bf16" else "llama.cpp"
        ref = sides.get(ref_name)
        for side, r in sides.items():
            first = f"{r['first_token_s']:.2f}" if "first_token_s" in r else ""
            pre = "".join(f" {r['prefill_tok_s'][str(n)]:>13.0f}" for n in prompts)
            comp = f"{r['compile_s']:.1f}" if r.get("compiled") else ""
            longest = mib(r["peak_rss_at"][str(prompts[-1])])
            print(
                f"{MODELS[model]:<21} {side_label(side, r):<36} {r['ready_s']:>8.2f} {first:>9}{pre} "
                f"{r['decode_tok_s']:>8.1f} {mib(r['peak_rss']):>9} {longest:>15} {comp:>9}"
            )
        if ref is None:
            continue
        for side, r in sides.items():
            if side.startswith("infer"):
                pre = ", ".join(
                    f"{n} {r['prefill_tok_s'][str(n)] / ref['prefill_tok_s'][str(n)]:.2f}x" for n in prompts
                )
                dec = r["decode_tok_s"] / ref["decode_tok_s"]
                print(f"{'':<21} {side} / {side_label(ref_name, ref)}: prefill {pre}; decode {dec:.2f}x")


def chart(results: dict[str, dict[str, dict[str, Any]]], out: Path, title: str, prompt: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    sides = ["infer default", "infer first run", "infer compiled warm", "transformers", "llama.cpp"]
    colors = {
        "infer default": "#08519c",
        "infer first run": "#c6dbef",
        "infer compiled warm": "#6baed6",
        "transformers": "#fdae6b",
        "llama.cpp": "#74c476",
    }
    models = list(results)
    sides = [s for s in sides if any(s in results[m] for m in models)]  # the runtimes that ran
    width = 0.8 / len(sides)

    def decode(r: dict[str, Any]) -> float:
        return float(r["decode_tok_s"])

    def prefill(r: dict[str, Any]) -> float:
        return float(r["prefill_tok_s"][str(prompt)])

    panels: list[tuple[Any, Callable[[dict[str, Any]], float], str]] = [
        (axes[0], decode, f"decode tok/s (depth {DEPTH})"),
        (axes[1], prefill, f"prefill tok/s ({prompt}-token prompt)"),
    ]
    for ax, value, label in panels:
        for j, side in enumerate(sides):
            xs = [i + (j - (len(sides) - 1) / 2) * width for i, m in enumerate(models) if side in results[m]]
            ys = [value(results[m][side]) for m in models if side in results[m]]
            bars = ax.bar(xs, ys, width, label=side, color=colors[side])
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(models)), [MODELS[m] for m in models], fontsize=8)
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"chart: {out}")


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    default_models = "smollm2,gemma3,bf16"  # the 1.5B on request: a 1.1 GB download and minutes a runtime
    parser.add_argument("--models", default=default_models, help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--prompts",
        default=",".join(map(str, PROMPTS)),
        help="prefill prompt lengths, comma-separated (default: %(default)s)",
    )
    sides_help = ", ".join([*INFER_SIDES, "transformers", "llama.cpp"])
    parser.add_argument("--skip", default="", help=f"runtimes to leave out, comma-separated: {sides_help}")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--packages",
        type=Path,
        default=None,
        metavar="DIR",
        help="seed the default's cache with the packages in DIR (e.g. speculative.py's): no build "
        "wait, and 'infer first run' is then not a first run",
    )
    parser.add_argument(
        "--chart", default=str(ROOT / "docs" / "peers.png"), help='PNG to write ("" for none)'
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    prompts = parse_prompts(args.prompts)
    skip = set(filter(None, args.skip.split(",")))
    bin_dir = None
    if "llama.cpp" not in skip:
        built = subprocess.run(["bash", str(PEERS_SCRIPT)], capture_output=True, text=True, check=True)
        bin_dir = Path(built.stdout.strip())
    before = machine(args.threads)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for model in args.models.split(","):
        sides: dict[str, dict[str, Any]] = {}
        names = [*INFER_SIDES, "transformers"]
        if model != "bf16" and bin_dir is not None:
            names.append("llama.cpp")
        for side in names:
            if side in skip or side in sides:
                continue
            print(f"running {MODELS[model]} / {side} ...", flush=True)
            if side in ("infer default", "infer first run"):  # one run makes both (the first fills the cache)
                first, second = run_default(model, args)
                for name, r in (("infer default", second), ("infer first run", first)):
                    if name not in skip:
                        sides[name] = r
            elif side.startswith("infer compiled"):
                cold, warm = run_compiled(model, args)
                for name, r in (("infer compiled warm", warm), ("infer compiled cold", cold)):
                    if name not in skip:
                        sides[name] = r
            elif side == "transformers":
                sides[side] = spawn(model, "transformers", args)
            elif side == "llama.cpp" and bin_dir is not None:
                sides[side] = llama_bench(bin_dir, model_path(model), args)
        results[model] = sides
    print(f"\nmachine: {before} (before); load after: {os.getloadavg()[0]:.1f}")
    print(
        f"prefill of {', '.join(map(str, prompts))} tokens; decode {DECODE} greedy steps at depth {DEPTH}; "
        f"median of {args.reps}\n"
    )
    print_table(results, prompts)
    if args.json is not None:
        args.json.write_text(
            json.dumps({"machine": before, "prompts": prompts, "results": results}, indent=2)
        )
    if args.chart:
        chart(results, Path(args.chart), f"benchmarks/peers.py on {before}", prompts[0])


if __name__ == "__main__":
    main()
