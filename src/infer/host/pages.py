"""Handing memory back to the system: the C heap's free pages, and file pages nothing reads; and
keeping the freed blocks a prompt's forward reuses (`reusing_blocks`, `malloc_mode`).

Floor 0 (no infer imports): the KV cache (`infer.kv.cache`), the loader and the packed products
(`infer.quant`) all call it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence

import torch


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere: another C library, or no symbol table to search)."""
    try:
        trim: Callable[[int], int] | None = getattr(ctypes.CDLL(None), "malloc_trim", None)
        return trim
    except (OSError, TypeError):  # no C library to open (TypeError: CDLL(None) outside POSIX)
        return None


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``; a no-op elsewhere).

    glibc keeps freed heap pages resident (after loading, and after a KV regrowth: glibc's
    mmap threshold rises with each large block freed); cheap, called after loading and where KV
    buffers are released. Measurements: docs/performance.md, "Memory per load path".
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


KEEP_BYTES = 1 << 30  # blocks below this come from the C heap and stay there once freed
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)
# glibc's own thresholds once its dynamic mmap threshold has risen to its ceiling (64-bit:
# DEFAULT_MMAP_THRESHOLD_MAX, and twice that to trim): what a process that has freed a few large
# blocks runs with. Outside a prompt's forward `reusing_blocks` puts these back.
_SYSTEM_MMAP, _SYSTEM_TRIM = 32 << 20, 64 << 20
PROMPT_ROWS = 64  # a forward of at least these many rows (batch x tokens) reuses freed blocks
MODES = ("prompts", "keep", "system")


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt`` (None elsewhere: another C library, or no ``malloc_trim`` beside it)."""
    if _malloc_trim() is None:
        return None
    try:
        fn = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt: Callable[[int, int], int] = fn
    return mallopt


@functools.cache
def malloc_mode() -> str:
    """``INFER_MALLOC`` (read once): how glibc's freed large blocks are treated.

    * ``prompts`` (the default): during a forward of at least `PROMPT_ROWS` rows (a prompt chunk,
      a batched whole-sequence forward) freed blocks below `KEEP_BYTES` stay in the C heap and are
      reused (`reusing_blocks`); after it the heap is trimmed and glibc's thresholds are back.
      glibc maps every block past 32 MiB afresh: a 512-token prefill of the 1.5B allocates its
      gate/up output (37 MiB) in every layer and faults in each of its pages every time.
    * ``keep``: the same for the whole process (decode steps too: SmolLM2's decode ran ~9% slower
      in an interleaved A/B, docs/performance.md).
    * ``system``: glibc's own behaviour throughout.
    """
    value = os.environ.get("INFER_MALLOC", "prompts").strip().lower()
    if value not in MODES:
        raise ValueError(f"INFER_MALLOC must be one of {', '.join(MODES)}, got {value!r}")
    return value if _mallopt() is not None else "system"


@functools.cache
def keep_freed_blocks() -> bool:
    """For ``INFER_MALLOC=keep``: let glibc serve blocks below `KEEP_BYTES` from its heap for the
    rest of the process (`malloc_mode`); whether it was set. Explicit trims
    (`release_freed_memory`) still hand free pages back."""
    mallopt = _mallopt()
    if malloc_mode() != "keep" or mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))


_depth = 0  # forwards inside `reusing_blocks` now (nested or on other threads)
_depth_lock = threading.Lock()


@contextlib.contextmanager
def reusing_blocks(rows: int) -> Iterator[None]:
    """Around one forward of ``rows`` rows: in the ``prompts`` mode (`malloc_mode`), from
    `PROMPT_ROWS` rows, freed blocks below `KEEP_BYTES` are reused within it (one page fault per
    page a forward, not one per layer); when the last such forward ends the free pages go back to
    the system and glibc's thresholds are restored, so the steps between prompts run as before."""
    global _depth
    mallopt = _mallopt()
    if rows < PROMPT_ROWS or mallopt is None or malloc_mode() != "prompts":
        yield
        return
    with _depth_lock:
        _depth += 1
        if _depth == 1:
            mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES)
            mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES)
    try:
        yield
    finally:
        with _depth_lock:
            _depth -= 1
            if _depth == 0:
                mallopt(_M_MMAP_THRESHOLD, _SYSTEM_MMAP)
                mallopt(_M_TRIM_THRESHOLD, _SYSTEM_TRIM)
                release_freed_memory()


_MADV_DONTNEED = 4  # Linux


@functools.cache
def _madvise() -> Callable[..., int] | None:
    """libc's ``madvise`` (None where there is none to find)."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None)
    except (OSError, TypeError):
        return None
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def _file_mappings() -> list[tuple[int, int]]:
    """``(start, end)`` of this process's mappings of regular files (``/proc/self/maps``)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                # address perms offset dev inode path: a file has an inode and an absolute path
                if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    out.append((lo, hi))
    except OSError:
        return []
    return out


def drop_mapped_pages(tensors: Sequence[torch.Tensor]) -> int:
    """Drop the resident pages of ``tensors`` that lie in a file mapping (a repack cache entry's
    matrices, say, once copied into fused products): ``madvise(MADV_DONTNEED)`` on the whole
    pages each tensor's bytes cover (not its storage's: one mapping can back many tensors).
    Returns the bytes advised.

    File mappings only (anything else is left alone): a dropped page is read again if touched,
    so no value changes.
    """
    advise = _madvise()
    if advise is None or not tensors:
        return 0
    files = _file_mappings()
    page = 4096
    done = 0
    for t in tensors:
        if not t.is_cpu or t.numel() == 0:
            continue
        # The tensor's own bytes (its storage may be a whole mapped file shared by other tensors).
        span = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1
        start, size = t.data_ptr(), span * t.element_size()
        if not any(lo <= start and start + size <= hi for lo, hi in files):
            continue
        first = -(-start // page) * page  # whole pages only: a neighbour may share the edges
        last = (start + size) // page * page
        if last > first and advise(first, last - first, _MADV_DONTNEED) == 0:
            done += last - first
    return done


__all__ = ["drop_mapped_pages", "keep_freed_blocks", "malloc_mode", "release_freed_memory", "reusing_blocks"]
