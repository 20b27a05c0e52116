"""`infer.host.pages.drop_mapped_pages`: file pages nothing reads leave the resident set; values stay.

A tensor mapped from a safetensors file (as the repack cache maps its matrices) is read whole,
then dropped: the mapping's resident bytes (``/proc/self/smaps``) fall, and reading it again
gives the same values from the file. A tensor on the heap is never advised (that would zero it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from infer.host.pages import drop_mapped_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and madvise")


def resident_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path``."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:
            inside = len(fields) == 6 and fields[5] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(fields[1])
    return total


def test_mapped_pages_are_dropped_and_read_again(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    want = torch.arange(8 << 20, dtype=torch.int32)  # 32 MiB
    save_file({"w": want}, str(path))
    with safe_open(str(path), framework="pt", device="cpu") as f:
        mapped = f.get_tensor("w")
    assert torch.equal(mapped, want)  # every page read: resident
    before = resident_kib(path)
    advised = drop_mapped_pages([mapped])
    after = resident_kib(path)
    print(f"resident {before} KiB -> {after} KiB, advised {advised >> 10} KiB")
    assert advised >= (32 << 20) - 8192 and after < before - (30 << 10)
    assert torch.equal(mapped, want)  # read from the file again


def test_heap_tensors_are_left_alone() -> None:
    t = torch.arange(1 << 20, dtype=torch.int32)
    assert drop_mapped_pages([t]) == 0
    assert torch.equal(t, torch.arange(1 << 20, dtype=torch.int32))


def test_only_the_tensors_own_pages_are_dropped(tmp_path: Path) -> None:
    """Tensors that are views of one mapped file (as the repack cache maps its file): dropping one
    leaves its neighbours' pages resident."""
    path = tmp_path / "two.bin"
    path.write_bytes(bytes(range(256)) * (64 << 12))  # 16 MiB
    whole = torch.from_file(str(path), shared=False, size=16 << 20, dtype=torch.uint8)
    first = whole[: 8 << 20]
    assert int(whole.sum()) > 0  # every page read
    before = resident_kib(path)
    drop_mapped_pages([first])
    after = resident_kib(path)
    print(f"resident {before} KiB -> {after} KiB")
    assert before - after >= (8 << 10) - 8 and after >= (8 << 10) - 8  # the second half stays
    assert torch.equal(first[-256:], torch.arange(256, dtype=torch.uint8))  # read from the file again


def test_the_malloc_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``INFER_MALLOC``: ``prompts`` (the default) keeps freed blocks only inside a forward of at
    least `PROMPT_ROWS` rows (nested ones: one region) and restores glibc's thresholds and trims
    after it; ``keep`` sets them once for the process; ``system`` never touches them; another value
    is refused. glibc's ``mallopt`` is recorded, not called: this process keeps its own settings
    (what the modes buy is a benchmark's: docs/performance.md)."""
    from infer.host import pages

    calls: list[tuple[int, int]] = []
    trims: list[int] = []

    def mallopt(param: int, value: int) -> int:
        calls.append((param, value))
        return 1

    monkeypatch.setattr(pages, "_mallopt", lambda: mallopt)
    monkeypatch.setattr(pages, "release_freed_memory", lambda: trims.append(1))

    def mode(value: str | None) -> None:
        pages.malloc_mode.cache_clear()
        pages.keep_freed_blocks.cache_clear()
        if value is None:
            monkeypatch.delenv("INFER_MALLOC", raising=False)
        else:
            monkeypatch.setenv("INFER_MALLOC", value)
        calls.clear()
        trims.clear()

    keep = [(pages._M_MMAP_THRESHOLD, pages.KEEP_BYTES), (pages._M_TRIM_THRESHOLD, pages.KEEP_BYTES)]
    system = [(pages._M_MMAP_THRESHOLD, pages._SYSTEM_MMAP), (pages._M_TRIM_THRESHOLD, pages._SYSTEM_TRIM)]
    try:
        mode(None)
        assert pages.malloc_mode() == "prompts" and pages.keep_freed_blocks() is False
        with pages.reusing_blocks(pages.PROMPT_ROWS - 1):  # a decode step: nothing changes
            pass
        assert calls == [] and trims == []
        with pages.reusing_blocks(512):
            assert calls == keep
            with pages.reusing_blocks(512):  # the head inside a whole-sequence forward: one region
                pass
            assert calls == keep and trims == []
        assert calls == keep + system and trims == [1]

        mode("keep")
        assert pages.keep_freed_blocks() is True and calls == keep
        with pages.reusing_blocks(512):
            pass
        assert calls == keep and trims == []

        mode("system")
        assert pages.keep_freed_blocks() is False
        with pages.reusing_blocks(512):
            pass
        assert calls == [] and trims == []

        mode("fast")
        with pytest.raises(ValueError, match="INFER_MALLOC must be one of prompts, keep, system"):
            pages.malloc_mode()
    finally:
        pages.malloc_mode.cache_clear()
        pages.keep_freed_blocks.cache_clear()
