"""The build-queue policy: which decode shapes a process queues for the background builder, and when.

A step whose package is missing runs eagerly and queues its shape at once (`BuildQueue.prepare`
queues ahead of need); a shape dropped unbuilt is queued again after `BuildQueue.REQUEUE_S`; what
could not be queued is queued at exit. Whether anything is queued is ``INFER_AOT``'s
(`infer.aot.settings`). See docs/engine.md, "Compiled steps".
"""

from __future__ import annotations

import atexit
import contextlib
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.aot import builder, settings
from infer.aot.keys import VERIFY_WIDTHS, fingerprint, shape_key
from infer.aot.settings import cache_dir
from infer.models.base import DecoderLM
from infer.sampling import Sampling

if TYPE_CHECKING:
    from infer.aot.worker import Recipe

_MISSING: dict[str, dict[str, Any]] = {}  # build requests noted here that could not be queued yet


class BuildQueue:
    """What one model's packages queue for the builder: the base of `infer.aot.runtime.PackageCache`,
    which calls `_missed` and `_found` as its steps look for packages.

    ``queue_missing=False`` notes missing shapes (`missing`) without queueing them, for a caller
    that builds them itself (`build_missing` queues them).
    """

    REQUEUE_S = 600.0  # a shape still missing this long after it was queued, and out of the queue: again
    loaded: Mapping[str, Any]  # the packages loaded (`PackageCache`): nothing to queue for those

    def __init__(self, model: DecoderLM, recipe: Recipe | None, queue_missing: bool = True) -> None:
        self.model = model
        self.recipe = recipe
        self.queue_missing = queue_missing
        self._fingerprint: str | None = None
        self.missing: dict[str, dict[str, Any]] = {}  # key -> its build request (noted missing here)
        self.queued: dict[str, float] = {}  # key -> when this process last queued it
        self.builds: list[subprocess.Popen[bytes]] = []  # the builders this process started
        self._announced = False  # `_announce` said its line
        # The checkpoint as loaded: a request for it is dropped if its files change.
        self._temporary = recipe is not None and builder.temporary(recipe.path)
        self._files = builder.checkpoint_files(recipe.path) if recipe is not None else []

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.model)
        return self._fingerprint

    @property
    def builds_allowed(self) -> bool:
        """Whether missing shapes are queued for a build (``INFER_AOT``; a temporary or test
        checkpoint only under an explicit ``INFER_AOT=on``). Asked every step (cheap)."""
        return (settings.background_builds() and self.recipe is not None  # (on: packages are enabled)
                and (not self._temporary or settings.temporary_builds()))  # fmt: skip

    def _missed(self, key: str, batch: int, mode: Sampling, now: float, width: int = 1) -> None:
        """A step of ``key``'s shape found no package: note its request, and queue it when due."""
        if not self.builds_allowed:
            return
        if key not in self.missing:
            self.missing[key] = self._request(key, batch, mode, width)
        if self.queue_missing and self._due(key, now):
            self._queue([self.missing[key]], stacklevel=4)  # the warning names the step's caller

    def _found(self, key: str) -> None:
        """``key``'s package exists: nothing of it is left to queue, now or at exit."""
        self.missing.pop(key, None)
        _MISSING.pop(key, None)

    def prepare(self, rows: Iterable[int], modes: Iterable[Sampling] = (Sampling(),)) -> list[str]:
        """Queue, ahead of need, the missing packages serving decode steps of ``rows`` rows in
        ``modes`` (a mode with ``every_token``: the verify pass of one row), fewest rows first, in
        one submission. The keys queued; [] where builds are off (`builds_allowed`)."""
        rows, modes = list(rows), list(modes)
        bad = [v for v in rows if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(f"prepare: rows must be integers >= 1, got {bad[0]!r}")
        bad_modes = [m for m in modes if not isinstance(m, Sampling)]
        if bad_modes:
            raise TypeError(f"prepare: modes must be Sampling values (infer.sampling), got {bad_modes[0]!r}")
        if not self.builds_allowed:
            return []
        requests = []  # one submission, built in this order: each mode (in the order given) for
        for mode in modes:  # every row count, fewest rows first
            for batch in sorted(set(rows)):
                width = VERIFY_WIDTHS[0] if mode.every_token else 1
                key = shape_key(self.fingerprint, batch, mode, width)
                if key is None or key in self.missing or key in self.loaded:
                    continue
                if not _done(cache_dir() / f"{key}.pt2"):
                    self.missing[key] = self._request(key, batch, mode, width)
                    requests.append(self.missing[key])
        self._queue(requests)
        return [r["key"] for r in requests if r["key"] in self.queued]

    def build_missing(self) -> subprocess.Popen[bytes] | None:
        """Queue the shapes noted missing and not queued yet, and start the directory's builder if
        none lives (one this process started counts before it takes its lock); the builder
        started, or None."""
        if not self.builds_allowed:
            return None
        started = self._queue([r for key, r in self.missing.items() if key not in self.queued])
        alive = any(b.poll() is None for b in self.builds)  # started, maybe not holding its lock yet
        if started is None and not alive and builder.queued(cache_dir()):
            started = builder.start(cache_dir())
            self._keep(started)
        return started

    def _due(self, key: str, now: float) -> bool:
        """Whether to queue ``key`` (missing here): not queued yet, or queued `REQUEUE_S` ago and
        dropped unbuilt by the builder."""
        at = self.queued.get(key)
        if at is None:
            return True
        if now - at < self.REQUEUE_S:
            return False
        if (builder.queue_dir(cache_dir()) / f"{key}.json").exists():
            self.queued[key] = now  # still waiting its turn: look again later
            return False
        return True

    def _request(self, key: str, batch: int, mode: Sampling, width: int = 1) -> dict[str, Any]:
        assert self.recipe is not None
        return {
            "key": key, "batch": batch, "width": width, "mode": asdict(mode),
            "out": str(cache_dir() / f"{key}.pt2"),
            "recipe": asdict(self.recipe), "files": self._files, "source": builder.source_digest(),
        }  # fmt: skip

    def _queue(self, requests: list[dict[str, Any]], stacklevel: int = 3) -> subprocess.Popen[bytes] | None:
        """Queue ``requests`` (on the step thread; cost: docs/engine.md); what fails is queued at
        exit. The builder started, if this started one (``stacklevel``: the frame a warning names)."""
        todo = [r for r in requests if not _done(Path(r["out"]))]
        if not todo:
            return None
        try:
            started = builder.submit(cache_dir(), todo)
        except OSError as e:  # costs speed only: tried again at exit
            warnings.warn(f"infer: cannot queue the build of a compiled step ({e})", stacklevel=stacklevel)
            _MISSING.update((r["key"], r) for r in todo)
            return None
        now = time.monotonic()
        for r in todo:
            self.queued[r["key"]] = now
            _MISSING.pop(r["key"], None)
        self._keep(started)
        self._announce(todo)
        return started

    def _announce(self, todo: list[dict[str, Any]]) -> None:
        """One line on stderr, the first time this model queues a build: what is built, and when
        it will be used (a user's first minutes on a big model otherwise run eagerly unexplained)."""
        if self._announced or not todo:
            return
        self._announced = True
        name = Path(self.recipe.path).name if self.recipe is not None else "the model"
        batches = ", ".join(str(b) for b in sorted({int(r["batch"]) for r in todo}))
        print(
            f"infer: compiling {name}'s decode steps (batch {batches}) in the background while the "
            f"machine is idle (minutes for a big model; log: {builder.LOG} in {cache_dir()}); steps run "
            "eagerly until it is ready, then this process and later ones use it",
            file=sys.stderr,
            flush=True,
        )

    def _keep(self, started: subprocess.Popen[bytes] | None) -> None:
        if started is None:
            return
        self.builds.append(started)
        with contextlib.suppress(RuntimeError):  # reaped as soon as it exits (no zombie in a server)
            threading.Thread(target=started.wait, name="infer-builder-reaper", daemon=True).start()


def _done(out: Path) -> bool:
    """Whether the package at ``out`` exists or failed to build (nothing to queue)."""
    return out.exists() or out.with_suffix(".failed").exists()


def building(directory: Path | None = None) -> list[str]:
    """The packages the cache directory's builder has yet to build or is building ([] when no
    builder lives)."""
    return builder.pending(directory or cache_dir())


@atexit.register
def _build_at_exit() -> None:
    with contextlib.suppress(Exception):  # a build that cannot start costs speed only
        requests = [r for r in _MISSING.values() if not _done(Path(r["out"]))]
        _MISSING.clear()
        if settings.enabled() and settings.background_builds() and requests:
            builder.submit(Path(requests[0]["out"]).parent, requests)
