"""`infer.aot.builder`: one builder per cache directory, fed by a queue, holding nothing while it waits.

The requests here name fake checkpoints (files of bytes): no test here builds a package, so
nothing imports torch but this process. A request the builder would really build waits for
its turn: the test holds the machine-wide build lock (pointed into ``tmp_path``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from infer.aot import builder, idle

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and flock")


@pytest.fixture
def run_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The machine-wide build lock of this test's builders (not the one real builders share)."""
    path = tmp_path / "run.lock"
    monkeypatch.setattr(builder, "RUN_LOCK", path)
    return path


@pytest.fixture
def turn_held(run_lock: Path) -> Iterator[Path]:
    """The build lock held by this test: a builder waits for its turn (as behind another build)."""
    fd = os.open(run_lock, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield run_lock
    finally:
        os.close(fd)


def _checkpoint(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(b"\0" * 1024)
    (directory / "README.md").write_text("not part of the model")
    return directory


def _request(cache: Path, checkpoint: Path, key: str) -> dict[str, Any]:
    return {"key": key, "out": str(cache / f"{key}.pt2"), "recipe": {"path": str(checkpoint)},
            "files": builder.checkpoint_files(checkpoint)}  # fmt: skip


def _builders(ours: Callable[[], list[int]]) -> list[int]:
    found = []
    for pid in ours():
        with contextlib.suppress(OSError):  # ended meanwhile
            if b"infer.aot.builder" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def _rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and every process below it."""
    total = 0
    for p in idle._descendants(pid):
        status = Path(f"/proc/{p}/status").read_text()
        total += int(status.split("VmRSS:")[1].split()[0]) * 1024
    return total


def test_the_builder_and_the_watcher_import_no_torch() -> None:
    imports = "import sys, infer.aot.builder, infer.aot.idle"
    code = imports + "; print(sorted(m for m in sys.modules if 'torch' in m))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_temporary_and_test_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    assert builder.temporary(tmp_path / "model.gguf")  # pytest's tmp_path: under the temporary directory
    assert builder.temporary("/tmp/model.gguf")
    assert builder.temporary("/home/me/pytest-of-me/pytest-3/test_x0/model.gguf")
    home = Path.home() / "models" / "model.gguf"
    assert not builder.temporary(home)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_x.py::test_y (call)")
    assert builder.temporary(home)  # a process that pytest runs: a test's checkpoint


def test_checkpoint_files_are_the_model_files(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    names = [Path(name).name for name, _, _ in builder.checkpoint_files(ckpt)]
    assert names == ["config.json", "model.safetensors"]  # not the README
    assert builder.checkpoint_files(tmp_path / "gone") == []


def test_a_request_whose_checkpoint_is_gone_or_changed_is_dropped(
    tmp_path: Path, run_lock: Path, reap_processes: Callable[[], list[int]]
) -> None:
    """The builder drops them, and those queued by another version of infer's source, without a
    worker: no ``.failed`` marker, no build log, a line in its log saying why; then it exits (its
    queue is empty)."""
    cache = tmp_path / "aot"
    names = ("gone", "changed", "touched", "other-source")
    gone, changed, touched, other = (_checkpoint(tmp_path / name) for name in names)
    requests = [_request(cache, ckpt, f"key-{ckpt.name}") for ckpt in (gone, changed, touched, other)]
    requests[-1]["source"] = "0" * 64  # queued by another version of infer (an upgrade, an edit)
    assert builder.stale({**requests[-1], "source": builder.source_digest()}) is None
    (gone / "model.safetensors").unlink()
    (changed / "model.safetensors").write_bytes(b"\1" * 2048)
    st = (touched / "config.json").stat()
    os.utime(touched / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # same size, new time
    started = builder.submit(cache, requests)
    assert started is not None
    assert started.wait(60) == 0
    log = (cache / builder.LOG).read_text()
    assert "dropped key-gone: the checkpoint's file" in log and "is gone" in log, log
    assert "dropped key-changed: the checkpoint at" in log and "dropped key-touched:" in log, log
    assert "dropped key-other-source: infer's source changed since the request" in log, log
    assert builder.queued(cache) == []
    assert not list(cache.glob("*.failed")) and not list(cache.glob("key-*.log")), "a worker ran"
    assert not builder.running(cache) and reap_processes() == []


@pytest.mark.slow
def test_two_processes_queueing_share_one_builder_that_waits_without_a_model(
    tmp_path: Path, turn_held: Path, reap_processes: Callable[[], list[int]]
) -> None:
    """Two processes queue at the same moment: one builder lives, with both requests queued; it
    waits for its turn (another build holds the machine) as one small process without torch."""
    cache = tmp_path / "aot"
    ckpt = _checkpoint(tmp_path / "ckpt")
    code = (
        "import json, sys\nfrom pathlib import Path\nfrom infer.aot import builder\n"
        "builder.RUN_LOCK = Path(sys.argv[2])\nbuilder.submit(Path(sys.argv[1]), [json.loads(sys.argv[3])])\n"
    )
    argv = [sys.executable, "-c", code, str(cache), str(turn_held)]
    producers = [subprocess.Popen([*argv, json.dumps(_request(cache, ckpt, f"key-{i}"))]) for i in range(2)]
    assert [p.wait(60) for p in producers] == [0, 0]
    deadline = time.monotonic() + 30
    while len(_builders(reap_processes)) != 1 and time.monotonic() < deadline:
        time.sleep(0.2)  # a builder started in a race leaves once it sees the lock held (within 1 s)
    (pid,) = _builders(reap_processes)
    assert builder.queued(cache) == ["key-0", "key-1"] and builder.running(cache)
    assert builder.pending(cache) == ["key-0", "key-1"]
    rss = _rss_bytes(pid)
    maps = Path(f"/proc/{pid}/maps").read_text()
    print(f"\nwaiting builder: {rss / 2**20:.1f} MiB resident (with its children)")
    assert rss < 50 * 2**20
    assert "libtorch" not in maps and idle._descendants(pid) == [pid]  # no model, no worker


def test_the_lock_is_held_from_the_moment_a_builder_is_started(
    tmp_path: Path, turn_held: Path, reap_processes: Callable[[], list[int]]
) -> None:
    """`builder.start` hands the builder the directory's lock already taken: a producer asking
    while the new builder is still starting up (no Python yet) finds it held and starts none."""
    cache = tmp_path / "aot"
    builder.add(cache, [_request(cache, _checkpoint(tmp_path / "ckpt"), "key-0")])
    first = builder.start(cache)
    assert first is not None
    held = builder.running(cache)  # at once: microseconds after the fork, long before the import
    second = builder.start(cache)
    print(f"\nheld at once: {held}; a second start: {second}")
    assert held and second is None
    assert len(_builders(reap_processes)) == 1


def test_a_request_queued_as_the_builder_leaves_is_taken(
    tmp_path: Path, run_lock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The builder releases its lock when it finds nothing to build, then looks at the queue
    once more: a request that arrived in between (its producer saw the lock still held and
    started no builder) is taken, not stranded."""
    cache = tmp_path / "aot"
    ckpt = _checkpoint(tmp_path / "ckpt")
    late = _request(cache, ckpt, "key-late")
    (ckpt / "config.json").write_text("{}")  # stale: the builder drops it (it takes it, builds nothing)
    real_listing = builder._listing
    calls: list[Path] = []

    def listing(directory: Path) -> set[tuple[str, int]]:
        if not calls:  # the look after the release: the request arrives just before it
            builder.add(directory, [late])
        calls.append(directory)
        return real_listing(directory)

    monkeypatch.setattr(builder, "_listing", listing)
    cache.mkdir()
    assert builder.Builder(cache, run_lock).run() == 0
    assert len(calls) == 2  # looked again after taking it
    assert real_listing(cache) == set(), "the late request was left without a builder"


def test_a_worker_stopped_too_long_is_killed_and_tried_again_a_bounded_number_of_times(
    tmp_path: Path, run_lock: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "aot"
    ckpt = _checkpoint(tmp_path / "ckpt")
    builder.add(cache, [_request(cache, ckpt, "key-busy")])
    runs: list[float | None] = []
    quiet: list[float] = []

    def stopped_too_long(command: list[str], stdout: Any = None, max_stopped_s: float | None = None) -> None:
        runs.append(max_stopped_s)  # the machine stayed busy: killed after max_stopped_s
        return None

    def idle_for(deadline: float | None = None, quiet_s: float = idle.QUIET_S) -> bool:
        quiet.append(quiet_s)
        return True

    monkeypatch.setattr(idle, "run_when_idle", stopped_too_long)
    monkeypatch.setattr(idle, "wait_until_idle", idle_for)
    monkeypatch.setattr(builder, "enough_memory", lambda checkpoint: True)
    assert builder.Builder(cache, run_lock).run() == 0
    assert runs == [builder.STOP_LIMIT_S] * builder.MAX_TRIES
    assert quiet == list(builder.RETRY_QUIET_S[: builder.MAX_TRIES])  # a longer quiet spell before each retry
    assert quiet == sorted(quiet) and quiet[0] == idle.QUIET_S
    out = capsys.readouterr().out
    assert out.count("killed; kept for another try") == builder.MAX_TRIES - 1
    assert f"dropped key-busy: stopped over {builder.STOP_LIMIT_S:.0f} s {builder.MAX_TRIES} times" in out
    assert builder.queued(cache) == [] and not list(cache.glob("*.failed"))


def _build_order(b: builder.Builder) -> list[str]:
    """The keys ``b`` takes, in order, each removed from the queue as if built."""
    order = []
    while (found := b.next()) is not None:
        order.append(found[0].stem)
        found[0].unlink()
    print("build order:", order)
    return order


def test_the_newest_submission_is_built_first_in_its_own_order(tmp_path: Path) -> None:
    """A process's own model goes ahead of what other processes queued earlier (they may be long
    gone); its requests keep the order it gave; a request whose workers were killed goes last."""
    cache = tmp_path / "aot"
    ckpt = _checkpoint(tmp_path / "ckpt")
    builder.add(cache, [_request(cache, ckpt, k) for k in ("old-a", "old-b")])
    builder.add(cache, [_request(cache, ckpt, k) for k in ("new-a", "new-b", "new-c")])
    b = builder.Builder(cache, tmp_path / "run.lock")
    order = _build_order(b)
    assert order == ["new-a", "new-b", "new-c", "old-a", "old-b"]
    builder.add(cache, [_request(cache, ckpt, k) for k in ("x", "y")])
    b.tries["x"] = 1  # a worker for x was killed: y first
    assert [b.next()[0].stem for _ in range(1)] == ["y"]  # type: ignore[index]


def test_decode_steps_are_built_before_dequantized_tiles(tmp_path: Path) -> None:
    """A prompt queues its tiles before the first decode step queues its shape: the step still
    goes first (every token waits on it; a tile only speeds prompts)."""
    cache = tmp_path / "aot"
    ckpt = _checkpoint(tmp_path / "ckpt")
    tile = f"{builder.TILE_PREFIX}one_plane-0123"
    builder.add(cache, [{"key": tile, "tile": {}, "out": str(cache / "tiles" / f"{tile}.pt2")}])
    builder.add(cache, [_request(cache, ckpt, "step")])
    builder.add(cache, [{"key": f"{tile}9", "tile": {}, "out": str(cache / "tiles" / f"{tile}9.pt2")}])
    order = _build_order(builder.Builder(cache, tmp_path / "run.lock"))
    assert order == ["step", f"{tile}9", tile]
