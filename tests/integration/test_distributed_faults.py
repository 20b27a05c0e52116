"""A rank that stops mid-generation: every other rank fails within the timeout, naming it.

Two ranks over gloo, spawned by the test with a process group of a 3 s timeout (the
configured one: infer's subgroups must carry it, not gloo's 30 min default). Once both
generate, the test kills (SIGKILL) or freezes (SIGSTOP) one rank; the other must exit
non-zero within the timeout plus a few seconds, with an error naming the rank that
stopped answering. Each case is bounded: a survivor still running after that is a hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rank_env import free_port, rank_env, torchrun

pytestmark = pytest.mark.slow

SRC = Path(__file__).resolve().parents[2] / "src"

TIMEOUT_S = 3
GRACE_S = 12  # the timeout plus this: the survivor must be gone (its error named the stopped rank)

CHILD = r"""
import datetime, json, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
args = json.loads(sys.argv[1])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args["timeout"]))
import infer
llm = infer.load(args["path"], dtype="float32", tensor_parallel=args["tp"], pipeline_parallel=args["pp"])
print("READY", flush=True)
try:
    while True:
        llm.generate([5, 17, 42, 99], max_new_tokens=16)
except Exception as e:
    print(f"ERROR {type(e).__name__}: {e}", flush=True)
    sys.exit(1)
"""


def _wait_ready(proc: subprocess.Popen[str], deadline: float) -> None:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("READY"):
            return
        if not line and proc.poll() is not None:
            pytest.fail(f"a rank exited with {proc.returncode} before generating")
    pytest.fail("a rank did not load within the time allowed")


@pytest.mark.parametrize(
    ("mode", "sig", "victim"),
    [("tp2", "SIGKILL", 1), ("tp2", "SIGSTOP", 1), ("pp2", "SIGSTOP", 0), ("pp2", "SIGKILL", 0)],
)
def test_a_stopped_rank_fails_the_others_in_time(
    tiny_ckpt_factory: Callable[..., Path], mode: str, sig: str, victim: int
) -> None:
    path = tiny_ckpt_factory("llama")
    tp, pp = (2, 1) if mode == "tp2" else (1, 2)
    args = {"path": str(path), "tp": tp, "pp": pp, "timeout": TIMEOUT_S}
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(args)],
            env=rank_env(rank, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        deadline = time.monotonic() + 180
        for proc in procs:
            _wait_ready(proc, deadline)
        time.sleep(0.5)  # both ranks in the middle of a generation
        os.kill(procs[victim].pid, getattr(signal, sig))
        survivor = procs[1 - victim]
        start = time.monotonic()
        try:
            stdout, stderr = survivor.communicate(timeout=TIMEOUT_S + GRACE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {1 - victim} still waits {TIMEOUT_S + GRACE_S} s after rank {victim} stopped")
        took = time.monotonic() - start
        print(f"{mode} {sig} rank {victim}: the other exited {survivor.returncode} after {took:.1f} s")
        print(stdout.strip()[-600:])
        assert survivor.returncode != 0
        assert f"ERROR RankFailedError: rank {victim} stopped answering" in stdout, stdout + stderr[-2000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


GROUP_TIMEOUT = r"""
import os, infer.distributed.runtime as rt, torch
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
p = rt.setup(1, 1, torch.device("cpu"), timeout_s=7.0)
print(rt.group_timeout(p.tp_group), rt.group_timeout(p.column_group))
"""


def test_every_group_carries_the_timeout() -> None:
    env = {**rank_env(0, 1, free_port()), "PORT": str(free_port())}
    proc = subprocess.run(
        [sys.executable, "-c", GROUP_TIMEOUT], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["7.0", "7.0"]


def test_rank_0_dies_under_torchrun(tiny_ckpt_factory: Callable[..., Path], tmp_path: Path) -> None:
    """`torchrun ... infer generate`: rank 0 killed mid-generation; rank 1 says so in one line."""
    path = str(tiny_ckpt_factory("llama"))
    argv = ["generate", path, "Hello", "--max-new-tokens", "2000", "--tensor-parallel", "2", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(
        [sys.executable, *torchrun(2, tmp_path), "-m", "infer", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.read(1)  # rank 0 is generating
        ranks = {}
        for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next(e for e in environ if e.startswith(b"RANK=")).removeprefix(b"RANK=")
            ranks[int(rank)] = int(pid)
        os.kill(ranks[0], signal.SIGKILL)
        try:
            _, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("torchrun still runs 60 s after rank 0 was killed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    ours = [line for line in stderr.splitlines() if line.startswith("infer:")]
    print("\n".join(ours))
    assert proc.returncode != 0
    assert len(ours) == 1 and ours[0].startswith("infer: rank 1: ") and "rank 0 stopped answering" in ours[0]
