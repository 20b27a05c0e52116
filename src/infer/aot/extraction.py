"""Loading an AOTInductor package without leaving its extraction behind.

torch's loader extracts a package's shared objects into ``<tmp>/aotinductor_XXXXXX/`` and removes
them only when the loader is destroyed, which a process ending with the package loaded never does
(5.5 MiB left in the temporary directory per process otherwise). `load_package` removes them as
soon as the code is mapped (Linux keeps a removed file's pages while mapped). Used by the decode
steps' packages (`infer.aot.runtime`) and the dequantized tiles' (`infer.aot.tiles`).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import torch


def extracted() -> set[str]:
    """The directories of the shared objects this process has mapped from torch's package
    extraction directories (``<tmp>/aotinductor_XXXXXX/...``)."""
    out = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if "/aotinductor_" in path and path.endswith(".so"):
                head, _, rest = path.partition("/aotinductor_")
                out.add(f"{head}/aotinductor_{rest.split('/', 1)[0]}")
    return out


def remove_extracted(directories: set[str]) -> None:
    """Remove the directories torch extracted a package into (its code mapped already)."""
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def load_package(path: Path) -> Any:
    """torch's loader of the package at ``path`` (model ``"model"``, one thread of calls, on the
    CPU), its extraction directory removed."""
    before = extracted()
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1, False)
    remove_extracted(extracted() - before)
    return loader


__all__ = ["extracted", "load_package", "remove_extracted"]
