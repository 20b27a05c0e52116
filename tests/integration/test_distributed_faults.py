"""A rank that stops mid-generation: every other rank fails within the timeout, naming it.

Two ranks over gloo, spawned by the test with a process group of a 3 s timeout (the
configured one: infer's subgroups must carry it, not gloo's 30 min default). Once both have
finished a generation (each says so), the test kills (SIGKILL) or freezes (SIGSTOP) one rank;
the other must raise an error naming the rank that stopped answering within the timeout plus a
few seconds, and then exit non-zero. Each case is bounded: a survivor that has not raised in
time, or has not exited `EXIT_S` after raising (its interpreter's teardown, slow on a busy
machine), is a hang.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rank_env import free_port, rank_env, torchrun

pytestmark = pytest.mark.slow

SRC = Path(__file__).resolve().parents[2] / "src"

TIMEOUT_S = 3
GRACE_S = 12  # the timeout plus this: the survivor must have raised (its error naming the stopped rank)
EXIT_S = 60  # ... and must have exited this long after it raised

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
    llm.generate([5, 17, 42, 99], max_new_tokens=16)
    print("GENERATED", flush=True)  # from here on, this rank generates until it fails
    while True:
        llm.generate([5, 17, 42, 99], max_new_tokens=16)
except Exception as e:
    print(f"ERROR {type(e).__name__}: {e}", flush=True)
    sys.exit(1)
"""


class Output:
    """A child's stdout, line by line as it comes (with the time each came), and its stderr;
    both read by threads, so neither pipe fills while the test waits."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        out, err = proc.stdout, proc.stderr
        threading.Thread(target=self._read, args=(out,), daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(err), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.stdout.append(line)
            self.lines.put((time.monotonic(), line))
        self.lines.put((time.monotonic(), ""))  # end of output

    def wait_for(self, prefix: str, deadline: float, what: str) -> tuple[float, str]:
        """The first line starting with ``prefix`` and when it came; fails at ``deadline`` or
        when the output ends first."""
        while (left := deadline - time.monotonic()) > 0:
            try:
                at, line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line.startswith(prefix):
                return at, line
            if not line:
                self.proc.wait()
                pytest.fail(f"{what}: exited {self.proc.returncode} first\n{self.text()}")
        pytest.fail(f"{what}: not within the time allowed\n{self.text()}")

    def text(self) -> str:
        return ("".join(self.stdout) + "".join(self.stderr)[-2000:]).strip()


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
        outputs = [Output(proc) for proc in procs]
        deadline = time.monotonic() + 180
        for rank, output in enumerate(outputs):  # both in their generation loop
            output.wait_for("GENERATED", deadline, f"rank {rank} loading and generating once")
        os.kill(procs[victim].pid, getattr(signal, sig))
        start = time.monotonic()
        survivor = outputs[1 - victim]
        at, error = survivor.wait_for(
            "ERROR", start + TIMEOUT_S + GRACE_S, f"rank {1 - victim} raising after rank {victim} stopped"
        )
        try:
            survivor.proc.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {1 - victim} raised, then still ran {EXIT_S} s\n{survivor.text()}")
        took, exited = at - start, time.monotonic() - start
        print(f"{mode} {sig} rank {victim}: the other raised after {took:.1f} s, exited after {exited:.1f} s")
        print(error.strip()[-600:])
        assert survivor.proc.returncode != 0
        assert error.startswith(f"ERROR RankFailedError: rank {victim} stopped answering"), survivor.text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


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
