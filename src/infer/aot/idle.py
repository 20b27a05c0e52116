"""Run a command only while the rest of the machine leaves the CPUs idle.

A background build at low priority still stalls torch's OpenMP steps (docs/performance.md), so
`run_when_idle` (``python -m infer.aot.idle -- COMMAND...``) stops the command's process group
while other processes keep more than `busy_limit` CPUs busy and continues it after `QUIET_S` of
quiet; `wait_until_idle` waits for such a gap. Linux only (elsewhere the command just runs);
details: docs/engine.md, "Compiled steps".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO

POLL_S = 0.2  # how often the CPUs are looked at
QUIET_S = 1.0  # how long the rest of the machine stays under the limit before the command goes on
GIVE_UP_S = 4 * 3600.0  # wall time after which the command is killed (a machine never idle)


def busy_limit(cpus: int) -> float:
    """CPUs other processes may keep busy while the command runs: it needs one of its own and
    half of one to spare (2 CPUs: 0.5, i.e. anything beyond background noise stops it).
    ``INFER_BUILD_WHEN_BUSY=1`` lifts the limit (the command always runs): for a machine that is
    never idle but whose work should not wait for builds, a CI job's say."""
    if os.environ.get("INFER_BUILD_WHEN_BUSY", "").strip() == "1":
        return float(cpus)
    return max(0.25, cpus - 1.5)


def cpu_ticks(cpus: set[int]) -> tuple[int, int]:
    """``(busy, total)`` clock ticks of these CPUs since boot (``/proc/stat``): busy is user,
    nice, system, irq and softirq time; total adds idle, iowait and steal."""
    busy = total = 0
    with open("/proc/stat") as f:
        for line in f:
            name = line.split(maxsplit=1)[0]
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                continue
            # user nice system idle iowait irq softirq steal
            ticks = [int(v) for v in line.split()[1:9]]
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4] - ticks[7]
    return busy, total


_CHILDREN_LISTED = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (``/proc/PID/task/TID/children``)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        with contextlib.suppress(OSError):  # ended meanwhile
            for tid in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
    return found


def group_ticks(pgid: int) -> int:
    """CPU clock ticks of the processes in group `pgid`, their reaped children included."""
    pids: list[int] | list[str]
    if _CHILDREN_LISTED:  # the group's leader and what runs below it
        pids = _descendants(pgid)
    else:  # a kernel without CONFIG_PROC_CHILDREN: every process (~1.5 ms for 70)
        pids = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:  # the process ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on
        if int(fields[2]) == pgid:  # field 5: pgrp
            ticks += sum(int(v) for v in fields[11:15])  # fields 14-17: utime stime cutime cstime
    return ticks


class Watch:
    """Whether a command may run now, from successive samples of the CPUs (`sample`)."""

    def __init__(self, cpus: set[int], quiet_s: float = QUIET_S) -> None:
        self.cpus = cpus
        self.limit = busy_limit(len(cpus))
        self.quiet_s = quiet_s
        self.quiet_since = time.monotonic() - quiet_s  # may run at once, until a sample says otherwise
        self._last: tuple[int, int, int] | None = None

    def elsewhere(self, busy: int, total: int, own: int) -> float | None:
        """CPUs kept busy by other processes since the last sample (None at the first)."""
        last, self._last = self._last, (busy, total, own)
        if last is None or total <= last[1]:
            return None
        return max(0, (busy - last[0]) - (own - last[2])) * len(self.cpus) / (total - last[1])

    def may_run(self, elsewhere: float | None, now: float) -> bool:
        if elsewhere is not None and elsewhere > self.limit:
            self.quiet_since = now
        return now - self.quiet_since >= self.quiet_s

    def sample(self, pgid: int, now: float, stopped: bool = False) -> bool:
        """One look at the CPUs. A stopped group's ticks are not read again (they cannot have
        grown), so while the user's work runs the watcher reads ``/proc/stat`` only."""
        own = self._last[2] if stopped and self._last is not None else group_ticks(pgid)
        return self.may_run(self.elsewhere(*cpu_ticks(self.cpus), own), now)


def _die_with_parent() -> None:
    """In the child, before exec: be killed (``SIGKILL``) when the watcher dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def linux() -> bool:
    """Whether the CPUs can be watched (``/proc/stat``)."""
    return sys.platform.startswith("linux") and os.path.exists("/proc/stat")


def wait_until_idle(deadline: float | None = None, quiet_s: float = QUIET_S) -> bool:
    """Return once other processes have kept at most `busy_limit` CPUs busy for ``quiet_s``
    seconds (True), or at ``deadline`` (`time.monotonic`) if that never happens (False).
    Elsewhere than on Linux: True at once."""
    if not linux():
        return True
    watch = Watch(os.sched_getaffinity(0), quiet_s)
    watch.quiet_since = time.monotonic()  # quiet must be seen, not assumed
    watch.elsewhere(*cpu_ticks(watch.cpus), 0)
    while True:
        time.sleep(POLL_S)
        now = time.monotonic()
        if watch.may_run(watch.elsewhere(*cpu_ticks(watch.cpus), 0), now):
            return True
        if deadline is not None and now >= deadline:
            return False


def run_when_idle(
    command: Sequence[str], stdout: IO[bytes] | None = None, max_stopped_s: float | None = None
) -> int | None:
    """Run `command` in its own process group, stopped whenever the machine is busy
    elsewhere; its exit status (negative: the signal that ended it), or None when it was
    killed for staying stopped longer than ``max_stopped_s`` seconds at a stretch."""
    on_linux = linux()
    proc = subprocess.Popen(
        list(command), stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.STDOUT,
        process_group=0, preexec_fn=_die_with_parent if on_linux else None,
    )  # fmt: skip
    if not on_linux:
        return proc.wait()
    watch = Watch(os.sched_getaffinity(0))
    running, start = True, time.monotonic()
    stopped_at = start
    stopped_too_long = False
    try:
        watch.sample(proc.pid, start)
        while proc.poll() is None:
            time.sleep(POLL_S)
            now = time.monotonic()
            if now - start > GIVE_UP_S:
                break
            if not running and max_stopped_s is not None and now - stopped_at > max_stopped_s:
                stopped_too_long = True
                break
            may_run = watch.sample(proc.pid, now, stopped=not running)
            if may_run != running:
                os.killpg(proc.pid, signal.SIGCONT if may_run else signal.SIGSTOP)
                running, stopped_at = may_run, now
    finally:
        if proc.poll() is None:  # given up, stopped too long, or the watcher was interrupted
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
    status = proc.wait()
    return None if stopped_too_long else status


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m infer.aot.idle -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    status = run_when_idle(argv)
    return 124 if status is None else status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
