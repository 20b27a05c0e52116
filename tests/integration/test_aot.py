"""Ahead-of-time compiled decode steps (`infer.aot`): the default ``compile="auto"`` on CPU.

A package is built here from a tiny checkpoint (AOTInductor: 20-60 s each on 2 cores), so
these tests build as few as they can: one per architecture kind (full attention; Gemma 3's
sliding-window layers with seeded sampling), one through the background process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import infer
import infer.aot as aot
from infer.cache import KVCache
from infer.engine import MIN_SLOTS
from infer.step import Sampling, StepFeed

BUILD_TIMEOUT_S = 600


@pytest.fixture
def packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Packages on, in a directory of this test's own; no builds unless a test asks (``INFER_AOT=use``)."""
    monkeypatch.setattr(aot, "ENABLED", True)
    monkeypatch.setattr(aot, "CACHE_DIR", tmp_path / "aot")
    monkeypatch.setattr(aot, "BACKGROUND_BUILDS", False)
    monkeypatch.setattr(aot, "_MISSING", {})
    yield tmp_path / "aot"


def _build_for(llm: infer.LLM, prompt: list[int], mode: Sampling) -> Path:
    """Build, in this process, the package the engine will ask for: one row, the first capacity."""
    # The engine's first KV capacity (infer.engine.MIN_SLOTS), no rings (every row can roll back).
    cache = KVCache(llm.config, 1, MIN_SLOTS, dtype=llm.model.cache_dtype, layers=llm.model.kv_layers,
                    rings=False)  # fmt: skip
    key = aot.package_key(aot.fingerprint(llm.model), cache, 1, mode)
    path = aot.cache_dir() / f"{key}.pt2"
    aot.build(llm.model, 1, MIN_SLOTS, False, mode, path)
    return path


@pytest.mark.parametrize(("arch", "seed"), [("llama", None), ("gemma3", 7)])
def test_packaged_decode_steps_give_the_eager_tokens(
    tiny_ckpt_factory: Callable[..., Path], packages: Path, arch: str, seed: int | None
) -> None:
    """The default load runs decode steps from the package of their shape, with the eager
    step's tokens: greedy (Llama) and seeded sampling with Gemma 3's sliding-window layers."""
    path = tiny_ckpt_factory(arch)
    llm = infer.load(path)
    assert llm.stepper.packages is not None  # the default on CPU: compile="auto" with packages
    eager = infer.load(path, compile=False)
    assert eager.stepper.packages is None
    prompt = [5, 9, 200, 31, 7]
    temperature, top_k = (0.8, 20) if seed is not None else (0.0, 0)
    mode = Sampling(greedy=False, filtered=True) if seed is not None else Sampling()
    t0 = time.perf_counter()
    path_built = _build_for(llm, prompt, mode)
    built = time.perf_counter() - t0
    want = eager.generate(prompt, 24, temperature=temperature, top_k=top_k, seed=seed).token_ids
    got = llm.generate(prompt, 24, temperature=temperature, top_k=top_k, seed=seed).token_ids
    print(f"\n{arch}: package built in {built:.1f} s; {llm.stepper.packaged_steps} packaged decode steps")
    assert got == want
    assert llm.stepper.packaged_steps == len(got) - 1  # every decode step (the first token is the prefill's)
    if seed is None:  # the package checks what compiled code cannot: a clear error, never a crash
        package = aot.Package(path_built, llm.model)
        # It is handed only the weights the step reads: the fused q/k/v product, not its parts' views.
        names = json.loads(package.loader.get_metadata()["names"])
        assert any(".fused_0." in n for n in names) and not any(".q_proj." in n for n in names), names
        assert len(names) < len(aot.named_tensors(llm.model))
        two_rows = StepFeed(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long),
                            torch.zeros(2, dtype=torch.long), mode, None, None)  # fmt: skip
        with pytest.raises(ValueError, match=r"step input #0 is \[\[2, 1\]"):
            package(KVCache(llm.config, 2, 256, dtype=llm.model.dtype, rings=False), two_rows)
        other = infer.load(path, dtype=torch.bfloat16, compile=False).model
        with pytest.raises(ValueError, match="the package expects"):
            aot.Package(path_built, other)


def test_a_background_build_serves_the_next_load(
    tiny_ckpt_factory: Callable[..., Path], packages: Path
) -> None:
    """A missing package: the generation runs eagerly and notes the shape; the build (what
    interpreter exit starts) runs in another process; the next load (same checkpoint, same
    arguments: the same fingerprint) decodes from it, with the same tokens."""
    aot.BACKGROUND_BUILDS = True  # INFER_AOT=on, the default
    path = tiny_ckpt_factory("llama")
    prompt = [11, 12, 13]
    first = infer.load(path)
    want = first.generate(prompt, max_new_tokens=12).token_ids
    assert first.stepper.packaged_steps == 0
    cache = first.stepper.packages
    assert isinstance(cache, aot.PackageCache) and len(cache.missing) == 1 and not cache.builds
    build = cache.build_missing()
    assert build is not None and cache.build_missing() is None  # one build per shape
    (key,) = aot.building(packages)  # its lock is held while it runs
    cache.missing[key] = {"out": str(packages / f"{key}.pt2")}
    assert cache.build_missing() is None  # ... so no other process starts it again
    build.wait(BUILD_TIMEOUT_S)
    log = next(packages.glob("*.log")).read_text()
    assert build.returncode == 0, log
    assert len(list(packages.glob("*.pt2"))) == 1 and not aot.building(packages)
    second = infer.load(path)
    assert second.generate(prompt, max_new_tokens=12).token_ids == want
    assert second.stepper.packaged_steps == 11
    time.sleep(aot.PackageCache.RECHECK_S)  # the first process looks at the path again, finds it
    assert first.generate(prompt, max_new_tokens=12).token_ids == want
    assert first.stepper.packaged_steps >= 11  # (its prompt is cached: it may decode one more step)
    print(f"\nbuild log: {log.strip().splitlines()[-1]}")


def test_a_process_builds_what_it_missed_at_exit(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """The default in a fresh process (``INFER_AOT`` unset), the model loaded and dropped inside a
    function as a script or the CLI does: at exit the process starts the build of the decode
    step it ran eagerly (under `infer.idle`), and the package lands in the user's cache."""
    script = (
        "import sys, infer\n"
        "def main():\n"
        "    llm = infer.load(sys.argv[1])\n"
        "    print(llm.generate([3, 4, 5], max_new_tokens=6).token_ids)\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "INFER_AOT"} | {"XDG_CACHE_HOME": str(tmp_path)}
    path = tiny_ckpt_factory("llama")
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, env=env, timeout=300)
    directory = tmp_path / "infer" / "aot"
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while aot.building(directory) and time.monotonic() < deadline:
        time.sleep(0.5)
    (log,) = directory.glob("*.log")
    assert not aot.building(directory), "the build did not finish"
    assert len(list(directory.glob("*.pt2"))) == 1, log.read_text()
    print(f"\nbuild log: {log.read_text().strip().splitlines()[-1]}")


def test_a_damaged_package_is_removed_and_the_step_stays_eager(
    tiny_ckpt_factory: Callable[..., Path], packages: Path
) -> None:
    path = tiny_ckpt_factory("llama")
    llm = infer.load(path)
    cache = KVCache(llm.config, 1, 256, dtype=llm.model.dtype, layers=llm.model.kv_layers, rings=False)
    key = aot.package_key(aot.fingerprint(llm.model), cache, 1, Sampling())
    damaged = packages / f"{key}.pt2"
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"PK\x03\x04 not a package")
    want = infer.load(path, compile=False).generate([1, 2, 3], max_new_tokens=6).token_ids
    with pytest.warns(UserWarning, match="cannot load the compiled step"):
        got = llm.generate([1, 2, 3], max_new_tokens=6).token_ids
    assert got == want and llm.stepper.packaged_steps == 0
    assert not damaged.exists()


def test_the_fingerprint_names_the_model_not_the_load(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """Two loads of one checkpoint share packages; another architecture or dtype does not."""
    llama = tiny_ckpt_factory("llama")
    a = aot.fingerprint(infer.load(llama, compile=False).model)
    assert a == aot.fingerprint(infer.load(llama, compile=False).model)
    assert a != aot.fingerprint(infer.load(tiny_ckpt_factory("qwen3"), compile=False).model)
    assert a != aot.fingerprint(infer.load(llama, dtype=torch.bfloat16, compile=False).model)


def test_no_packages_where_they_do_not_apply(tiny_ckpt_factory: Callable[..., Path], packages: Path) -> None:
    path = tiny_ckpt_factory("llama")
    assert infer.load(path, compile=False).stepper.packages is None
    assert infer.load(path, deterministic=True).stepper.packages is None  # bitwise contract: eager kernels
    aot.ENABLED = False  # INFER_AOT=off
    llm = infer.load(path)
    llm.generate([1, 2, 3], max_new_tokens=4)
    assert llm.stepper.packaged_steps == 0 and not packages.exists()


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
    assert infer.load(path).stepper.packages is not None
    assert infer.load(path, dtype=torch.float32).stepper.packages is None


def test_use_builds_nothing(tiny_ckpt_factory: Callable[..., Path], packages: Path) -> None:
    """``INFER_AOT=use`` with an empty cache: plain eager steps, no fingerprint, no
    power-of-two row window, no shape noted, and nothing to build at exit."""
    llm = infer.load(tiny_ckpt_factory("llama"))
    cache = llm.stepper.packages
    assert isinstance(cache, aot.PackageCache) and not aot.BACKGROUND_BUILDS
    llm.generate([1, 2, 3], max_new_tokens=6)
    assert not llm.stepper.bucketed and llm.stepper.packaged_steps == 0
    assert cache._fingerprint is None and not cache.missing
    assert cache.build_missing() is None and not packages.exists()


def test_a_bad_infer_aot_setting_is_named(
    tiny_ckpt_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aot, "_SETTING", "maybe")
    with pytest.raises(ValueError, match="INFER_AOT must be on, use or off, got 'maybe'"):
        infer.load(tiny_ckpt_factory("llama"))


def test_no_build_without_the_memory_for_it(tmp_path: Path) -> None:
    """The builder loads a second copy of the model: it does not start one that cannot fit
    (a sparse 1 TiB "checkpoint" here), and says so in its log instead of failing."""
    huge = tmp_path / "model.gguf"
    with open(huge, "wb") as f:
        f.truncate(1 << 40)
    assert not aot._enough_memory(huge)
    small = tmp_path / "small.gguf"
    small.write_bytes(b"\0" * 1024)
    assert aot._enough_memory(small) == (_available_bytes() > aot.COMPILER_BYTES)


def _available_bytes() -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    return int(line.split()[1]) * 1024
