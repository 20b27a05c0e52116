"""`infer.aot.idle`: a command runs only while the rest of the machine leaves the CPUs idle."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infer.aot import idle


def test_the_watch_stops_on_load_elsewhere_and_waits_for_quiet() -> None:
    watch = idle.Watch({0, 1})
    t = time.monotonic()
    assert watch.limit == 0.5  # 2 CPUs: anything beyond background noise
    assert watch.may_run(None, t)  # nothing known yet: run
    assert not watch.may_run(1.8, t + 10)  # another process keeps the CPUs busy: stop
    assert not watch.may_run(0.1, t + 10 + idle.QUIET_S / 2)  # quiet, not for long enough
    assert watch.may_run(0.1, t + 10 + idle.QUIET_S)  # quiet for QUIET_S: go on
    assert idle.busy_limit(16) == 14.5 and idle.busy_limit(1) == 0.25


def test_the_commands_own_cpu_time_is_not_load_elsewhere() -> None:
    watch = idle.Watch({0, 1})
    assert watch.elsewhere(busy=100, total=1000, own=40) is None  # the first sample
    # 200 ticks over 2 CPUs (100 each), 120 busy of which 110 the command's: 10 ticks, 0.1 CPU elsewhere
    assert watch.elsewhere(busy=220, total=1200, own=150) == pytest.approx(0.1)


def test_group_ticks_counts_the_group() -> None:
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    proc = subprocess.Popen([sys.executable, "-c", spin], process_group=0)
    proc.wait(30)
    assert idle.group_ticks(proc.pid) == 0  # reaped: gone from /proc
    child = subprocess.Popen([sys.executable, "-c", spin + "time.sleep(30)"], process_group=0)
    try:
        deadline = time.monotonic() + 20
        while idle.group_ticks(child.pid) < 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert idle.group_ticks(child.pid) >= 20  # 0.3 s of CPU: ~30 ticks at 100 Hz
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_a_command_stops_while_other_processes_keep_the_cpus_busy(tmp_path: Path) -> None:
    """The command writes the time every 50 ms; for 2 s, one spinning process per CPU keeps the
    machine busy: the command's clock shows a gap of at least 1 s (more on a machine busy with
    other work too: it may only run when idle). Killing the watcher kills the command."""
    log = tmp_path / "ticks"
    ticker = (
        "import os, sys, time\nend = time.monotonic() + 120\n"
        "with open(sys.argv[1], 'w') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
        "    while time.monotonic() < end:\n"
        "        f.write(f'{time.monotonic()}\\n'); f.flush(); time.sleep(0.05)\n"
    )
    spin = "import time\nend = time.monotonic() + 2\nwhile time.monotonic() < end: pass\n"
    command = [sys.executable, "-c", ticker, str(log)]
    watcher = subprocess.Popen([sys.executable, "-m", "infer.aot.idle", "--", *command])
    try:
        time.sleep(1.0)
        spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in os.sched_getaffinity(0)]
        for s in spinners:
            s.wait(30)
        spun = time.monotonic()
        deadline = spun + 20
        while time.monotonic() < deadline and float(log.read_text().split()[-1]) < spun:
            time.sleep(0.1)  # until the command goes on (or 20 s: a machine busy elsewhere)
        ticks = [float(t) for t in log.read_text().split()[1:]] + [time.monotonic()]
    finally:
        watcher.kill()
        watcher.wait(10)
    gap = max(b - a for a, b in itertools.pairwise(ticks))
    print(f"\nlongest gap in the command's clock: {gap:.2f} s (spinners ran 2 s)")
    assert gap >= 1.0
    pid = int(log.read_text().split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the command outlived its watcher"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _spin_every_cpu(seconds: float) -> list[subprocess.Popen[bytes]]:
    spin = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in os.sched_getaffinity(0)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_a_command_stopped_too_long_is_killed() -> None:
    """While the machine is busy (a spinning process per CPU, 4 s), the command is stopped, and
    killed once stopped for ``max_stopped_s`` (1 s): None, and nothing of it left."""
    spinners = _spin_every_cpu(4.0)
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        status = idle.run_when_idle([sys.executable, "-c", "import time; time.sleep(60)"], max_stopped_s=1.0)
        took = time.monotonic() - t0
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    print(f"\nkilled after {took:.1f} s")
    assert status is None
    assert took < 30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_waiting_for_idle_gives_up_at_the_deadline() -> None:
    spinners = _spin_every_cpu(3.0)
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        assert not idle.wait_until_idle(deadline=t0 + 1.0)
        assert time.monotonic() - t0 < 1.0 + 5 * idle.POLL_S
    finally:
        for s in spinners:
            s.kill()
            s.wait()
