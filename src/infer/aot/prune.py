"""Pruning: what builds leave in the package cache directory stays bounded.

Run by the worker after every build, built or failed (`infer.aot.worker`).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

from infer.aot import builder

MAX_PACKAGES = 32  # packages the cache directory keeps (newest first)


def prune(directory: Path) -> None:
    """Bound what builds leave in ``directory``: the newest `MAX_PACKAGES` packages and as many
    ``.failed`` markers (each with its log), no log of neither (a build killed before it ended),
    and no temporary build directory of a worker that died in it, once it is an hour old."""

    def newest_first(pattern: str) -> list[Path]:
        found = []
        for path in directory.glob(pattern):
            with contextlib.suppress(OSError):  # removed meanwhile
                found.append((path.stat().st_mtime, path))
        return [path for _, path in sorted(found, reverse=True)]

    for old in newest_first("*.pt2")[MAX_PACKAGES:] + newest_first("*.failed")[MAX_PACKAGES:]:
        for suffix in (old.suffix, ".log"):
            with contextlib.suppress(OSError):
                old.with_suffix(suffix).unlink()
    for log in newest_first("*.log"):
        if log.name != builder.LOG and not any(log.with_suffix(s).exists() for s in (".pt2", ".failed")):
            with contextlib.suppress(OSError):
                log.unlink()
    for tmp in directory.glob("tmp*"):
        with contextlib.suppress(OSError):
            if tmp.is_dir() and time.time() - tmp.stat().st_mtime > 3600:
                shutil.rmtree(tmp, ignore_errors=True)
