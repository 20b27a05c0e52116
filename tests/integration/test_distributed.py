"""Tensor and pipeline parallelism on CPU: 2 processes over gloo, spawned by the test.

Each case starts the ranks as separate Python processes (the environment torchrun would
set: RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT), each loads its part with
``infer.load(..., tensor_parallel=T, pipeline_parallel=P)`` and writes its logits and
greedy tokens; the test compares every rank's with one process's. Greedy tokens must be
identical. float32 logits: pipeline parallelism computes exactly what one process does
(measured: bit-identical); tensor parallelism adds the row-parallel products' partial
sums across ranks, a different float32 summation order, so its logits agree within
1e-5 plus float32 rounding at the logits' scale (1e-6 x max |logit|: measured up to 3e-5
on the tiny Qwen 3, whose logits reach 33, i.e. 9e-7 of them; 5e-6 on the tiny Llama).
Failures (sizes that do not divide, a world size that is not T x P, a rank that fails to
load) must reach every rank as one clear error, never a hang.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_env import free_port, rank_env, torchrun
from safetensors.torch import load_file, save_file

import infer

pytestmark = pytest.mark.slow

SRC = Path(__file__).resolve().parents[2] / "src"
IDS = [[5, 17, 42, 99, 3, 250, 7, 64, 12, 180, 33, 9], [8, 1, 77, 150, 2, 4, 6, 8, 10, 12, 14, 16]]
PROMPT = [5, 17, 42, 99, 3]
PROMPT2 = [9, 8, 7, 6, 5, 4, 3, 2]
NEW_TOKENS = 8
PARITY = 1e-5  # absolute, plus RELATIVE x max |logit| for tensor parallelism's reordered sums
RELATIVE = 1e-6

CHILD = r"""
import json, sys, traceback
import torch
torch.set_num_threads(1)
args = json.loads(sys.argv[1])
out = {"rank": int(__import__("os").environ["RANK"])}
try:
    import infer
    kwargs = dict(args.get("kwargs", {}))
    if "streaming" in kwargs:
        kwargs["streaming"] = infer.StreamingConfig(**kwargs["streaming"])
    path = args["paths"][out["rank"]] if "paths" in args else args["path"]
    parallel = {"tensor_parallel": args["tp"], "pipeline_parallel": args["pp"]}
    llm = infer.load(path, dtype=args.get("dtype"), **parallel, **kwargs)
    with torch.inference_mode():
        logits = llm.model(torch.tensor(args["ids"]))
    out["logits"] = logits.tolist()
    out["tokens"] = llm.generate(args["prompt"], max_new_tokens=args["new"]).token_ids
    batch = llm.generate([args["prompt"], args["prompt2"]], max_new_tokens=args["new"])
    out["batch"] = [r.token_ids for r in batch]  # pipeline stages: two micro-batches of one row
    out["kv_bytes"] = llm.model.make_cache(2, 64).nbytes
    stats = llm.streaming_stats
    out["streamed_bytes"] = None if stats is None else stats.bytes_loaded
    if args.get("sample"):
        sampled = llm.generate(args["prompt"], max_new_tokens=args["new"], temperature=1.0, top_k=20)
        out["sampled"] = sampled.token_ids
except Exception as e:
    out["error"] = [type(e).__name__, str(e)]
print("RESULT " + json.dumps(out))
"""


def run_ranks(
    world: int, args: dict[str, Any], timeout: float = 240, child: str = CHILD
) -> list[dict[str, Any]]:
    """Run ``child`` as ``world`` ranks; return each rank's result (its error, if it raised)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = rank_env(rank, world, port)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", child, json.dumps(args)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"a rank did not finish within {timeout} s (a hang)")
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, f"rank exited with {proc.returncode} and no result:\n{stderr[-3000:]}"
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return results


def reference(path: Path, dtype: str | None = "float32") -> dict[str, Any]:
    llm = infer.load(path, dtype=dtype)
    with torch.inference_mode():
        logits = llm.model(torch.tensor(IDS))
    tokens = llm.generate(PROMPT, max_new_tokens=NEW_TOKENS).token_ids
    batch = [r.token_ids for r in llm.generate([PROMPT, PROMPT2], max_new_tokens=NEW_TOKENS)]
    return {
        "logits": logits,
        "tokens": tokens,
        "batch": batch,
        "kv_bytes": llm.model.make_cache(2, 64).nbytes,
    }


def check(results: list[dict[str, Any]], ref: dict[str, Any], label: str, exact: bool = False) -> None:
    scale = ref["logits"].abs().max().item()
    for r in results:
        assert "error" not in r, f"{label} rank {r['rank']}: {r['error']}"
        err = (torch.tensor(r["logits"]) - ref["logits"]).abs().max().item()
        print(
            f"{label} rank {r['rank']}: max |logits - one process| {err:.2e} (logits up to {scale:.1f}), "
            f"tokens {r['tokens']}"
        )
        assert err <= (0.0 if exact else PARITY + RELATIVE * scale), label
        assert r["tokens"] == ref["tokens"], label
        assert r["batch"] == ref["batch"], label


def args_for(path: Path, tp: int, pp: int, **extra: Any) -> dict[str, Any]:
    return {"path": str(path), "tp": tp, "pp": pp, "ids": IDS, "prompt": PROMPT, "prompt2": PROMPT2,
            "new": NEW_TOKENS, "dtype": "float32", **extra}  # fmt: skip


@pytest.mark.parametrize("mode", ["tp2", "pp2"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "gpt2"])
def test_two_ranks_match_one_process(tiny_ckpt_factory: Callable[..., Path], arch: str, mode: str) -> None:
    path = tiny_ckpt_factory(arch)
    tp, pp = (2, 1) if mode == "tp2" else (1, 2)
    results = run_ranks(2, args_for(path, tp, pp, sample=True))
    ref = reference(path)
    check(results, ref, f"{arch} {mode}", exact=mode == "pp2")
    assert results[0]["sampled"] == results[1]["sampled"]  # every rank draws the same tokens
    # Each rank's KV cache holds its share: its stage's layers, or its KV heads.
    kv = [r["kv_bytes"] for r in results]
    print(f"{arch} {mode}: KV cache bytes per rank {kv}, one process {ref['kv_bytes']}")
    assert sum(kv) == ref["kv_bytes"] and max(kv) < ref["kv_bytes"]


def test_kv_heads_replicated(tmp_path: Path) -> None:
    """More tensor-parallel ranks than KV heads: each KV head is held by the ranks that use it."""
    from infer.testing import build_checkpoint

    path = build_checkpoint(tmp_path / "mqa", "llama", num_key_value_heads=1)
    check(run_ranks(2, args_for(path, 2, 1)), reference(path), "llama 1 KV head, tp2")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gguf_tensor_parallel(tmp_path: Path, qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed matrices split on block boundaries: row-parallel columns in whole Q8_0 / Q4_0 blocks."""
    from infer.gguf.writer import write_gguf
    from infer.testing import build_tokenizer, tiny_hf_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_gguf(
        tmp_path / f"llama-{qtype}.gguf", tiny_hf_model("llama"), build_tokenizer(tmp_path / "t"), qtype=qtype
    )
    ref = reference(path, dtype="float32")
    check(run_ranks(2, args_for(path, 2, 1)), ref, f"GGUF {qtype} tp2")


def test_streaming_pipeline(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """Each stage streams its own layers under its own budget."""
    path = tiny_ckpt_factory("llama")
    streaming = {"memory_budget": "64MB", "max_resident_layers": 0, "layer_group_size": 1}
    results = run_ranks(2, args_for(path, 1, 2, kwargs={"streaming": streaming}))
    check(results, reference(path), "llama pp2 streamed", exact=True)
    streamed = [r["streamed_bytes"] for r in results]
    print("bytes streamed per stage:", streamed)
    assert all(b is not None and b > 0 for b in streamed), streamed  # each stage reports its own


def _expect_same_error(results: list[dict[str, Any]], *needles: str) -> str:
    errors = [r.get("error") for r in results]
    assert all(e is not None for e in errors), errors
    messages = {e[1] for e in errors if e}
    print(messages)
    assert len(messages) == 1, messages  # the same error on every rank
    message: str = messages.pop()
    for needle in needles:
        assert needle in message, message
    return message


def test_sizes_that_do_not_divide(tmp_path: Path) -> None:
    from infer.testing import build_checkpoint

    path = build_checkpoint(tmp_path / "odd", "llama", vocab_size=271, intermediate_size=130)
    _expect_same_error(
        run_ranks(2, args_for(path, 2, 1)), "tensor_parallel=2 does not divide", "vocab_size 271"
    )
    one_layer = build_checkpoint(tmp_path / "one", "llama", num_hidden_layers=1)
    _expect_same_error(run_ranks(2, args_for(one_layer, 1, 2)), "num_hidden_layers 1 cannot be split")


def test_world_size_mismatch(tiny_ckpt_factory: Callable[..., Path]) -> None:
    results = run_ranks(2, args_for(tiny_ckpt_factory("llama"), 2, 2))
    _expect_same_error(
        results, "tensor_parallel=2 x pipeline_parallel=2 = 4 processes, but the world size is 2"
    )


def test_a_failing_rank_fails_every_rank(tiny_ckpt_factory: Callable[..., Path], tmp_path: Path) -> None:
    """Rank 1's copy of the checkpoint has a NaN in a layer only rank 1 holds: both ranks raise its error."""
    good = tiny_ckpt_factory("llama")
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.2.mlp.up_proj.weight"][0, 0] = math.nan
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    args = args_for(good, 1, 2) | {"paths": [str(good), str(bad)]}
    message = _expect_same_error(
        run_ranks(2, args), "rank 1:", "model.layers.2.mlp.up_proj.weight", "non-finite"
    )
    assert message.startswith("rank 1:")


SPEC_CHILD = r"""
import json, os, sys
import torch
torch.set_num_threads(1)
args = json.loads(sys.argv[1])
rank = int(os.environ["RANK"])
out = {"rank": rank}
try:
    import infer
    from infer.speculative import Speculator

    def plan(self, rows, proposals, drafting, *_):  # every pass proposes all it can
        sizes = [len(p.tokens) for p in proposals.values()] + [room for room, _ in drafting.values()]
        return 1 + max(sizes, default=0)

    Speculator.plan = plan
    if args.get("diverge") and rank == 1:  # a KV operation that fails on this rank only
        from infer.kv import KVSlots
        from infer.kv.ops import SetBound

        apply = KVSlots.apply

        def refusing(self, op):
            if isinstance(op, SetBound) and op.bound > 0:
                raise RuntimeError("planted: rank 1 refuses the bound")
            apply(self, op)

        KVSlots.apply = refusing
    parallel = {"tensor_parallel": args["tp"], "pipeline_parallel": args["pp"]}
    llm = infer.load(args["path"], dtype="float32", deterministic=True, **parallel, **args["spec"])
    out["tokens"] = [r.token_ids for r in llm.generate(args["prompts"], max_new_tokens=args["new"])]
    if rank == 0:
        out["stats"] = {k: v for k, v in llm.engine.stats().items() if k.startswith("spec_")}
except Exception as e:
    out["error"] = [type(e).__name__, str(e)]
print("RESULT " + json.dumps(out), flush=True)
"""
# Repetitive prompts: lookup finds matches in them, and the tiny model's greedy text repeats too.
SPEC_PROMPTS = [[5, 9, 200, 31, 7, 44, 3] * 3, [70, 71, 72, 73, 70, 71, 72, 73, 70, 71]]


@pytest.mark.parametrize(
    ("mode", "spec"),
    [("tp2", {"lookup": 3}), ("pp2", {"lookup": 3}), ("tp2", {"draft": "self", "speculative_tokens": 4})],
    ids=["tp2-lookup", "pp2-lookup", "tp2-draft"],
)
def test_speculation_under_parallelism_gives_one_process_tokens(
    tiny_ckpt_factory: Callable[..., Path], mode: str, spec: dict[str, Any]
) -> None:
    """Deterministic mode: verify passes go to every rank in rank 0's plans (every pass proposes all
    it can), and each rank returns the greedy tokens one process gives without speculation."""
    stats = _speculate_under_parallelism(tiny_ckpt_factory("llama"), mode, spec, SPEC_PROMPTS)
    assert stats["spec_passes"] > 0 and stats["spec_accepted"] > 0


def _speculate_under_parallelism(
    path: Path, mode: str, spec: dict[str, Any], prompts: list[list[int]]
) -> dict[str, Any]:
    """Two ranks (``mode``) generate ``prompts`` with ``spec``: each rank's tokens must be one
    process's without speculation; rank 0's speculation counters."""
    tp, pp = (2, 1) if mode == "tp2" else (1, 2)
    args = {"path": str(path), "tp": tp, "pp": pp, "spec": spec, "prompts": prompts, "new": 24}
    results = run_ranks(2, args, child=SPEC_CHILD)
    plain = infer.load(path, dtype="float32", deterministic=True)
    want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=24)]
    for r in results:
        assert "error" not in r, f"rank {r['rank']}: {r['error']}"
        assert r["tokens"] == want, f"rank {r['rank']}"
    stats: dict[str, Any] = results[0]["stats"]
    print(f"{mode} {spec}: {stats}")
    return stats


# A prompt longer than a prefill chunk and the first KV capacity (the cache grows inside a forward),
# ending with a copy of its start: lookup proposes the copy's continuation, which the model's own
# greedy text leaves after a token or two, so most proposals are rejected and rolled back.
_RANDOM = [(i * 97 + 13) % 241 + 3 for i in range(150)]
REJECTED_PROMPTS = [_RANDOM + _RANDOM[:12], SPEC_PROMPTS[0]]
DRAFT = {"draft": "self", "speculative_tokens": 4}


@pytest.mark.parametrize(
    ("mode", "spec"),
    [(mode, spec) for spec in ({"lookup": 3}, DRAFT) for mode in ("tp2", "pp2")],
    ids=["tp2-lookup", "pp2-lookup", "tp2-draft", "pp2-draft"],
)
def test_rejected_proposals_under_parallelism_give_one_process_tokens(
    tiny_ckpt_factory: Callable[..., Path], mode: str, spec: dict[str, Any]
) -> None:
    """Deterministic mode, proposals partly rejected (each rejection rolls every rank's KV slots
    back): each rank returns the greedy tokens one process gives without speculation."""
    stats = _speculate_under_parallelism(tiny_ckpt_factory("llama"), mode, spec, REJECTED_PROMPTS)
    assert stats["spec_passes"] > 0 and stats["spec_proposed"] > stats["spec_accepted"]  # some rejected


def test_a_kv_operation_failing_on_one_rank_is_a_divergence(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """Rank 1's KV slots refuse an operation rank 0's made (a planted failure): rank 1 raises
    `DivergenceError` naming the operation and both outcomes, and rank 0's user gets that same
    error, naming rank 1 (not a silence seen from rank 0), instead of either going on with slots
    that differ."""
    path = tiny_ckpt_factory("llama")
    args = {"path": str(path), "tp": 2, "pp": 1, "spec": {}, "prompts": SPEC_PROMPTS, "new": 8}
    args["diverge"] = True
    results = run_ranks(2, args, timeout=120, child=SPEC_CHILD)
    print([r.get("error") for r in results])
    kind, message = results[1]["error"]
    assert kind == "DivergenceError" and "SetBound(row=0" in message
    assert "failed on rank 1 (RuntimeError: planted: rank 1 refuses the bound)" in message
    assert "went through on rank 0" in message
    assert "error" in results[0]
    kind0, message0 = results[0]["error"]
    assert kind0 == "RankFailedError" and "stopped answering" not in message0
    assert message0.startswith("rank 1 failed: DivergenceError: ") and message in message0


def _cli(
    args: list[str], stdin: str = "", ranks: int = 0, log_dir: Path | None = None, timeout: float = 240
) -> tuple[str, str]:
    """``infer ARGS`` in one process, or under torchrun with ``ranks`` processes logging under
    ``log_dir``: (stdout, stderr)."""
    launch = [sys.executable, "-m", "infer"]
    if ranks:
        assert log_dir is not None
        launch = [sys.executable, *torchrun(ranks, log_dir), "-m", "infer"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    try:
        proc = subprocess.run(
            [*launch, *args], input=stdin, capture_output=True, text=True, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"infer {args} did not finish within {timeout} s (a hang)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


@pytest.mark.parametrize("flag", ["--tensor-parallel", "--pipeline-parallel"])
def test_cli_under_torchrun_prints_once(
    tiny_ckpt_factory: Callable[..., Path], flag: str, tmp_path: Path
) -> None:
    """``torchrun --nproc-per-node 2 -m infer generate ... --tensor-parallel 2``: one copy of the text."""
    path = str(tiny_ckpt_factory("llama"))
    common = ["--dtype", "float32", "--max-new-tokens", "6", "--quiet"]
    one, _ = _cli(["generate", path, "Hello there", *common])
    two, _ = _cli(["generate", path, "Hello there", *common, flag, "2"], ranks=2, log_dir=tmp_path)
    print(f"one process: {one!r}\n2 ranks ({flag}): {two!r}")
    assert one.strip() and two == one
    chat_one, _ = _cli(["chat", path, *common], stdin="hi\nand more\n/exit\n")
    chat_two, _ = _cli(
        ["chat", path, *common, flag, "2"], stdin="hi\nand more\n/exit\n", ranks=2, log_dir=tmp_path
    )
    print(f"chat, one process: {chat_one!r}\nchat, 2 ranks: {chat_two!r}")
    assert chat_one.count("\n") == 2 and chat_two == chat_one  # two replies, printed once


def test_cli_lookup_under_tensor_parallelism_prints_one_process_text(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """``torchrun ... -m infer generate --deterministic --lookup 3 --tensor-parallel 2`` prints the
    text one process prints without speculation."""
    path = str(tiny_ckpt_factory("llama"))
    common = ["--dtype", "float32", "--max-new-tokens", "24", "--quiet", "--deterministic", "--raw"]
    one, _ = _cli(["generate", path, "abcabcabcab", *common])
    two, _ = _cli(["generate", path, "abcabcabcab", *common, "--lookup", "3", "--tensor-parallel", "2"],
                  ranks=2, log_dir=tmp_path)  # fmt: skip
    print(f"one process: {one!r}\n2 ranks with lookup: {two!r}")
    assert one.strip() and two == one


PLANTED = """
import os
if os.environ.get("RANK") == "1":  # rank 1's KV slots refuse the first bound rank 0 sets
    from infer.kv import KVSlots
    from infer.kv.ops import SetBound

    apply = KVSlots.apply

    def refusing(self, op):
        if isinstance(op, SetBound) and op.bound > 0:
            raise RuntimeError("planted: rank 1 refuses the bound")
        apply(self, op)

    KVSlots.apply = refusing
"""


def test_cli_tells_a_followers_own_failure(tiny_ckpt_factory: Callable[..., Path], tmp_path: Path) -> None:
    """``torchrun ... -m infer generate --tensor-parallel 2`` where rank 1 diverges (a planted
    failure, through a ``sitecustomize`` on its path): the user reads rank 1's own error, with
    the operation, not that rank 1 went silent."""
    (tmp_path / "plant").mkdir()
    (tmp_path / "plant" / "sitecustomize.py").write_text(PLANTED)
    path = str(tiny_ckpt_factory("llama"))
    launch = [sys.executable, *torchrun(2, tmp_path / "logs"), "-m", "infer"]
    args = ["generate", path, "Hello there", "--dtype", "float32", "--max-new-tokens", "6"]
    args += ["--tensor-parallel", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{tmp_path / 'plant'}{os.pathsep}{SRC}"}
    try:
        proc = subprocess.run([*launch, *args], capture_output=True, text=True, env=env, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("infer under torchrun did not finish within 240 s (a hang)")
    told = [line for line in proc.stderr.splitlines() if line.startswith("infer:")]
    print("\n".join(told))
    assert proc.returncode != 0
    assert told, proc.stderr[-3000:]
    diverged = "rank 1 failed: DivergenceError: rank 1's KV slots diverged from rank 0's at SetBound(row=0"
    assert diverged in told[0]
    assert "planted: rank 1 refuses the bound" in told[0]
    assert not any("stopped answering" in line for line in told)
