"""OpenMP worker pools: one live pool per process, or every step pays for two.

torch's CPU kernels run OpenMP regions (GNU libgomp, bundled with torch). libgomp keeps a pool of
worker threads per *master* thread: the first thread to run a region from a given thread creates
that thread's pool, and the pool lives as long as that thread does. When two threads each hold a
pool, libgomp counts more managed threads than CPUs and switches every worker to a short
("throttled") spin before sleeping, so each of the next regions pays a futex wake-up: a model step
of hundreds of small regions, run on the engine's thread while the thread that loaded the model
still holds its pool, ran at half speed (SmolLM2 eager decode 24 tok/s instead of 50, AMD EPYC, 2
threads; a loop of small ops on a second thread 1.6x slower while the first thread's pool lived,
as fast once it was released).

`release_openmp_workers` frees the calling thread's pool (``omp_pause_resource_all``, OpenMP 5.0):
a thread that hands its model work to another thread (the engine's loop thread, see
`infer.engine`) calls it, so the thread that runs the steps holds the only pool. If the calling
thread runs a torch region again later, libgomp makes it a new pool (~100 µs); nothing else
changes. A no-op where torch does not use libgomp.
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
