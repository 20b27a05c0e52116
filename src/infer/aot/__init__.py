"""Ahead-of-time compiled decode steps, cached on disk: compiled speed without waiting.

The default for a resident CPU model (``compile="auto"``): a decode step whose shape has a package
in the cache runs it; one that has none runs eagerly and its shape is built in the machine's idle
time by a background builder, for this process and the next. One job a file (`keys`, `export`,
`runtime`, `queue`, `worker`, `prune`, `settings`; `builder` and `idle` import no torch): the
table in docs/architecture.md; how packages are keyed, built, bounded and picked up:
docs/engine.md, "Compiled steps".
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infer.aot import builder, export, idle, keys, prune, queue, runtime, settings, worker
    from infer.aot.export import build
    from infer.aot.keys import (
        MULTI_ROWS,
        PACKAGE_VERSION,
        VERIFY_WIDTHS,
        fingerprint,
        named_tensors,
        package_key,
        rows_kind,
        shape_key,
        width_kind,
    )
    from infer.aot.prune import MAX_PACKAGES
    from infer.aot.queue import BuildQueue, building
    from infer.aot.runtime import MAX_LOADED, Package, PackageCache, pays
    from infer.aot.settings import SETTINGS, cache_dir
    from infer.aot.worker import Recipe

# Imported on first use: the builder and its idle watch (`infer.aot.builder`, `infer.aot.idle`)
# run this ``__init__`` too, and must not import torch (they wait in ~14 MB).
_MODULES = ("builder", "export", "idle", "keys", "prune", "queue", "runtime", "settings", "worker")
_NAMES = {
    "build": "export",
    "MULTI_ROWS": "keys", "PACKAGE_VERSION": "keys", "VERIFY_WIDTHS": "keys", "fingerprint": "keys",
    "named_tensors": "keys", "package_key": "keys", "rows_kind": "keys", "shape_key": "keys",
    "width_kind": "keys",
    "MAX_PACKAGES": "prune",
    "BuildQueue": "queue", "building": "queue",
    "MAX_LOADED": "runtime", "Package": "runtime", "PackageCache": "runtime", "pays": "runtime",
    "SETTINGS": "settings", "cache_dir": "settings",
    "Recipe": "worker",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"infer.aot.{name}")
    if name == "_prune":  # the cache directory's bounds, by its former name
        return importlib.import_module("infer.aot.prune").prune
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'infer.aot' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"infer.aot.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULES, *_NAMES])


__all__ = [
    "MAX_LOADED",
    "MAX_PACKAGES",
    "MULTI_ROWS",
    "PACKAGE_VERSION",
    "SETTINGS",
    "VERIFY_WIDTHS",
    "BuildQueue",
    "Package",
    "PackageCache",
    "Recipe",
    "build",
    "builder",
    "building",
    "cache_dir",
    "export",
    "fingerprint",
    "idle",
    "keys",
    "named_tensors",
    "package_key",
    "pays",
    "prune",
    "queue",
    "rows_kind",
    "runtime",
    "settings",
    "shape_key",
    "width_kind",
    "worker",
]  # fmt: skip
