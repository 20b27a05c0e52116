"""Which route a packed product of many rows takes (the packed kernel, or dequantized tiles into a
GEMM), measured once per weight form on the CPU and thread count it runs on.

The crossover is measured on a slice of the weight (`measure`) and kept in
``$XDG_CACHE_HOME/infer/routes/<cpu>.json`` (`RouteTable`, keyed by `cpu_key`); ``INFER_ROUTES=off``
uses the fixed `infer.quant.linear.KERNEL_MAX_ROWS`; compiled steps always take the kernel. The
same table keeps each model shape's measured prompt chunk (`infer.engine.chunks`).
See docs/quantization.md, "Which route, by rows".
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROUTE_FLOOR = 16  # products of at most this many rows take the kernel without asking (see above)
KERNEL_POINTS = (1, 4, 16, 32, 64, 128, 256)  # rows the kernel is timed at, until the tiles win twice
TILE_POINTS = (16, 64, 256)  # rows the tiles are timed at (their cost is affine in the rows)
BUDGET_S = 4.0  # the most one form's measurement may take (it stops early past this)
GEMMS = ("matmul", "onednn")
ROUTES_VERSION = 2  # 2: tiles dequantized in one compiled pass (`infer.quant.tiles`)


@dataclass(frozen=True)
class Route:
    """The measured route of one form: the kernel up to ``kernel_max_rows`` rows, tiles multiplied by
    ``gemm`` beyond; ``kernel_ms`` / ``tiles_ms``: the times measured (rows -> ms, on the slice)."""

    kernel_max_rows: int
    gemm: str
    kernel_ms: dict[str, float]
    tiles_ms: dict[str, float]


def enabled() -> bool:
    """``INFER_ROUTES`` is not ``off`` (read when used)."""
    value = os.environ.get("INFER_ROUTES", "on").strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"INFER_ROUTES must be 'on' or 'off', got {value!r}")
    return value == "on"


@functools.cache
def cpu_identity() -> tuple[str, str, str]:
    """The CPU's model name and flags (``/proc/cpuinfo``'s first), and the platform."""
    name, flags = "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].strip()
    return name, flags, sys.platform


def cpu_key() -> str:
    """What a measurement depends on besides the form: the CPU's model name and flags, torch's version
    and the thread count. A hash of them names the table's file."""
    name, flags, platform = cpu_identity()
    parts = [ROUTES_VERSION, name, flags, torch.__version__, torch.get_num_threads(), platform]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def routes_dir() -> Path:
    """``INFER_ROUTES_DIR``, else ``$XDG_CACHE_HOME/infer/routes`` (beside infer's other caches)."""
    override = os.environ.get("INFER_ROUTES_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "infer" / "routes"


class RouteTable:
    """The routes measured on one CPU (`cpu_key`), by form; read from and written to its file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.routes: dict[str, Route] = {}
        self.chunks: dict[str, dict[str, Any]] = {}  # model shape -> its prompt chunk (`infer.engine.chunks`)
        self._lock = threading.Lock()
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            raw = json.loads(path.read_text())
            self.routes = {form: Route(**entry) for form, entry in raw["routes"].items()}
            chunks = raw.get("chunks", {}).items()
            self.chunks = {key: dict(entry) for key, entry in chunks if "chunk" in entry}

    def get(self, form: str) -> Route | None:
        return self.routes.get(form)

    def put(self, form: str, route: Route) -> None:
        """Record ``route`` and write the table."""
        with self._lock:
            self.routes[form] = route
            self._write()

    def put_chunk(self, key: str, entry: dict[str, Any]) -> None:
        """Record a model shape's prompt chunk (``{"chunk": n, ...}``) and write the table."""
        with self._lock:
            self.chunks[key] = entry
            self._write()

    def _write(self) -> None:
        """The table to its file, atomically (a reader sees the old file or the new)."""
        with contextlib.suppress(OSError):  # costs speed only: measured again next process
            self.path.parent.mkdir(parents=True, exist_ok=True)
            body = {"cpu": cpu_key(), "routes": {f: asdict(r) for f, r in sorted(self.routes.items())},
                    "chunks": dict(sorted(self.chunks.items()))}  # fmt: skip
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".routes-")
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, indent=1)
            os.replace(tmp, self.path)


@functools.cache
def _table(path: Path) -> RouteTable:
    return RouteTable(path)


def table() -> RouteTable:
    """This CPU's table (one object per file per process)."""
    return _table(routes_dir() / f"{cpu_key()}.json")


def forget() -> None:
    """Drop the tables read in this process (the next `table` reads its file again)."""
    _table.cache_clear()


def _time_ms(fn: Callable[[], object], clock: Callable[[], float], reps: int = 3) -> float:
    fn()  # warm: first-touch pages, oneDNN's primitive cache
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return 1e3 * statistics.median(times)


def _interpolate(points: dict[int, float], rows: int) -> float:
    """A time at ``rows`` from measured ``points`` (rows -> ms): linear between them, extended along
    the last two past the end."""
    xs = sorted(points)
    if rows <= xs[0]:
        return points[xs[0]]
    if len(xs) == 1:
        return points[xs[0]] * rows / xs[0]
    i = next((i for i, x in enumerate(xs) if x >= rows), len(xs) - 1)
    a, b = xs[max(0, i - 1)], xs[max(1, i)]
    slope = (points[b] - points[a]) / (b - a)
    return points[a] + slope * (rows - a)


def measure(
    kernel: Callable[[int], Callable[[], object]] | None,
    tiles: Callable[[int, str], Callable[[], object]],
    gemms: tuple[str, ...] = GEMMS,
    clock: Callable[[], float] = time.perf_counter,
) -> Route:
    """Time both routes on one form and choose: ``kernel(rows)`` / ``tiles(rows, gemm)`` return a
    product of ``rows`` rows to time (``kernel`` None: the form has no kernel here). The tiles are
    timed at `TILE_POINTS` with each GEMM, the faster GEMM kept; the kernel at `KERNEL_POINTS` until
    the tiles win twice in a row (or `BUDGET_S` is spent); the crossover is where the two lines
    (linear between the points) meet."""
    by_gemm = {g: {r: _time_ms(tiles(r, g), clock) for r in TILE_POINTS} for g in gemms}
    t0 = clock()  # (the tiles' first call may compile their kernel: not the kernel's budget)
    gemm = min(gemms, key=lambda g: by_gemm[g][TILE_POINTS[-1]])
    tiles_ms = by_gemm[gemm]
    kernel_ms: dict[int, float] = {}
    if kernel is None:
        return Route(0, gemm, {}, _rounded(tiles_ms))
    lost = 0
    for rows in KERNEL_POINTS:
        kernel_ms[rows] = _time_ms(kernel(rows), clock)
        lost = lost + 1 if kernel_ms[rows] > _interpolate(tiles_ms, rows) else 0
        if lost >= 2 or clock() - t0 > BUDGET_S:
            break
    best = 0
    for rows in range(1, 4097):
        if _interpolate(kernel_ms, rows) <= _interpolate(tiles_ms, rows):
            best = rows
        elif rows > max(kernel_ms):
            break
    return Route(best, gemm, _rounded(kernel_ms), _rounded(tiles_ms))


def _rounded(times: dict[int, float]) -> dict[str, float]:
    return {str(rows): round(ms, 4) for rows, ms in times.items()}


def onednn_available() -> bool:
    """Whether this torch has oneDNN's linear (x86 and arm CPU builds)."""
    available = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    return bool(available) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def gemm(x: torch.Tensor, w_t: torch.Tensor, how: str) -> torch.Tensor:
    """``x [M, K] @ w_t [K, N]``: through ``matmul`` (MKL on x86 CPUs), or oneDNN's linear (float32
    only: a bfloat16 product's ``matmul`` is oneDNN's already, where the CPU has bfloat16)."""
    if how == "onednn" and x.is_cpu and x.dtype == torch.float32:
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, w_t.t(), None, "none", [None], "")
        return y
    return x @ w_t


__all__ = [
    "GEMMS",
    "ROUTE_FLOOR",
    "Route",
    "RouteTable",
    "cpu_identity",
    "cpu_key",
    "enabled",
    "forget",
    "gemm",
    "measure",
    "onednn_available",
    "routes_dir",
    "table",
]
