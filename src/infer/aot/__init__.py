"""Ahead-of-time compiled decode steps, cached on disk: compiled speed without waiting.

The default for a resident CPU model (``infer.load(path)``, ``compile="auto"``): a decode
step of a shape that has a package in the cache runs the package (loading one takes ~10 ms
and traces nothing); one that has none runs eagerly, and its shape is built after the
process, in the machine's idle time, so the next process (or this one, if it is still
running when the package appears) steps at compiled speed.

One job a file:

============== ==================================================================================
``keys``       fingerprinting: the model's tensors by name (`named_tensors`), its `fingerprint`,
               and the key of the package serving a step's shape (`shape_key`, `package_key`)
``export``     `build`: `torch.export` of the decode step of one shape, compiled by AOTInductor
``runtime``    the runtime loader: `Package` (one loaded package, checked) and `PackageCache`
               (one model's packages, loaded on demand, least recently used dropped); `pays`
``queue``      the build-queue policy (`BuildQueue`, `PackageCache`'s base): which missing shapes
               are queued for the builder and when; `building`; what is queued at exit
``worker``     ``python -m infer.aot REQUEST`` (``__main__``): the process that builds one
               package, and the `Recipe` it loads the same model by
``prune``      the bounds of the cache directory, after every build
``settings``   ``INFER_AOT`` (read when used, never at import) and the cache directory
============== ==================================================================================

* **A package** (`build`) is `torch.export` of `infer.execution.model_step` for one decode shape
  (rows, KV capacity, sampling mode), or one speculative verify pass (one row of any of
  `VERIFY_WIDTHS` tokens, every one through the head), compiled by AOTInductor into a shared library. The
  model's weights are *inputs* of the exported program, not constants, so a package holds
  code only (~10 MB) and runs on the tensors already loaded: no second copy of the weights,
  in memory or on disk.
* **Which package** (`fingerprint`, `package_key`): named after a hash of everything the
  code depends on: each weight's name, shape, dtype and strides and each module's class,
  the config, the shape, the sampling mode, torch's version, the CPU's instruction set
  (``torch.backends.cpu.get_cpu_capability()``), the machine, `PACKAGE_VERSION` and the source of
  infer itself. Another model, another machine or another version of infer finds no
  package, and builds its own.
* **Building**: a step whose package is missing runs eagerly, and its shape is queued for a
  build at once, on the step that found it missing (a JSON file in the cache directory's
  ``queue/``; `PackageCache.prepare` queues shapes ahead of need). The directory's one builder
  (`infer.aot.builder`: started by the process that queues when none lives, in a new session, so
  it outlives it) takes the queue: one build at a time on the machine, each in a worker,
  ``python -m infer.aot REQUEST``, started only once the machine is idle and stopped
  (``SIGSTOP``, `infer.aot.idle`) whenever other processes keep the CPUs busy: a build beside
  running steps slows them ~4x even at ``SCHED_IDLE`` (docs/performance.md), so it runs only
  in the gaps the user leaves. The worker (``SCHED_IDLE``, one compile thread) loads the same
  checkpoint the same way (`Recipe`), checks that its model has the same fingerprint,
  compiles, and moves the package into place atomically (``os.replace``), so a reader never
  sees a partial file. A running process picks a new package up within `PackageCache.RECHECK_S`,
  so a server steps compiled code once the gaps between its requests add up to a build. What
  could not be queued is queued at interpreter exit. The build's log is ``KEY.log``, the
  builder's ``builder.log``.
* **Bounds**: per cache directory at most one builder, ~14 MB (an interpreter without torch)
  while it waits for its turn or for quiet; a worker holds a second copy of the model and the
  compiler while it builds, and is killed when stopped for more than `infer.aot.builder.STOP_LIMIT_S`
  (25 s), its request tried again later (at most `infer.aot.builder.MAX_TRIES` times; a running
  process queues a shape dropped unbuilt again after `PackageCache.REQUEUE_S`). A request
  whose checkpoint is gone or changed is dropped before any worker starts. A build does not
  start without the memory for a second copy of the model and the compiler. A process holds
  at most `MAX_LOADED` packages (least recently used dropped); the cache directory keeps the
  newest `MAX_PACKAGES` packages and as many failure markers, with their logs (`prune`).
* **Settings** (`infer.aot.settings`, read each time they are used): ``INFER_AOT`` unset uses
  packages and builds the missing ones, except for a temporary or test checkpoint
  (`infer.aot.builder.temporary`: under the temporary directory, a pytest directory, or loaded
  under pytest), whose shapes are not queued; ``INFER_AOT=on`` builds those too; ``use`` uses
  packages and builds none; ``off`` (or ``compile=False``) uses and builds nothing.
* **Failures** cost speed only: a build that fails leaves a ``.failed`` marker (saying why)
  and that shape stays eager; a package that cannot be loaded is removed and stays eager.

Not covered: prefill (eager), verify passes of several rows (eager), streamed and parallel models
and the deterministic mode (eager: its bitwise guarantees are stated for the eager kernels), CUDA
(``compile=True`` there).
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
