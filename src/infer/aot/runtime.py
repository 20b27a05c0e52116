"""The runtime loader: running packages in a process, and one model's cache of them.

`Package` loads a package onto the model's own tensors and runs a decode step with it, checking
what compiled code cannot (the weights at load, the step's inputs at every call: a mismatch is a
`ValueError`, never a crash). `PackageCache` is what `infer.execution.Execution` asks for the
package of a step's shape. `pays` says whether a model gets packages at all.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from infer.aot import settings
from infer.aot.export import kv_inputs, sampling_inputs_of, state_inputs, tensor_specs
from infer.aot.extraction import load_package
from infer.aot.keys import named_tensors, package_key
from infer.aot.queue import BuildQueue
from infer.aot.settings import cache_dir
from infer.execution import StepFeed, StepOutput
from infer.kv.cache import KVCache
from infer.models.base import DecoderLM
from infer.sampling import Sampling

if TYPE_CHECKING:
    from infer.aot.worker import Recipe

MAX_LOADED = 8  # packages one process holds (each ~10 MB of code)


def pays(model: DecoderLM) -> bool:
    """Whether a compiled decode step is faster than the eager one for ``model``: not when a
    packed weight has no kernel for its compute dtype (``dtype=torch.float32`` on a GGUF file;
    docs/performance.md, *Compiled by default*)."""
    from infer.quant.linear import QuantizedLinear

    return not any(
        isinstance(m, QuantizedLinear) and m.fmt != "dense" and not m.use_kernel for m in model.modules()
    )


def _fits(t: torch.Tensor, spec: list[Any]) -> bool:
    shape, dtype = spec
    return (
        str(t.dtype).removeprefix("torch.") == dtype
        and t.dim() == len(shape)
        and all(want in (-1, got) for want, got in zip(shape, t.shape, strict=True))
        and t.is_contiguous()
    )


class Package:
    """A loaded package: the step of one shape, on the model's own tensors.

    Compiled code reads its inputs by the layout it was built for and checks nothing itself, so
    the weights are checked against the package's record at load and the step's inputs at every
    call (a mismatch is a `ValueError` naming the input, never a crash)."""

    def __init__(self, path: Path, model: DecoderLM) -> None:
        self.path = path
        self.loader = load_package(path)
        meta = self.loader.get_metadata()
        names = json.loads(meta["names"])
        tensors = {f"model.{n}": t for n, t in named_tensors(model).items()}  # as `_DecodeStep` names them
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"{path}: the model has no tensor {missing[0]!r}")
        self.weights = [tensors[n] for n in names]
        for name, want, got in zip(
            names, json.loads(meta["weights"]), tensor_specs(self.weights), strict=True
        ):
            if want != got:
                raise ValueError(
                    f"{path}: tensor {name!r} is {got} (shape, strides, dtype), the package expects {want}"
                )
        self.inputs = json.loads(meta["inputs"])
        self.rows = tuple(json.loads(meta["rows"]))
        self.widths = tuple(json.loads(meta.get("widths", "[1, 1]")))

    def __call__(self, cache: KVCache, feed: StepFeed) -> StepOutput:
        step = [
            feed.ids,
            feed.n_new,
            feed.last,
            *state_inputs(cache),
            *kv_inputs(cache),
            *sampling_inputs_of(feed.values, feed.noise),
        ]
        rows, width = feed.ids.shape
        (lo, hi), (w_lo, w_hi) = self.rows, self.widths
        fits = lo <= rows <= hi and w_lo <= width <= w_hi and len(step) == len(self.inputs)
        heads = rows if w_hi == 1 else width  # positions through the head
        if not fits or feed.mode.every_token != (w_hi > 1) or feed.last.shape[0] != heads:
            raise ValueError(
                f"{self.path}: a step of {rows} rows x {width} tokens, {feed.last.shape[0]} through the head "
                f"and {len(step)} inputs; the package serves {lo}-{hi} rows x {w_lo}-{w_hi} tokens "
                f"({'every token' if w_hi > 1 else 'the last'} through the head), {len(self.inputs)} inputs"
            )
        bad = next((i for i, (t, w) in enumerate(zip(step, self.inputs, strict=True)) if not _fits(t, w)), -1)
        if bad >= 0:
            raise ValueError(
                f"{self.path}: step input #{bad} is {tensor_specs(step[bad : bad + 1])[0]} (shape, strides, "
                f"dtype), the package expects {self.inputs[bad]} (shape with -1 for any, dtype; contiguous)"
            )
        if len({t.shape[2] for t in kv_inputs(cache) if t.shape[2]}) > 1:
            raise ValueError(f"{self.path}: the KV buffers of one step must have one capacity")
        tokens, logits, nonfinite, hidden = self.loader.boxed_run(step + self.weights)
        return StepOutput(tokens, logits, nonfinite, hidden)


class PackageCache(BuildQueue):
    """The packages of one model: loaded on demand, at most `MAX_LOADED` (least recently used
    dropped). A step whose package is missing runs eagerly and its shape is queued for the cache
    directory's builder (`infer.aot.builder`; `prepare` queues shapes ahead of need); a missing
    path is looked at again every `RECHECK_S`, so a package built meanwhile is picked up; a
    damaged one is removed and its shape stays eager. ``queue_missing=False`` notes missing
    shapes (`missing`) without queueing them (`build_missing` queues them).
    """

    RECHECK_S = 1.0

    def __init__(self, model: DecoderLM, recipe: Recipe | None, queue_missing: bool = True) -> None:
        settings.check()  # ``INFER_AOT`` is on, use or off
        super().__init__(model, recipe, queue_missing)
        self.loaded: OrderedDict[str, Package] = OrderedDict()
        self.eager: set[str] = set()  # keys that stay eager in this process (a package that failed)
        self._looked: dict[str, float] = {}  # key -> when its path was last looked at
        self._scanned, self._present = -self.RECHECK_S, False

    @property
    def enabled(self) -> bool:
        """Whether packages may run or be noted (else every step is plain eager, unbucketed)."""
        return settings.enabled() and (self.builds_allowed or self._any_packages())

    def _any_packages(self) -> bool:
        """Whether the cache directory holds a package (looked at again every `RECHECK_S`)."""
        now = time.monotonic()
        if now - self._scanned >= self.RECHECK_S:
            self._scanned = now
            self._present = cache_dir().is_dir() and any(cache_dir().glob("*.pt2"))
        return self._present

    def get(self, cache: KVCache, batch: int, mode: Sampling, width: int = 1) -> Package | None:
        """The package of this step's shape (``batch`` rows of ``width`` tokens), or None (the step
        runs eagerly; the shape is queued)."""
        if not self.enabled:
            return None  # nothing to load, nothing to note: no fingerprint, no per-step cost
        key = package_key(self.fingerprint, cache, batch, mode, width)
        if key is None:
            return None
        package = self.loaded.get(key)
        if package is not None:
            self.loaded.move_to_end(key)
            return package
        if key in self.eager:
            return None
        now = time.monotonic()
        if now - self._looked.get(key, -self.RECHECK_S) < self.RECHECK_S:
            return None
        self._looked[key] = now
        path = cache_dir() / f"{key}.pt2"
        if not path.exists():
            self._missed(key, batch, mode, now, width)  # noted, and queued when due
            return None
        self._found(key)
        try:
            package = Package(path, self.model)
        except Exception as e:  # a damaged package: remove it, stay eager
            warnings.warn(f"infer: cannot load the compiled step {path} ({e}); it stays eager", stacklevel=2)
            with contextlib.suppress(OSError):
                path.unlink()
            self.eager.add(key)
            return None
        self.loaded[key] = package
        while len(self.loaded) > MAX_LOADED:
            self.loaded.popitem(last=False)
        return package
