"""Handing memory back to the system: the C heap's free pages, and file pages nothing reads; and
keeping the freed blocks a prefill reuses (`keep_freed_blocks`).

Floor 0 (no infer imports): the KV cache (`infer.kv.cache`), the loader and the packed products
(`infer.quant`) all call it.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Sequence

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


@functools.cache
def keep_freed_blocks() -> bool:
    """Let glibc serve blocks below `KEEP_BYTES` from its heap and keep them there once freed,
    instead of mapping fresh pages for each and unmapping them after (glibc maps blocks past
    32 MiB: a 512-token prefill of the 1.5B allocates its gate/up output, 37 MiB, anew in every
    layer, and every first touch of its pages faults). A mode, ``INFER_MALLOC=keep`` (read once):
    it speeds long prompts but slowed SmolLM2's decode by ~9%, so the default leaves glibc's
    thresholds. Whether it was set: the mode on, glibc on Linux. Explicit trims
    (`release_freed_memory`) still hand free pages back. docs/performance.md, issue 51's section."""
    value = os.environ.get("INFER_MALLOC", "system").strip().lower()
    if value not in ("keep", "system"):
        raise ValueError(f"INFER_MALLOC must be 'keep' or 'system', got {value!r}")
    if value == "system" or _malloc_trim() is None:  # (malloc_trim: glibc's, where mallopt is too)
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))


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


__all__ = ["drop_mapped_pages", "keep_freed_blocks", "release_freed_memory"]
