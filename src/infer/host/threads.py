"""OpenMP worker pools: one live pool per process, or every step pays for two.

libgomp keeps a worker pool per master thread; with two pools alive every region pays a futex
wake-up. `release_openmp_workers` frees the calling thread's pool (``omp_pause_resource_all``) when
it hands its model work to another thread. Measurements: docs/performance.md, "The engine's thread
at 2 threads".
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from pathlib import Path

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads, not only idle them


@functools.cache
def _libgomps() -> tuple[ctypes.CDLL, ...]:
    """Every libgomp this process loaded (/proc/self/maps): torch's, and any a package bundles
    (sentencepiece ships its own); each keeps its own pools."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ()
    paths: list[str] = []
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if Path(path).name.startswith("libgomp") and ".so" in path and path not in paths:
            paths.append(path)
    libs = []
    for path in paths:
        with contextlib.suppress(OSError):
            lib = ctypes.CDLL(path)
            if hasattr(lib, "omp_pause_resource_all"):
                lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                lib.omp_pause_resource_all.restype = ctypes.c_int
                libs.append(lib)
    return tuple(libs)


def release_openmp_workers() -> bool:
    """Free the calling thread's OpenMP worker pools (if it has any); whether a libgomp was found."""
    libs = _libgomps()
    for lib in libs:
        lib.omp_pause_resource_all(OMP_PAUSE_HARD)
    return bool(libs)


__all__ = ["release_openmp_workers"]
