"""Dequantized tiles as ahead-of-time packages: `infer.quant.tiles`' one-pass kernels without
compiling in the process (its ``packaged`` mode, the default: this module registers itself there
as the kernels' `infer.quant.tiles.Provider` when imported, which the load path does).

A tile kernel depends only on its form, its shapes, the tile dtype, the thread count and the CPU,
never on a checkpoint's values, so one package per `Spec` serves every model of that shape. A
tile whose package is missing runs eagerly and its spec is queued for the package cache's
background builder (`infer.aot.builder`: idle time, one worker at a time, at ``SCHED_IDLE``); the
worker (`build`) exports the tile with static shapes, compiles it with AOTInductor, checks the
package against the eager expression bitwise and moves it into place. Loading a package maps its
code (~2 MB) through torch's C++ loader: inductor is never imported here (the in-process mode,
``INFER_DEQUANT=compiled``, costs ~230 MiB). Where it is: docs/quantization.md, "Dequantization".
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infer.aot import builder, settings
from infer.aot.extraction import load_package
from infer.quant import routes, tiles

Kernel = Callable[..., torch.Tensor]
Arg = tuple[Any, ...]  # ("tensor", shape, dtype) | ("none",) | ("int", n) | ("dtype", name)
VERSION = 1
SUBDIR = "tiles"  # beside the decode steps' packages, in the cache directory's own folder
RECHECK_S = 1.0  # a missing package's path is looked at again this often (a build may land)


@dataclass(frozen=True)
class Spec:
    """One tile kernel: the function of `infer.quant.tiles` (by name), its arguments' shapes,
    dtypes and values, and the threads its loops are compiled for (inductor writes the count
    into the code)."""

    fn: str
    args: tuple[Arg, ...]
    threads: int

    @property
    def key(self) -> str:
        """The package's name: a hash of the spec, the source of `infer.quant.tiles`, torch's
        version and the CPU (the code is compiled for its instructions)."""
        return _key(self)

    def request(self) -> dict[str, Any]:
        return {"fn": self.fn, "args": [list(a) for a in self.args], "threads": self.threads}

    @classmethod
    def of_request(cls, raw: dict[str, Any]) -> Spec:
        args = tuple((a[0], tuple(a[1]), a[2]) if a[0] == "tensor" else tuple(a) for a in raw["args"])
        return cls(str(raw["fn"]), args, int(raw["threads"]))


@functools.cache
def _key(spec: Spec) -> str:
    parts = [VERSION, spec.fn, spec.args, spec.threads, inspect.getsource(tiles), torch.__version__,
             routes.cpu_identity()]  # fmt: skip
    return f"{builder.TILE_PREFIX}{spec.fn}-" + hashlib.sha256(repr(parts).encode()).hexdigest()[:20]


def spec_of(fn: Kernel, args: Sequence[object]) -> Spec | None:
    """The spec of ``fn(*args)``, or None where a package cannot take the call (a tensor not
    contiguous or not on the CPU: compiled code reads its inputs by the layout it was built for)."""
    out: list[Arg] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if not a.is_contiguous() or a.device.type != "cpu":
                return None
            out.append(("tensor", tuple(a.shape), str(a.dtype).removeprefix("torch.")))
        elif a is None:
            out.append(("none",))
        elif isinstance(a, torch.dtype):
            out.append(("dtype", str(a).removeprefix("torch.")))
        elif isinstance(a, int) and not isinstance(a, bool):
            out.append(("int", a))
        else:
            return None
    return Spec(fn.__name__, tuple(out), torch.get_num_threads())


def directory() -> Path:
    return settings.cache_dir() / SUBDIR


def builds_allowed() -> bool:
    """Whether missing tiles are queued for the builder: ``INFER_AOT`` builds (unset or ``on``),
    and not in a process pytest runs unless ``INFER_AOT=on`` (as for a test checkpoint)."""
    if not settings.background_builds():
        return False
    return not os.environ.get("PYTEST_CURRENT_TEST") or settings.temporary_builds()


class Packages:
    """The tile packages of this process: loaded on first use, looked for again every `RECHECK_S`
    while missing; a missing one is queued once (`builds_allowed`), a damaged one removed."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] = {}  # key -> AOTIModelPackageLoader
        self.looked: dict[str, float] = {}  # key -> when its path was last looked at
        self.queued: set[str] = set()
        self.broken: set[str] = set()  # keys that stay eager in this process
        self._lock = threading.Lock()
        self._announced = False

    def loader(self, spec: Spec) -> Any | None:
        """The loaded package of ``spec``, or None (``INFER_AOT=off``; missing: queued for a
        build; or broken)."""
        if not settings.enabled():
            return None
        key = spec.key
        found = self.loaded.get(key)
        if found is not None or key in self.broken:
            return found
        now = time.monotonic()
        if now - self.looked.get(key, -RECHECK_S) < RECHECK_S:
            return None
        with self._lock:
            self.looked[key] = now
            path = directory() / f"{key}.pt2"
            if not path.exists():
                self._queue(spec, key, path)
                return None
            try:
                found = load_package(path)
            except Exception as e:  # a damaged package: remove it, stay eager
                warnings.warn(f"infer: cannot load the tile package {path} ({e}); its tiles stay eager",
                              stacklevel=3)  # fmt: skip
                with contextlib.suppress(OSError):
                    path.unlink()
                self.broken.add(key)
                return None
            self.loaded[key] = found
            return found

    def _queue(self, spec: Spec, key: str, path: Path) -> None:
        if key in self.queued or not builds_allowed() or path.with_suffix(".failed").exists():
            return
        self.queued.add(key)
        request = {"key": key, "tile": spec.request(), "out": str(path), "source": builder.source_digest()}
        try:
            directory().mkdir(parents=True, exist_ok=True)  # (the worker's log is written there)
            builder.submit(directory().parent, [request])
        except OSError as e:  # costs speed only
            warnings.warn(f"infer: cannot queue the build of a tile package ({e})", stacklevel=4)
            return
        if not self._announced:
            self._announced = True
            print(f"infer: compiling the dequantization of packed weights ({spec.fn}, ...) in the "
                  f"background while the machine is idle (log: {builder.LOG} in {directory().parent}); "
                  "tiles run eagerly until then", file=sys.stderr, flush=True)  # fmt: skip


PACKAGES = Packages()


class _Provider:
    """`infer.quant.tiles.Provider` through this process's `PACKAGES` (looked up at each call, so
    a test may swap them)."""

    def run(self, fn: Kernel, args: Sequence[object]) -> torch.Tensor | None:
        spec = spec_of(fn, args)
        loader = None if spec is None else PACKAGES.loader(spec)
        if loader is None:
            return None
        out: torch.Tensor = loader.boxed_run([a for a in args if isinstance(a, torch.Tensor)])[0]
        return out

    def ready(self, fn: Kernel, args: Sequence[object]) -> bool:
        spec = spec_of(fn, args)
        return spec is not None and PACKAGES.loader(spec) is not None


tiles.register(_Provider())


# ---- the worker's side ---------------------------------------------------------------------------


class _Tile(torch.nn.Module):
    """``fn`` with its constant arguments bound: the tensors are the exported program's inputs."""

    def __init__(self, fn: Kernel, args: Sequence[object]) -> None:
        super().__init__()
        self.fn = fn
        self.args = list(args)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        it = iter(tensors)
        return self.fn(*(next(it) if a is _TENSOR else a for a in self.args))


_TENSOR = object()


def example(spec: Spec) -> list[object]:
    """Arguments of ``spec``'s shapes with random values (what `build` checks a package on)."""
    g = torch.Generator().manual_seed(0)
    out: list[object] = []
    for a in spec.args:
        if a[0] == "tensor":
            dtype = getattr(torch, a[2])
            if dtype == torch.uint8:
                out.append(torch.randint(0, 256, a[1], dtype=dtype, generator=g))
            else:
                out.append(torch.randn(a[1], generator=g).to(dtype))
        else:
            out.append(None if a[0] == "none" else getattr(torch, a[1]) if a[0] == "dtype" else int(a[1]))
    return out


def build(spec: Spec, out: Path) -> None:
    """Export and compile ``spec``'s tile into the package ``out``, checked bitwise against the
    eager expression on random inputs before it is moved into place (a mismatch raises)."""
    if spec.fn not in tiles.KERNELS:
        raise ValueError(
            f"{spec.fn!r} is not a tile kernel of infer.quant.tiles ({', '.join(tiles.KERNELS)})"
        )
    fn = getattr(tiles, spec.fn)
    torch.set_num_threads(spec.threads)
    torch._inductor.config.cpp.threads = spec.threads
    args = example(spec)
    module = _Tile(fn, [_TENSOR if isinstance(a, torch.Tensor) else a for a in args])
    tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
    program = torch.export.export(module, tensors, strict=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.pt2")
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
        loader = load_package(tmp)
        got = loader.boxed_run(list(tensors))[0]
        want = fn(*args)
        if not torch.equal(got, want):
            raise RuntimeError(f"the compiled tile {spec.fn} differs from its eager expression")
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


__all__ = ["PACKAGES", "Packages", "Spec", "build", "builds_allowed", "directory", "example", "spec_of"]
