"""``INFER_AOT`` and the package cache's directory, read when used (never at import).

``INFER_AOT``: unset builds missing packages in idle time (not for a temporary or test
checkpoint: `infer.aot.builder.temporary`), ``on`` builds those too, ``use`` builds none, ``off``
uses none (as ``compile=False``). Each function reads the variable afresh.
"""

from __future__ import annotations

import os
from pathlib import Path

SETTINGS = ("on", "use", "off")
CACHE_DIR: Path | None = None  # None: ``cache_root() / "aot"``; tests and benchmarks point it elsewhere


def setting() -> str:
    """``INFER_AOT`` as set, lower case (``on`` when unset)."""
    return os.environ.get("INFER_AOT", "on").strip().lower()


def check() -> None:
    """A `ValueError` naming ``INFER_AOT`` unless it is one of `SETTINGS`."""
    value = setting()
    if value not in SETTINGS:
        raise ValueError(f"the environment variable INFER_AOT must be on, use or off, got {value!r}")


def enabled() -> bool:
    """Whether packages are used at all (``INFER_AOT`` is not ``off``)."""
    return setting() != "off"


def background_builds() -> bool:
    """Whether the shapes found missing are built in the background (``INFER_AOT`` unset or ``on``)."""
    return setting() == "on"


def temporary_builds() -> bool:
    """Whether temporary and test checkpoints (`infer.aot.builder.temporary`) are built too: only when
    asked, ``INFER_AOT=on``."""
    return background_builds() and "INFER_AOT" in os.environ


def cache_dir() -> Path:
    """The package cache's directory: `CACHE_DIR`, or ``aot`` in infer's cache (``~/.cache/infer``)."""
    if CACHE_DIR is not None:
        return CACHE_DIR
    from infer.gguf.tokenizer import cache_root

    return cache_root() / "aot"
