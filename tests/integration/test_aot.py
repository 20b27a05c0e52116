"""Ahead-of-time compiled decode steps (`infer.aot`): the default ``compile="auto"`` on CPU.

A package is built here from a tiny checkpoint (AOTInductor: 20-60 s each on 2 cores), so
these tests build as few as they can: one per architecture kind (full attention; Gemma 3's
sliding-window layers with seeded sampling), two through the background builder. Every
builder a test starts is killed at its end if still alive (``reap_processes``), and builds
wait for a build lock of the test's own, not the one real builders share.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import infer
import infer.aot as aot
from infer.aot import builder
from infer.engine import SamplingParams
from infer.execution import StepFeed
from infer.kv.cache import KVCache
from infer.sampling import Sampling

BUILD_TIMEOUT_S = 600


@pytest.fixture
def packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reap_processes: Callable[[], list[int]]
) -> Iterator[Path]:
    """Packages on, in a directory of this test's own; no builds unless a test asks (``INFER_AOT=use``;
    a test that builds unsets it, or for its temporary checkpoints sets ``INFER_AOT=on``)."""
    monkeypatch.setenv("INFER_AOT", "use")  # read when used (`infer.aot.settings`)
    monkeypatch.setattr(aot.settings, "CACHE_DIR", tmp_path / "aot")
    monkeypatch.setattr(aot.queue, "_MISSING", {})
    monkeypatch.setattr(builder, "RUN_LOCK", tmp_path / "run.lock")
    monkeypatch.setenv("INFER_BUILD_WHEN_BUSY", "1")  # the suite keeps the CPUs busy: build anyway
    yield tmp_path / "aot"


@pytest.fixture
def turn_held(tmp_path: Path) -> Iterator[Path]:
    """The build lock of ``tmp_path/tmp`` (the temporary directory of the processes a test starts
    with ``TMPDIR`` there, and their builders) held by this test: a builder waits its turn."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    fd = os.open(tmp / "infer-aot-build.lock", os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield tmp
    finally:
        os.close(fd)


def _env(tmp_path: Path, **settings: str) -> dict[str, str]:
    """A user's environment: ``INFER_AOT`` as given (unset: the default), the caches and the
    temporary directory under ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if k != "INFER_AOT"} | settings
    return env | {
        "XDG_CACHE_HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path / "tmp"),
        "INFER_BUILD_WHEN_BUSY": "1",  # the rest of the suite keeps the CPUs busy: build anyway
    }  # fmt: skip


def _rss_bytes(pids: list[int]) -> int:
    return sum(int(Path(f"/proc/{p}/status").read_text().split("VmRSS:")[1].split()[0]) * 1024 for p in pids)


def _build_for(llm: infer.LLM, prompt: list[int], mode: Sampling, rows: int = 1, width: int = 1) -> Path:
    """Build, in this process, the package the engine will ask for: steps of ``rows`` rows (one,
    or any of `aot.MULTI_ROWS`) of ``width`` tokens (a verify pass: any of `aot.VERIFY_WIDTHS`),
    every KV capacity."""
    key = aot.shape_key(aot.fingerprint(llm.model), rows, mode, width)
    assert key is not None
    path = aot.cache_dir() / f"{key}.pt2"
    aot.build(llm.model, rows, mode, path, width)
    return path


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "seed"), [("llama", None), ("gemma3", 7)])
def test_packaged_decode_steps_give_the_eager_tokens(
    tiny_ckpt_factory: Callable[..., Path], packages: Path, arch: str, seed: int | None
) -> None:
    """The default load runs decode steps from the package of their shape, with the eager
    step's tokens: greedy (Llama) and seeded sampling with Gemma 3's sliding-window layers."""
    path = tiny_ckpt_factory(arch)
    llm = infer.load(path)
    assert llm.execution.packages is not None  # the default on CPU: compile="auto" with packages
    eager = infer.load(path, compile=False)
    assert eager.execution.packages is None
    prompt = [5, 9, 200, 31, 7]
    temperature, top_k = (0.8, 20) if seed is not None else (0.0, 0)
    mode = Sampling(greedy=False, filtered=True) if seed is not None else Sampling()
    t0 = time.perf_counter()
    path_built = _build_for(llm, prompt, mode)
    built = time.perf_counter() - t0
    want = eager.generate(prompt, 24, temperature=temperature, top_k=top_k, seed=seed).token_ids
    got = llm.generate(prompt, 24, temperature=temperature, top_k=top_k, seed=seed).token_ids
    print(f"\n{arch}: package built in {built:.1f} s; {llm.execution.packaged_steps} packaged decode steps")
    assert got == want
    assert (
        llm.execution.packaged_steps == len(got) - 1
    )  # every decode step (the first token is the prefill's)
    if sys.platform.startswith("linux"):  # the extracted package is removed once its code is mapped
        lines = [line for line in Path("/proc/self/maps").read_text().splitlines() if "/aotinductor_" in line]
        mapped = {line.split("/aotinductor_")[1].split("/")[0] for line in lines}
        left = [d for d in mapped if Path(tempfile.gettempdir(), f"aotinductor_{d}").exists()]
        print(f"package code mapped from {len(mapped)} extraction directories, {len(left)} left on disk")
        assert mapped and not left
    if seed is None:  # the package checks what compiled code cannot: a clear error, never a crash
        package = aot.Package(path_built, llm.model)
        # It is handed only the weights the step reads: the fused q/k/v product, not its parts' views.
        names = json.loads(package.loader.get_metadata()["names"])
        assert any(".fused_0." in n for n in names) and not any(".q_proj." in n for n in names), names
        assert len(names) < len(aot.named_tensors(llm.model))
        two_rows = StepFeed(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long),
                            torch.zeros(2, dtype=torch.long), mode, None, None)  # fmt: skip
        serves = r"a step of 2 rows x 1 tokens.* the package serves 1-1 rows x 1-1"
        with pytest.raises(ValueError, match=serves):
            package(KVCache(llm.config, 2, 256, dtype=llm.model.cache_dtype, rings=False), two_rows)
        one_row = StepFeed(two_rows.ids[:1], two_rows.n_new[:1], two_rows.last[:1], mode, None, None)
        f16 = KVCache(llm.config, 1, 256, dtype=torch.float16, rings=False)
        wrong = r"step input #5 is \[\[1, 2, 256, .*float16.* expects .*float32"
        with pytest.raises(ValueError, match=wrong):
            package(f16, one_row)
        other = infer.load(path, dtype=torch.bfloat16, compile=False).model
        with pytest.raises(ValueError, match="the package expects"):
            aot.Package(path_built, other)
        # One package serves every step of 2-16 rows, on every KV capacity (both dimensions
        # dynamic): three streams of different lengths decode from it, with the eager tokens.
        _build_for(llm, prompt, mode, rows=2)
        prompts = [prompt, [7, 8] * 40, [3] * 150]  # rows grow past the first capacity
        handles = [llm.engine.submit(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts]
        before = llm.execution.packaged_steps
        together = [[t for d in h for t in d.token_ids] for h in handles]
        alone = [[t for d in eager.engine.submit(p, SamplingParams(max_tokens=30, ignore_eos=True))
                  for t in d.token_ids] for p in prompts]  # fmt: skip
        steps = llm.execution.packaged_steps - before
        print(f"{steps} packaged steps for 3 streams; KV capacity {llm.engine.slots.capacity}")
        assert together == alone and steps >= 29


@pytest.mark.slow
def test_packaged_verify_passes_give_the_eager_passes_tokens(
    tiny_ckpt_factory: Callable[..., Path], packages: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A speculative verify pass (one row, every fed token through the head) runs the package of
    its shape, one for every width of `aot.VERIFY_WIDTHS`: n-gram lookup gives the tokens it gives
    with eager passes (and those are plain decoding's here), and the package refuses a step it
    does not serve with a clear error."""
    from infer.speculative import Speculative, Speculator

    def propose_all(self: Speculator, rows: int, proposals: dict[int, Any], *_: Any) -> int:
        return 1 + max([len(p.tokens) for p in proposals.values()], default=0)

    monkeypatch.setattr(Speculator, "plan", propose_all)
    path = tiny_ckpt_factory("llama")
    llm = infer.load(path, lookup=3, speculative_tokens=12)
    eager = infer.load(path, lookup=3, speculative_tokens=12, compile=False)
    plain = infer.load(path, compile=False)
    t0 = time.perf_counter()
    built = _build_for(llm, [], Sampling(every_token=True), width=aot.VERIFY_WIDTHS[0])
    seconds = time.perf_counter() - t0
    prompts = [[5, 9, 200, 31, 7, 44, 3] * 3, [70, 71, 72, 73] * 4]
    for prompt in prompts:
        want = eager.generate(prompt, 40).token_ids
        before = llm.execution.packaged_steps
        got = llm.generate(prompt, 40).token_ids
        passes = llm.engine.stats()["spec_passes"]
        print(
            f"\nverify package built in {seconds:.1f} s; {llm.execution.packaged_steps - before} packaged "
            f"passes; {passes:.0f} passes in all"
        )
        assert got == want == plain.generate(prompt, 40).token_ids
        assert llm.execution.packaged_steps - before > 0
    package = aot.Package(built, llm.model)
    assert package.widths == aot.VERIFY_WIDTHS
    two = StepFeed(torch.zeros(1, 2, dtype=torch.long), torch.full((1,), 2), torch.zeros(1, dtype=torch.long),
                   Sampling(every_token=True), None, None)  # fmt: skip
    refused = r"1 rows x 2 tokens, 1 through the head .* 2-16 tokens \(every token"
    with pytest.raises(ValueError, match=refused):
        package(KVCache(llm.config, 1, 256, dtype=llm.model.cache_dtype, rings=False), two)
    assert isinstance(llm.speculative, Speculative)


@pytest.mark.slow
def test_a_background_build_serves_the_next_load(
    tiny_ckpt_factory: Callable[..., Path], packages: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing package: the generation runs eagerly and queues the shape at once; the
    directory's builder builds it in another process (one builder, however many ask); this
    process, still running, and the next load (same checkpoint, same arguments: the same
    fingerprint) decode from it, with the same tokens."""
    monkeypatch.setenv("INFER_AOT", "on")  # builds (the checkpoint is temporary)
    path = tiny_ckpt_factory("llama")
    prompt = [11, 12, 13]
    first = infer.load(path)
    want = first.generate(prompt, max_new_tokens=12).token_ids
    assert first.execution.packaged_steps == 0
    cache = first.execution.packages
    assert isinstance(cache, aot.PackageCache) and len(cache.missing) == 1
    assert set(cache.queued) == set(cache.missing)
    (build,) = cache.builds  # queued on the step that missed it, and the builder started
    assert cache.build_missing() is None  # nothing new to queue, and the builder lives
    other = infer.load(path)
    other.generate(prompt, max_new_tokens=4)
    assert not other.execution.packages.builds  # type: ignore[union-attr]  # queued for the builder that lives
    build.wait(BUILD_TIMEOUT_S)
    log = (packages / builder.LOG).read_text()
    assert build.returncode == 0, log
    assert len(list(packages.glob("*.pt2"))) == 1 and not aot.building(packages), log
    assert log.count("building ") == 1 and "built after" in log, log  # the second ask built nothing
    second = infer.load(path)
    assert second.generate(prompt, max_new_tokens=12).token_ids == want
    assert second.execution.packaged_steps == 11
    time.sleep(aot.PackageCache.RECHECK_S)  # the first process looks at the path again, finds it
    assert first.generate(prompt, max_new_tokens=12).token_ids == want
    assert first.execution.packaged_steps >= 11  # (its prompt is cached: it may decode one more step)
    (built,) = [line for line in log.splitlines() if "built after" in line]
    print(f"\nbuilder log: {built}")


def test_prepare_queues_shapes_ahead_of_need(
    tiny_ckpt_factory: Callable[..., Path],
    packages: Path,
    reap_processes: Callable[[], list[int]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`PackageCache.prepare` (a server at start) queues every shape asked for that has no
    package, once; it queues nothing where builds are off, or for a temporary checkpoint by
    default. The first queueing says so in one line on stderr."""
    path = tiny_ckpt_factory("llama")
    llm = infer.load(path)
    cache = llm.execution.packages
    assert isinstance(cache, aot.PackageCache)
    assert cache.prepare([1, 2]) == []  # INFER_AOT=use
    monkeypatch.delenv("INFER_AOT")  # INFER_AOT unset: the default...
    assert cache.prepare([1, 2]) == [] and not packages.exists()  # ... builds no temporary checkpoint
    monkeypatch.setenv("INFER_AOT", "on")
    fd = os.open(builder.RUN_LOCK or "", os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another build holds the machine: the builder waits its turn
    try:
        sampled = Sampling(greedy=False, filtered=True)
        keys = cache.prepare([1, 2, 4, 16, 17], modes=[Sampling(), sampled])  # 17 rows: eager, no package
        assert len(keys) == 4 and builder.queued(packages) == sorted(keys)
        assert {k.split("-")[1] for k in keys} == {"b1", "b2"}  # "b1-", "b2-16-": every capacity
        assert cache.prepare([1, 8]) == []  # queued already
        assert len(cache.builds) == 1
        said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("infer: ")]
        print(said)
        assert len(said) == 1 and "decode steps (batch 1, 2)" in said[0] and "run eagerly until" in said[0]
        cache.prepare([32])
        assert not any(line.startswith("infer: ") for line in capsys.readouterr().err.splitlines())
        deadline = time.monotonic() + 30
        while not builder.running(packages) and time.monotonic() < deadline:
            time.sleep(0.1)  # the builder starting: its lock once its interpreter is up
        assert builder.running(packages) and builder.queued(packages) == sorted(keys)
        with pytest.raises(ValueError, match="rows must be integers >= 1, got 0"):
            cache.prepare([0])
        with pytest.raises(ValueError, match="rows must be integers >= 1, got True"):
            cache.prepare([True])
    finally:
        for pid in reap_processes():  # killed before its turn: it would build four packages
            os.killpg(pid, signal.SIGKILL)  # (a builder leads its process group)
        os.close(fd)


def test_a_running_process_queues_again_what_the_builder_dropped(
    tiny_ckpt_factory: Callable[..., Path],
    packages: Path,
    reap_processes: Callable[[], list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server queues a shape once; if the builder drops it unbuilt (the machine stayed busy
    through its tries), the server queues it again `REQUEUE_S` later, as a new process would."""
    monkeypatch.setenv("INFER_AOT", "on")
    fd = os.open(builder.RUN_LOCK or "", os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another build holds the machine: nothing is built here
    try:
        llm = infer.load(tiny_ckpt_factory("llama"))
        llm.generate([1, 2, 3], max_new_tokens=4)
        cache = llm.execution.packages
        assert isinstance(cache, aot.PackageCache)
        (key,) = cache.queued
        assert builder.queued(packages) == [key]
        (packages / "queue" / f"{key}.json").unlink()  # as the builder drops it
        time.sleep(aot.PackageCache.RECHECK_S)
        llm.generate([1, 2, 3], max_new_tokens=4)
        assert builder.queued(packages) == []  # queued REQUEUE_S ago, not yet
        cache.REQUEUE_S = 0.0
        time.sleep(aot.PackageCache.RECHECK_S)
        llm.generate([1, 2, 3], max_new_tokens=4)
        assert builder.queued(packages) == [key]
    finally:
        for pid in reap_processes():
            os.killpg(pid, signal.SIGKILL)
        os.close(fd)


@pytest.mark.slow
def test_a_process_queues_what_it_missed_and_the_builder_builds_it(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path, reap_processes: Callable[[], list[int]]
) -> None:
    """A fresh process (``INFER_AOT=on``: the checkpoint is temporary), the model loaded and
    dropped inside a function as a script or the CLI does: it queues the decode step it ran
    eagerly, the builder (under `infer.aot.idle`) builds it, and the package lands in the user's cache."""
    script = (
        "import sys, infer\n"
        "def main():\n"
        "    llm = infer.load(sys.argv[1])\n"
        "    print(llm.generate([3, 4, 5], max_new_tokens=6).token_ids)\n"
        "main()\n"
    )
    (tmp_path / "tmp").mkdir()
    path = tiny_ckpt_factory("llama")
    env = _env(tmp_path, INFER_AOT="on")
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, env=env, timeout=300)
    directory = tmp_path / "home" / "infer" / "aot"
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while aot.building(directory) and time.monotonic() < deadline:
        time.sleep(0.5)
    log = (directory / builder.LOG).read_text()
    assert not aot.building(directory), "the build did not finish"
    assert len(list(directory.glob("*.pt2"))) == 1, log
    (built,) = [line for line in log.splitlines() if "built after" in line]
    print(f"\nbuilder log: {built}")
    deadline = time.monotonic() + 10
    while reap_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert reap_processes() == [], "the builder outlived its queue"


@pytest.mark.slow
def test_the_cli_on_a_temporary_checkpoint_queues_nothing_and_leaves_nothing_running(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path, reap_processes: Callable[[], list[int]]
) -> None:
    """``infer generate`` with ``INFER_AOT`` unset (the default) on a checkpoint under the
    temporary directory: no request queued, no builder, no process of ours left."""
    (tmp_path / "tmp").mkdir()
    path = tiny_ckpt_factory("llama")
    argv = [sys.executable, "-m", "infer", "generate", str(path), "Hi", "--max-new-tokens", "4", "--quiet"]
    subprocess.run(argv, check=True, env=_env(tmp_path), timeout=300, capture_output=True)
    directory = tmp_path / "home" / "infer" / "aot"
    assert builder.queued(directory) == [] and not builder.running(directory)
    assert reap_processes() == []


@pytest.mark.slow
def test_two_cli_runs_leave_one_small_builder(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path, turn_held: Path,
    reap_processes: Callable[[], list[int]],
) -> None:  # fmt: skip
    """Two runs of ``infer generate`` (``INFER_AOT=on``) with two sampling modes, while another
    build holds the machine: both shapes queued, one builder alive and nothing else of ours,
    and that builder, waiting its turn, is one process without torch under 50 MiB."""
    path = tiny_ckpt_factory("llama")
    env = _env(tmp_path, INFER_AOT="on")
    argv = [sys.executable, "-m", "infer", "generate", str(path), "Hi", "--max-new-tokens", "4", "--quiet"]
    for extra in ([], ["--temperature", "0.8", "--seed", "1"]):
        subprocess.run(argv + extra, check=True, env=env, timeout=300, capture_output=True)
    directory = tmp_path / "home" / "infer" / "aot"
    assert len(builder.queued(directory)) == 2 and builder.running(directory)
    deadline = time.monotonic() + 30
    while len(reap_processes()) > 1 and time.monotonic() < deadline:
        time.sleep(0.2)  # a builder started in a race leaves within 1 s
    (pid,) = reap_processes()  # the builder, and nothing else: no worker while it waits
    assert b"infer.aot.builder" in Path(f"/proc/{pid}/cmdline").read_bytes()
    rss = _rss_bytes([pid])
    print(f"\nthe waiting builder: {rss / 2**20:.1f} MiB resident")
    assert rss < 50 * 2**20 and "libtorch" not in Path(f"/proc/{pid}/maps").read_text()


def test_a_damaged_package_is_removed_and_the_step_stays_eager(
    tiny_ckpt_factory: Callable[..., Path], packages: Path
) -> None:
    path = tiny_ckpt_factory("llama")
    llm = infer.load(path)
    key = aot.shape_key(aot.fingerprint(llm.model), 1, Sampling())
    damaged = packages / f"{key}.pt2"
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"PK\x03\x04 not a package")
    want = infer.load(path, compile=False).generate([1, 2, 3], max_new_tokens=6).token_ids
    with pytest.warns(UserWarning, match="cannot load the compiled step"):
        got = llm.generate([1, 2, 3], max_new_tokens=6).token_ids
    assert got == want and llm.execution.packaged_steps == 0
    assert not damaged.exists()


def test_the_fingerprint_names_the_model_not_the_load(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """Two loads of one checkpoint share packages; another architecture or dtype does not."""
    llama = tiny_ckpt_factory("llama")
    a = aot.fingerprint(infer.load(llama, compile=False).model)
    assert a == aot.fingerprint(infer.load(llama, compile=False).model)
    assert a != aot.fingerprint(infer.load(tiny_ckpt_factory("qwen3"), compile=False).model)
    assert a != aot.fingerprint(infer.load(llama, dtype=torch.bfloat16, compile=False).model)


def test_no_packages_where_they_do_not_apply(
    tiny_ckpt_factory: Callable[..., Path], packages: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_ckpt_factory("llama")
    assert infer.load(path, compile=False).execution.packages is None
    assert infer.load(path, deterministic=True).execution.packages is None  # bitwise contract: eager kernels
    monkeypatch.setenv("INFER_AOT", "off")
    llm = infer.load(path)
    llm.generate([1, 2, 3], max_new_tokens=4)
    assert llm.execution.packaged_steps == 0 and not packages.exists()


def test_no_packages_where_compiling_does_not_pay(
    tmp_path: Path, packages: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed weights with float32 compute have no kernel: each step dequantizes them, and
    compiled code does that slower than eager (`aot.pays`); the packed default has packages."""
    from infer.gguf.writer import write_gguf
    from infer.testing import build_tokenizer, tiny_hf_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tokenizer = build_tokenizer(tmp_path / "tok")
    path = write_gguf(tmp_path / "q8.gguf", tiny_hf_model("llama"), tokenizer, qtype="Q8_0")
    assert infer.load(path).execution.packages is not None
    assert infer.load(path, dtype=torch.float32).execution.packages is None


def test_use_builds_nothing(tiny_ckpt_factory: Callable[..., Path], packages: Path) -> None:
    """``INFER_AOT=use`` with an empty cache: plain eager steps, no fingerprint, no
    power-of-two row window, no shape noted, and nothing to build at exit."""
    llm = infer.load(tiny_ckpt_factory("llama"))
    cache = llm.execution.packages
    assert isinstance(cache, aot.PackageCache) and not aot.settings.background_builds()
    llm.generate([1, 2, 3], max_new_tokens=6)
    assert not llm.execution.bucketed and llm.execution.packaged_steps == 0
    assert cache._fingerprint is None and not cache.missing
    assert cache.build_missing() is None and not packages.exists()


def test_a_bad_infer_aot_setting_is_named(
    tiny_ckpt_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFER_AOT", "maybe")
    with pytest.raises(ValueError, match="INFER_AOT must be on, use or off, got 'maybe'"):
        infer.load(tiny_ckpt_factory("llama"))


def test_no_build_without_the_memory_for_it(tmp_path: Path) -> None:
    """The worker loads a second copy of the model: the builder does not start one that cannot
    fit (a sparse 1 TiB "checkpoint" here), and says so in its log instead of failing."""
    huge = tmp_path / "model.gguf"
    with open(huge, "wb") as f:
        f.truncate(1 << 40)
    assert not builder.enough_memory(huge)
    small = tmp_path / "small.gguf"
    small.write_bytes(b"\0" * 1024)
    assert builder.enough_memory(small) == (_available_bytes() > builder.COMPILER_BYTES)


def _available_bytes() -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    return int(line.split()[1]) * 1024


def test_the_cache_directory_keeps_a_bounded_number_of_files(tmp_path: Path) -> None:
    """`aot._prune` (after every build, built or failed): the newest `MAX_PACKAGES` packages and
    as many ``.failed`` markers, each with its log; no orphan log; a killed worker's temporary
    directory once an hour old; the builder's log and a fresh temporary directory stay."""
    n = aot.MAX_PACKAGES + 3
    for i in range(n):
        for name in (f"p{i}.pt2", f"p{i}.log", f"f{i}.failed", f"f{i}.log"):
            (tmp_path / name).write_text("x")
            os.utime(tmp_path / name, (1000.0 + i, 1000.0 + i))
    (tmp_path / "killed.log").write_text("a build stopped before it ended")
    (tmp_path / builder.LOG).write_text("the builder's own")
    old, fresh = tmp_path / "tmpold", tmp_path / "tmpfresh"
    old.mkdir()
    fresh.mkdir()
    (old / "package.pt2").write_text("half written")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    aot._prune(tmp_path)
    kept = {p.name for p in tmp_path.iterdir()}
    newest = range(3, n)
    want = {f"p{i}.{s}" for i in newest for s in ("pt2", "log")} | {
        f"f{i}.{s}" for i in newest for s in ("failed", "log")
    }
    assert kept == want | {builder.LOG, "tmpfresh"}, sorted(kept ^ (want | {builder.LOG, "tmpfresh"}))
