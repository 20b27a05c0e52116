"""The background builder of a package cache directory: one at most, fed by a queue.

`submit` queues build requests (``DIR/queue/KEY.json``, newest submission built first) and starts
``python -m infer.aot.builder DIR`` when no builder holds ``DIR/builder.lock``; the builder runs one
worker at a time on the machine (`run_lock`), only while the machine is idle (`infer.aot.idle`),
and drops stale requests. It never imports torch. Policy and bounds: docs/engine.md,
"Compiled steps"; `temporary` says which checkpoints are not queued unless asked.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from infer.aot import idle

QUEUE = "queue"  # the requests, one JSON file per package key
LOCK = "builder.lock"  # held by the directory's builder while it lives
LOG = "builder.log"  # what the builder did with each request
RUN_LOCK: Path | None = None  # the machine-wide build lock (None: `default_run_lock()`)
STOP_LIMIT_S = 25.0  # a worker stopped (the machine busy) this long at a stretch is killed, its request kept
MAX_TRIES = 5  # workers killed for one request before the builder drops it
RETRY_QUIET_S = (1.0, 5.0, 15.0, 30.0, 60.0)  # quiet a request's next worker waits for, by workers killed
WAIT_LIMIT_S = 6 * 3600.0  # a builder that gets no turn or no idle moment for this long exits
LOG_BYTES = 1 << 20
COMPILER_BYTES = 2 << 30  # what AOTInductor's lowering and the C++ compiler take, with room
WEIGHT_SUFFIXES = (".safetensors", ".gguf")
TILE_PREFIX = "tile-"  # the keys of dequantized tiles' kernels (`infer.aot.tiles`): built after steps


# ---- checkpoints ---------------------------------------------------------------------------


def checkpoint_files(path: str | Path) -> list[list[Any]]:
    """``[name, size, mtime_ns]`` of the files of the checkpoint at ``path`` that a package
    depends on (a GGUF file; a directory's ``config.json`` and weight files), sorted. An
    unreadable path gives what could be read (a request for it is then dropped as changed)."""
    path = Path(path)
    files: list[Path] = []
    if path.is_dir():
        with contextlib.suppress(OSError):
            files = [p for p in path.iterdir() if p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES)]
    else:
        files = [path]
    out = []
    for file in sorted(files):
        with contextlib.suppress(OSError):
            st = file.stat()
            out.append([str(file), st.st_size, st.st_mtime_ns])
    return out


def _temp_roots() -> list[Path]:
    roots = {Path(tempfile.gettempdir()), Path("/tmp"), Path("/dev/shm")}
    out = []
    for root in roots:
        with contextlib.suppress(OSError):
            out.append(root.resolve())
    return out


def temporary(path: str | Path) -> bool:
    """Whether ``path`` is a temporary or test checkpoint: under the temporary directory
    (``tempfile.gettempdir()``, ``/tmp``, ``/dev/shm``), under a pytest temporary directory
    (a ``pytest-of-USER`` component), or loaded by a process that pytest runs
    (``PYTEST_CURRENT_TEST`` set, as in the processes a test starts)."""
    if os.environ.get("PYTEST_CURRENT_TEST"):
        return True
    try:
        resolved = Path(path).resolve()
    except OSError:
        return True
    if any(part.startswith("pytest-of-") for part in resolved.parts):
        return True
    return any(resolved.is_relative_to(root) for root in _temp_roots())


def source_digest() -> str:
    """The hash of infer's source as it is on disk now (every ``*.py`` of the package)."""
    root = Path(__file__).parents[1]  # the infer package (this file is infer/aot/builder.py)
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def stale(request: dict[str, Any]) -> str | None:
    """Why ``request`` should not be built (None: build it)."""
    out = Path(request["out"])
    if out.exists():
        return "built already"
    if out.with_suffix(".failed").exists():
        return "an earlier build failed (see its .failed marker)"
    source = request.get("source")
    if source is not None and source != source_digest():
        # The worker would build from today's source a package of another fingerprint: the key
        # asked for is never built (an upgrade or an edit of infer since the request).
        return "infer's source changed since the request"
    if "tile" in request:
        return None  # a tile kernel (`infer.aot.tiles`) depends on no checkpoint
    recorded = request.get("files")
    if not recorded:
        return "the request names no checkpoint file"
    now = checkpoint_files(request["recipe"]["path"])
    if now == recorded:
        return None
    present = {name for name, _, _ in now}
    gone = [name for name, _, _ in recorded if name not in present]
    if gone:
        return f"the checkpoint's file {gone[0]} is gone"
    return f"the checkpoint at {request['recipe']['path']} changed since the request"


def enough_memory(checkpoint: Path | None) -> bool:
    """Whether the machine has the memory for the worker's copy of the model (None: no model, a
    tile kernel's build) and the compiler (``MemAvailable`` >= checkpoint bytes + `COMPILER_BYTES`);
    true where it cannot tell."""
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        available = int(next(line for line in meminfo if line.startswith("MemAvailable:")).split()[1])
        if checkpoint is None:
            files = []
        else:
            files = [checkpoint] if checkpoint.is_file() else list(checkpoint.rglob("*"))
        size = sum(f.stat().st_size for f in files if f.is_file())
    except (OSError, StopIteration, ValueError):
        return True
    return available * 1024 >= size + COMPILER_BYTES


# ---- locks ---------------------------------------------------------------------------------


def _try_lock(path: Path, patience_s: float = 0.0) -> int | None:
    """An open descriptor holding an exclusive ``flock`` on ``path``, or None when another
    process holds it for ``patience_s`` (a probe holds it for microseconds: patience rides it out)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    deadline = time.monotonic() + patience_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError:
            left = deadline - time.monotonic()
            if left <= 0:
                os.close(fd)
                return None
            time.sleep(min(0.005, left))


def _held(path: Path) -> bool:
    """Whether a process holds ``path``'s ``flock`` (probed: taken and released at once)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def default_run_lock() -> Path:
    return Path(tempfile.gettempdir()) / "infer-aot-build.lock"


def _open_shared(path: Path) -> int:
    """A descriptor of the machine-wide lock file, readable by every user (``flock`` needs no
    write access); a per-user file beside it where another user's file cannot be opened."""
    for candidate in (path, path.with_name(f"{path.stem}-{os.getuid()}{path.suffix}")):
        try:
            return os.open(candidate, os.O_RDONLY)  # never O_CREAT on another user's file (protected_regular)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                fd = os.open(candidate, os.O_CREAT | os.O_EXCL | os.O_RDONLY, 0o644)
                with contextlib.suppress(OSError):
                    os.fchmod(fd, 0o644)  # whatever the umask: others may open it to wait their turn
                return fd
            with contextlib.suppress(OSError):
                return os.open(candidate, os.O_RDONLY)
        except PermissionError:
            continue
    raise PermissionError(f"cannot open the build lock {path} or a per-user one beside it")


@contextlib.contextmanager
def _turn(run_lock: Path, deadline: float) -> Iterator[bool]:
    """Hold the machine-wide build lock for the duration (True), waiting for it until
    ``deadline``; False if it was not had by then."""
    fd = _open_shared(run_lock)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(1.0)
        yield True
    finally:
        os.close(fd)


# ---- the queue (what processes that noted missing shapes call) -----------------------------


def queue_dir(directory: Path) -> Path:
    return directory / QUEUE


def queued(directory: Path) -> list[str]:
    """The keys of the requests in ``directory``'s queue."""
    return sorted(key for key, _ in _listing(directory))


def _listing(directory: Path) -> set[tuple[str, int]]:
    """``(key, mtime_ns)`` of each request queued (a request queued again has a new time)."""
    out = set()
    with contextlib.suppress(OSError):
        for path in queue_dir(directory).glob("*.json"):
            with contextlib.suppress(OSError):
                out.add((path.stem, path.stat().st_mtime_ns))
    return out


def running(directory: Path) -> bool:
    """Whether a builder holds ``directory``'s builder lock."""
    return _held(directory / LOCK)


def pending(directory: Path) -> list[str]:
    """The keys a live builder of ``directory`` has yet to build or is building ([] when no
    builder lives: nothing is under way)."""
    return queued(directory) if running(directory) else []


def add(directory: Path, requests: list[dict[str, Any]]) -> None:
    """Queue ``requests`` (each with a ``key``), each written whole then renamed into place,
    ahead of what is queued already and in their order (docs/engine.md, *Compiled steps*)."""
    q = queue_dir(directory)
    q.mkdir(parents=True, exist_ok=True)
    now = time.time_ns()
    for i, request in enumerate(requests):
        tmp = q / f".{request['key']}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(request))
        os.utime(tmp, ns=(now, now - i))
        os.replace(tmp, q / f"{request['key']}.json")


def start(directory: Path) -> subprocess.Popen[bytes] | None:
    """Start ``directory``'s builder unless one holds its lock (it takes what is queued: it
    looks at the queue after releasing the lock). None when one lives."""
    fd = _try_lock(directory / LOCK, patience_s=0.002)  # a builder holds it for long, a probe for µs
    if fd is None:
        return None
    run_lock = RUN_LOCK if RUN_LOCK is not None else default_run_lock()
    argv = [sys.executable, "-m", "infer.aot.builder", str(directory), "--run-lock", str(run_lock)]
    argv += ["--lock-fd", str(fd)]
    try:  # the builder inherits the locked descriptor: the lock is held from here on, no gap in
        # which a second producer (the builder still importing) would start a second builder
        with open(directory / LOG, "ab") as log:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(fd,),
                start_new_session=True,  # outlives the process that queued; a Ctrl-C there does not reach it
            )
    finally:
        os.close(fd)  # this process's copy: the builder's keeps the lock


def submit(directory: Path, requests: list[dict[str, Any]]) -> subprocess.Popen[bytes] | None:
    """Queue ``requests`` and make sure a builder will take them: the builder started, or None
    when one lives already (or nothing was asked)."""
    if not requests:
        return None
    add(directory, requests)
    return start(directory)


# ---- the builder ---------------------------------------------------------------------------


class Builder:
    """The builder of one directory (``python -m infer.aot.builder DIR``): `run` takes the queue."""

    def __init__(self, directory: Path, run_lock: Path) -> None:
        self.directory = directory
        self.run_lock = run_lock
        self.tries: dict[str, int] = {}  # key -> workers killed for it (stopped too long)

    def say(self, message: str) -> None:
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [{os.getpid()}] {message}", flush=True)

    def next(self) -> tuple[Path, dict[str, Any]] | None:
        """The next request worth building, newest submission first (stale ones are dropped on
        the way), or None. Decode steps go before dequantized tiles (every token waits on a step,
        only a prompt on a tile: `TILE_PREFIX`); a request whose workers were killed goes behind
        the others."""
        files = []
        for path in queue_dir(self.directory).glob("*.json"):
            with contextlib.suppress(OSError):
                tile = path.stem.startswith(TILE_PREFIX)
                files.append((self.tries.get(path.stem, 0), tile, -path.stat().st_mtime_ns, path))
        for *_, path in sorted(files):
            request = self.read(path)
            if request is not None:
                return path, request
        return None

    def read(self, path: Path) -> dict[str, Any] | None:
        """The request in ``path`` if it is to be built; a stale or unreadable one is dropped."""
        try:
            request = json.loads(path.read_text())
            reason = stale(request)
        except FileNotFoundError:
            return None  # taken meanwhile
        except (OSError, ValueError, KeyError, TypeError) as e:
            reason = f"unreadable request ({type(e).__name__}: {e})"
        if reason is None:
            return dict(request)
        self.drop(path, reason)
        return None

    def drop(self, path: Path, reason: str) -> None:
        self.say(f"dropped {path.stem}: {reason}")
        with contextlib.suppress(OSError):
            path.unlink()

    def run(self, lock_fd: int | None = None) -> int:
        """Take the queue; ``lock_fd``: the directory's lock, already held (inherited from `start`)."""
        lock = lock_fd if lock_fd is not None else _try_lock(self.directory / LOCK, patience_s=1.0)
        if lock is None:
            return 0  # another builder lives: it takes the queue
        with contextlib.suppress(OSError):
            if (self.directory / LOG).stat().st_size > LOG_BYTES:
                os.truncate(self.directory / LOG, 0)
        self.say(f"builder of {self.directory} started")
        deadline = time.monotonic() + WAIT_LIMIT_S
        left: set[tuple[str, int]] | None = None  # what the last look found and could not take
        while True:
            picked = self.next()
            if picked is None:
                os.close(lock)  # from here on, a process that queues starts a builder itself...
                now = _listing(self.directory)  # ... and one that queued before this look is seen here
                if not now or now == left:  # (the same requests again: ones it cannot remove)
                    self.say("queue empty: builder exits")
                    return 0
                left = now
                lock = _try_lock(self.directory / LOCK, patience_s=1.0)
                if lock is None:
                    return 0  # a new builder took over
                continue
            if not self.build(*picked, deadline):
                self.say(f"no turn or no idle moment in {WAIT_LIMIT_S:.0f} s: builder exits, the queue stays")
                return 0
            deadline = time.monotonic() + WAIT_LIMIT_S

    def build(self, path: Path, request: dict[str, Any], deadline: float) -> bool:
        """Build ``request`` (queued at ``path``), or what goes ahead of it once the wait is over
        (`next`), in a worker, in turn and in idle time; False when ``deadline`` passed waiting
        for either."""
        key = path.stem
        with _turn(self.run_lock, deadline) as turn:
            quiet_s = RETRY_QUIET_S[min(self.tries.get(key, 0), len(RETRY_QUIET_S) - 1)]
            if not turn or not idle.wait_until_idle(deadline, quiet_s):
                return False
            # Looked at again: it may have changed while this waited, and what was queued meanwhile
            # may go first (a prompt queues its tiles before its first decode step queues the step).
            latest = self.next()
            if latest is None:
                return True
            path, request = latest
            key = path.stem
            checkpoint = Path(request["recipe"]["path"]) if "recipe" in request else None
            if not enough_memory(checkpoint):
                self.drop(path, "too little memory available now (a later process asks again)")
                return True
            t0 = time.monotonic()
            self.say(f"building {key}")
            worker = [sys.executable, "-m", "infer.aot", json.dumps(request)]
            with open(Path(request["out"]).with_suffix(".log"), "wb") as log:
                status = idle.run_when_idle(worker, stdout=log, max_stopped_s=STOP_LIMIT_S)
        if status is None:
            self.tries[key] = tries = self.tries.get(key, 0) + 1
            if tries >= MAX_TRIES:
                self.drop(path, f"stopped over {STOP_LIMIT_S:.0f} s {tries} times (the machine stays busy)")
            else:
                self.say(f"{key}: stopped for over {STOP_LIMIT_S:.0f} s, killed; kept for another try")
            return True
        outcome = "built" if status == 0 else f"failed (status {status}; see {key}.log)"
        self.say(f"{key}: {outcome} after {time.monotonic() - t0:.1f} s")
        with contextlib.suppress(OSError):
            path.unlink()
        return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infer.aot.builder", description="Build a package queue.")
    parser.add_argument("directory", type=Path, help="the package cache directory whose queue to build")
    parser.add_argument("--run-lock", type=Path, default=None, help="the machine-wide build lock")
    parser.add_argument("--lock-fd", type=int, default=None, help="the directory's lock, held (from `start`)")
    args = parser.parse_args(argv)
    return Builder(args.directory, args.run_lock or default_run_lock()).run(args.lock_fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = [
    "MAX_TRIES", "STOP_LIMIT_S", "WAIT_LIMIT_S", "add", "checkpoint_files", "pending", "queued", "running",
    "stale", "start", "submit", "temporary",
]  # fmt: skip
