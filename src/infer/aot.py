"""Ahead-of-time compiled decode steps, cached on disk: compiled speed without waiting.

The default for a resident CPU model (``infer.load(path)``, ``compile="auto"``): a decode
step of a shape that has a package in the cache runs the package (loading one takes ~10 ms
and traces nothing); one that has none runs eagerly, and its shape is built after the
process, in the machine's idle time, so the next process (or this one, if it is still
running when the package appears) steps at compiled speed.

* **A package** (`build`) is `torch.export` of `infer.step.model_step` for one decode shape
  (rows, KV capacity, sampling mode), compiled by AOTInductor into a shared library. The
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
  (`infer.builder`: started by the process that queues when none lives, in a new session, so
  it outlives it) takes the queue: one build at a time on the machine, each in a worker,
  ``python -m infer.aot REQUEST``, started only once the machine is idle and stopped
  (``SIGSTOP``, `infer.idle`) whenever other processes keep the CPUs busy: a build beside
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
  compiler while it builds, and is killed when stopped for more than `infer.builder.STOP_LIMIT_S`
  (25 s), its request tried again later (at most `infer.builder.MAX_TRIES` times; a running
  process queues a shape dropped unbuilt again after `PackageCache.REQUEUE_S`). A request
  whose checkpoint is gone or changed is dropped before any worker starts. A build does not
  start without the memory for a second copy of the model and the compiler. A process holds
  at most `MAX_LOADED` packages (least recently used dropped); the cache directory keeps the
  newest `MAX_PACKAGES` packages and as many failure markers, with their logs (`_prune`).
* **Settings**: ``INFER_AOT`` unset uses packages and builds the missing ones, except for a
  temporary or test checkpoint (`infer.builder.temporary`: under the temporary directory, a
  pytest directory, or loaded under pytest), whose shapes are not queued; ``INFER_AOT=on``
  builds those too; ``use`` uses packages and builds none; ``off`` (or ``compile=False``)
  uses and builds nothing.
* **Failures** cost speed only: a build that fails leaves a ``.failed`` marker (saying why)
  and that shape stays eager; a package that cannot be loaded is removed and stays eager.

Not covered: prefill (eager), streamed and parallel models and the deterministic mode (eager:
its bitwise guarantees are stated for the eager kernels), CUDA (``compile=True`` there).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.export import Dim

from infer import builder
from infer.cache import KVCache, round_up
from infer.loader.checkpoint import open_checkpoint
from infer.loading import build_model
from infer.models.base import DecoderLM, layer_regions
from infer.step import Sampling, SamplingValues, StepFeed, StepOutput, model_step

PACKAGE_VERSION = 3  # 2: one package per rows kind and mode, for every KV capacity; 3: the hidden state out
MAX_LOADED = 8  # packages one process holds (each ~10 MB of code)
MAX_PACKAGES = 32  # packages the cache directory keeps (newest first)
CACHE_DIR: Path | None = None  # None: ``cache_root() / "aot"``; tests point it elsewhere
# ``INFER_AOT`` in the environment: ``on`` (the default) uses the packages there are and builds
# the missing ones in idle time; ``use`` builds none; ``off`` uses and builds nothing (as ``compile=False``).
SETTINGS = ("on", "use", "off")
_SETTING = os.environ.get("INFER_AOT", "on").strip().lower()
ENABLED = _SETTING != "off"
BACKGROUND_BUILDS = _SETTING == "on"  # whether the shapes found missing are built in the background
# Temporary and test checkpoints (`infer.builder.temporary`) are built only when asked: ``INFER_AOT=on``.
TEMPORARY_BUILDS = BACKGROUND_BUILDS and "INFER_AOT" in os.environ


def cache_dir() -> Path:
    if CACHE_DIR is not None:
        return CACHE_DIR
    from infer.gguf.tokenizer import cache_root

    return cache_root() / "aot"


@dataclass(frozen=True)
class Recipe:
    """How the building process loads the same model: `infer.load`'s arguments."""

    path: str
    dtype: str | None = None
    quantize: str | None = None
    validate: bool = False
    kv_dtype: str | None = None  # `DecoderLM.kv_dtype` as set at load (None: the model's dtype)

    def load(self) -> DecoderLM:
        """The model as `infer.load` builds it (resident, on the CPU, outside the deterministic mode)."""
        checkpoint = open_checkpoint(self.path)
        options = checkpoint.options(self.dtype, quantize=self.quantize, validate=self.validate,
                                     device=torch.device("cpu"), streaming=None, tensor_parallel=1,
                                     pipeline_parallel=1, deterministic=False, repack_cache=True,
                                     progress=None)  # fmt: skip
        model, _ = build_model(checkpoint, options)
        if self.kv_dtype is not None:
            model.kv_dtype = getattr(torch, self.kv_dtype)
        return model


# ---- the model's tensors, by name --------------------------------------------------------


@contextlib.contextmanager
def _all_modules_named(model: nn.Module) -> Iterator[None]:
    """Register, for the duration, every module held in a list attribute outside the module tree
    (fused projections, a shared head) as a child, so each of its tensors has a name."""
    added: list[tuple[nn.Module, str]] = []
    todo = list(model.modules())
    seen = {id(m) for m in todo}
    while todo:
        module = todo.pop()
        for attr, value in list(vars(module).items()):
            if not isinstance(value, list):
                continue
            for i, item in enumerate(value):
                if isinstance(item, nn.Module) and id(item) not in seen:
                    name = f"{attr.strip('_')}_{i}"
                    module.add_module(name, item)
                    added.append((module, name))
                    seen.add(id(item))
                    todo.extend(item.modules())
    try:
        yield
    finally:
        for module, name in added:
            del module._modules[name]


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model``, held in its tree or in list attributes, by name."""
    with _all_modules_named(model):
        out = {n: t.detach() for n, t in model.named_parameters()}
        out.update((n, t) for n, t in model.named_buffers())
        return out


_source_digest = builder.source_digest  # a package is code generated from infer's source


def fingerprint(model: DecoderLM) -> str:
    """A hash of what a package of ``model`` depends on besides the step's shape (module docstring)."""
    h = hashlib.sha256()
    parts: list[Any] = [
        PACKAGE_VERSION,
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        platform.machine(),
        _source_digest(),
        repr(model.config),
        str(model.cache_dtype),  # the KV tensors' dtype (`DecoderLM.kv_dtype`)
        [type(m).__qualname__ for m in model.modules()],
    ]
    for name, t in named_tensors(model).items():
        parts.append((name, tuple(t.shape), tuple(t.stride()), str(t.dtype), t.device.type))
    h.update(repr(parts).encode())
    return h.hexdigest()[:24]


def pays(model: DecoderLM) -> bool:
    """Whether a compiled decode step is faster than the eager one for ``model``: not when a
    packed weight has no kernel for its compute dtype (``dtype=torch.float32`` on a GGUF file:
    every step dequantizes every weight, and inductor's fused dequantization loop is slower than
    eager's in-place passes: SmolLM2 float32 decoded 9.1 tok/s from its package, 19.4 eagerly,
    AMD EPYC)."""
    from infer.quant.linear import QuantizedLinear

    return not any(
        isinstance(m, QuantizedLinear) and m.fmt != "dense" and not m.use_kernel for m in model.modules()
    )


MULTI_ROWS = (
    2,
    16,
)  # the rows one multi-row package serves (inside every packed kernel's and the head's branches)


def rows_kind(batch: int) -> str | None:
    """Which package a step of ``batch`` rows runs: ``"1"``, ``"2-16"`` (`MULTI_ROWS`), or None (eager)."""
    if batch == 1:
        return "1"
    lo, hi = MULTI_ROWS
    return f"{lo}-{hi}" if lo <= batch <= hi else None


def package_key(fp: str, cache: KVCache, batch: int, mode: Sampling) -> str | None:
    """The package a decode step of ``batch`` rows on ``cache`` runs, or None (it runs eagerly:
    more rows than `MULTI_ROWS`, or a cache with ring buffers, which only the engine's never has)."""
    if cache.ring_slots is not None:
        return None
    return shape_key(fp, batch, mode)


def shape_key(fp: str, batch: int, mode: Sampling) -> str | None:
    """The name of the package serving decode steps of ``batch`` rows in ``mode`` (`package_key`):
    one package per rows kind (`rows_kind`) and sampling mode, for every KV capacity."""
    kind = rows_kind(batch)
    if kind is None:
        return None
    flags = "".join(str(int(f)) for f in (mode.greedy, mode.filtered, mode.exact_head))
    return f"{fp}-b{kind}-{flags}"


# ---- the exported step ---------------------------------------------------------------------


class _DecodeStep(nn.Module):
    """`model_step` for one decode shape with the cache's tensors and the sampling values as inputs."""

    def __init__(self, model: DecoderLM, template: KVCache, mode: Sampling) -> None:
        super().__init__()
        self.model = model
        self.template = template
        self.mode = mode

    def forward(
        self,
        ids: torch.Tensor,
        n_new: torch.Tensor,
        last: torch.Tensor,
        state: list[torch.Tensor],
        kv: list[torch.Tensor],
        sampling: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = _bind(self.template, state, kv)
        values = noise = None
        if sampling:
            values = SamplingValues(sampling[0], sampling[1], sampling[2])
            noise = sampling[3]
        return model_step(self.model, cache, StepFeed(ids, n_new, last, self.mode, values, noise))


def _state(cache: KVCache) -> list[torch.Tensor]:
    return [cache.slot, cache.pad] + ([cache.ring_slots] if cache.ring_slots is not None else [])


def _bind(template: KVCache, state: list[torch.Tensor], kv: list[torch.Tensor]) -> KVCache:
    """A copy of ``template`` whose tensors are ``state`` and ``kv`` (the exported program's inputs)."""
    import copy

    cache = copy.copy(template)
    cache.slot, cache.pad = state[0], state[1]
    if template.ring_slots is not None:
        cache.ring_slots = state[2]
    layers = []
    for i, layer in enumerate(template.layers):
        bound = copy.copy(layer)
        bound.cache = cache
        n = len(layer.tensors())  # k, v (and an int8 cache's scales)
        bound.k, bound.v = kv[n * i], kv[n * i + 1]
        if n == 4:
            bound.k_scale, bound.v_scale = kv[n * i + 2], kv[n * i + 3]
        layers.append(bound)
    cache.layers = layers
    cache.length, cache.plan = 0, None
    return cache


def _kv(cache: KVCache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in layer.tensors()]


def _sampling(values: SamplingValues | None, noise: torch.Tensor | None) -> list[torch.Tensor]:
    if values is None or noise is None:
        return []
    return [values.temperature, values.top_k, values.top_p, noise]


def build(model: DecoderLM, batch: int, mode: Sampling, path: Path) -> None:
    """Export and compile the decode step for steps of ``batch`` rows into ``path``: one row, or
    any count in `MULTI_ROWS` (a dynamic dimension), on any KV capacity (dynamic too: the engine's
    rows grow as they need), in the engine's layout (slot order, no rings)."""
    kind = rows_kind(batch)
    if kind is None:
        raise ValueError(
            f"build: no package serves steps of {batch} rows (1, or {MULTI_ROWS[0]}-{MULTI_ROWS[1]})"
        )
    multi = kind != "1"
    example_rows, example_capacity = (4 if multi else 1), 256
    cache = KVCache(model.config, example_rows, example_capacity, dtype=model.cache_dtype,
                    device=model.device, layers=model.kv_layers, rings=False)  # fmt: skip
    step = _DecodeStep(model, cache, mode)
    batch = example_rows

    class Functional(nn.Module):
        def forward(self, ids: Any, n_new: Any, last: Any, state: Any, kv: Any, sampling: Any, w: Any) -> Any:
            return torch.func.functional_call(step, w, (ids, n_new, last, state, kv, sampling), strict=False)

    device = model.device
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    ones = torch.ones(batch, dtype=torch.long, device=device)
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    sampling: list[torch.Tensor] = []
    if not mode.greedy:
        V = model.config.vocab_size
        sampling = [
            torch.ones(batch, device=device),
            torch.zeros(batch, dtype=torch.long, device=device),
            torch.ones(batch, device=device),
            torch.zeros(batch, V, device=device),
        ]
    inputs = (ids, ones, zeros, _state(cache), _kv(cache), sampling)
    # Dynamic dimensions: the rows (a multi-row package) and every KV buffer's slots.
    rows = Dim("rows", min=MULTI_ROWS[0], max=MULTI_ROWS[1]) if multi else None
    slots = Dim("slots", min=2, max=max(example_capacity, round_up(model.config.max_position_embeddings, 64)))

    def dims(t: torch.Tensor, kv: bool = False) -> dict[int, Any] | None:
        d: dict[int, Any] = {}
        if rows is not None:
            d[0] = rows
        if kv and t.shape[2]:
            d[2] = slots
        return d or None

    def shapes(weights: dict[str, torch.Tensor]) -> tuple[Any, ...]:
        return (dims(ids), dims(ones), dims(zeros), [dims(t) for t in _state(cache)],
                [dims(t, kv=True) for t in _kv(cache)], [dims(t) for t in sampling],
                dict.fromkeys(weights))  # fmt: skip

    def export(weights: dict[str, torch.Tensor]) -> torch.export.ExportedProgram:
        # Blocks inlined, not a nested region: their K/V writes then stay in place (`layer_regions`).
        with _all_modules_named(step), torch.no_grad(), warnings.catch_warnings(), layer_regions(False):
            # (functional_call's swaps of the weights read as side effects to dynamo: expected here)
            warnings.simplefilter("ignore", UserWarning)
            return torch.export.export(
                Functional(), (*inputs, weights), dynamic_shapes=shapes(weights), strict=True
            )

    # Every call hands each weight to the compiled code (~1 µs a tensor): only the ones the step
    # reads. The first export finds them (the fused products leave their parts' views unread:
    # SmolLM2 reads 307 of 607), the second is the program built.
    weights = named_tensors(step)
    used = _used_weights(export(weights), len(torch.utils._pytree.tree_leaves(inputs)), list(weights))
    weights = {name: weights[name] for name in used}
    exported = export(weights)
    # A weight not passed would be baked into the code (small constants, a scale, are fine).
    lifted = [*exported.state_dict.items(), *exported.constants.items()]
    baked = [name for name, t in lifted if isinstance(t, torch.Tensor) and t.numel() > 64]
    if baked:
        raise RuntimeError(f"the exported step holds tensors of its own: {baked[:3]}")
    names = list(weights)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        package = Path(tmp) / "package.pt2"
        torch._inductor.aoti_compile_and_package(
            exported,
            package_path=str(package),
            inductor_configs={
                "aot_inductor.metadata": {
                    "names": json.dumps(names),
                    "inputs": json.dumps(
                        _input_specs([ids, ones, zeros, *_state(cache)], _kv(cache), sampling)
                    ),
                    "rows": json.dumps([1, 1] if not multi else list(MULTI_ROWS)),
                    "weights": json.dumps(_specs(list(weights.values()))),
                }
            },
        )
        os.replace(package, path)


def _used_weights(exported: torch.export.ExportedProgram, n_inputs: int, names: list[str]) -> list[str]:
    """The weights (``names``, the user inputs after the ``n_inputs`` step inputs) the program reads."""
    user = torch.export.graph_signature.InputKind.USER_INPUT
    by_name = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    specs = [spec for spec in exported.graph_signature.input_specs if spec.kind == user]
    if len(specs) != n_inputs + len(names):
        expected = n_inputs + len(names)
        raise RuntimeError(f"the exported step has {len(specs)} inputs, expected {expected}")
    nodes = [by_name[spec.arg.name] for spec in specs[n_inputs:]]
    return [name for name, node in zip(names, nodes, strict=True) if node.users]


# ---- running packages ----------------------------------------------------------------------


def _specs(tensors: list[torch.Tensor]) -> list[list[Any]]:
    """What compiled code assumes of its inputs: shape, strides, dtype, contiguity."""
    return [[list(t.shape), list(t.stride()), str(t.dtype).removeprefix("torch.")] for t in tensors]


def _input_specs(
    state: list[torch.Tensor], kv: list[torch.Tensor], sampling: list[torch.Tensor]
) -> list[Any]:
    """What a package assumes of a step's inputs: each one's dtype and contiguity, its shape with
    -1 for the dynamic dimensions (the rows; a KV buffer's slots)."""
    out = []
    for group, dynamic in ((state, (0,)), (kv, (0, 2)), (sampling, (0,))):
        for t in group:
            shape = [-1 if i in dynamic else n for i, n in enumerate(t.shape)]
            out.append([shape, str(t.dtype).removeprefix("torch.")])
    return out


def _fits(t: torch.Tensor, spec: list[Any]) -> bool:
    shape, dtype = spec
    return (
        str(t.dtype).removeprefix("torch.") == dtype
        and t.dim() == len(shape)
        and all(want in (-1, got) for want, got in zip(shape, t.shape, strict=True))
        and t.is_contiguous()
    )


def _extracted() -> set[str]:
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


def _remove_extracted(directories: set[str]) -> None:
    """Remove the directories torch extracted a package into, once its code is mapped: the
    loader removes them only when it is destroyed, which a process ending with the package
    loaded never does (5.5 MiB left in the temporary directory per process otherwise). The
    mapped code stays readable (Linux keeps a removed file's pages while mapped)."""
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


class Package:
    """A loaded package: the step of one shape, on the model's own tensors.

    Compiled code reads its inputs by the layout it was built for and checks nothing itself, so
    the weights are checked against the package's record at load and the step's inputs at every
    call (a mismatch is a `ValueError` naming the input, never a crash)."""

    def __init__(self, path: Path, model: DecoderLM) -> None:
        self.path = path
        before = _extracted()
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1, False)
        _remove_extracted(_extracted() - before)
        meta = self.loader.get_metadata()
        names = json.loads(meta["names"])
        tensors = {f"model.{n}": t for n, t in named_tensors(model).items()}  # as `_DecodeStep` names them
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"{path}: the model has no tensor {missing[0]!r}")
        self.weights = [tensors[n] for n in names]
        for name, want, got in zip(names, json.loads(meta["weights"]), _specs(self.weights), strict=True):
            if want != got:
                raise ValueError(
                    f"{path}: tensor {name!r} is {got} (shape, strides, dtype), the package expects {want}"
                )
        self.inputs = json.loads(meta["inputs"])
        self.rows = tuple(json.loads(meta["rows"]))

    def __call__(self, cache: KVCache, feed: StepFeed) -> StepOutput:
        step = [
            feed.ids,
            feed.n_new,
            feed.last,
            *_state(cache),
            *_kv(cache),
            *_sampling(feed.values, feed.noise),
        ]
        rows = feed.ids.shape[0]
        lo, hi = self.rows
        if not lo <= rows <= hi or feed.ids.shape[1] != 1 or len(step) != len(self.inputs):
            raise ValueError(
                f"{self.path}: a decode step of {rows} rows x {feed.ids.shape[1]} tokens and {len(step)} "
                f"inputs; the package serves {lo}-{hi} rows x 1 token, {len(self.inputs)} inputs"
            )
        bad = next((i for i, (t, w) in enumerate(zip(step, self.inputs, strict=True)) if not _fits(t, w)), -1)
        if bad >= 0:
            raise ValueError(
                f"{self.path}: step input #{bad} is {_specs(step[bad : bad + 1])[0]} (shape, strides, "
                f"dtype), the package expects {self.inputs[bad]} (shape with -1 for any, dtype; contiguous)"
            )
        if len({t.shape[2] for t in _kv(cache) if t.shape[2]}) > 1:
            raise ValueError(f"{self.path}: the KV buffers of one step must have one capacity")
        tokens, logits, nonfinite, hidden = self.loader.boxed_run(step + self.weights)
        return StepOutput(tokens, logits, nonfinite, hidden)


class PackageCache:
    """The packages of one model: loaded on demand; the missing ones queued for the builder.

    A step whose package is missing runs eagerly and its shape is queued at once for the
    cache directory's builder (`infer.builder`), which builds it while the machine is idle;
    `prepare` queues shapes ahead of need. A package that appears while this process runs
    (built meanwhile) is picked up: a missing path is looked at again every `RECHECK_S`.
    ``queue_missing=False`` notes missing shapes (`missing`) without queueing them, for a
    caller that builds them itself (`build_missing` queues them).
    """

    RECHECK_S = 1.0
    REQUEUE_S = 600.0  # a shape still missing this long after it was queued, and out of the queue: again

    def __init__(self, model: DecoderLM, recipe: Recipe | None, queue_missing: bool = True) -> None:
        if _SETTING not in SETTINGS:
            raise ValueError(f"the environment variable INFER_AOT must be on, use or off, got {_SETTING!r}")
        self.model = model
        self.recipe = recipe
        self.queue_missing = queue_missing
        self._fingerprint: str | None = None
        self.loaded: OrderedDict[str, Package] = OrderedDict()
        self.eager: set[str] = set()  # keys that stay eager in this process (a package that failed)
        self.missing: dict[str, dict[str, Any]] = {}  # key -> its build request (noted missing here)
        self.queued: dict[str, float] = {}  # key -> when this process last queued it
        self._looked: dict[str, float] = {}  # key -> when its path was last looked at
        self.builds: list[subprocess.Popen[bytes]] = []  # the builders this process started
        self._scanned, self._present = -self.RECHECK_S, False
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
        checkpoint only under an explicit ``INFER_AOT=on``)."""
        return (ENABLED and BACKGROUND_BUILDS and self.recipe is not None
                and (TEMPORARY_BUILDS or not self._temporary))  # fmt: skip

    @property
    def enabled(self) -> bool:
        """Whether packages may run or be noted (else every step is plain eager, unbucketed)."""
        return ENABLED and (self.builds_allowed or self._any_packages())

    def _any_packages(self) -> bool:
        """Whether the cache directory holds a package (looked at again every `RECHECK_S`)."""
        now = time.monotonic()
        if now - self._scanned >= self.RECHECK_S:
            self._scanned = now
            self._present = cache_dir().is_dir() and any(cache_dir().glob("*.pt2"))
        return self._present

    def get(self, cache: KVCache, batch: int, mode: Sampling) -> Package | None:
        """The package of this step's shape, or None (the step runs eagerly; the shape is queued)."""
        if not self.enabled:
            return None  # nothing to load, nothing to note: no fingerprint, no per-step cost
        key = package_key(self.fingerprint, cache, batch, mode)
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
            if self.builds_allowed:
                if key not in self.missing:
                    self.missing[key] = self._request(key, batch, mode)
                if self.queue_missing and self._due(key, now):
                    self._queue([self.missing[key]])
            return None
        self.missing.pop(key, None)
        _MISSING.pop(key, None)
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

    def prepare(self, rows: Iterable[int], modes: Iterable[Sampling] = (Sampling(),)) -> list[str]:
        """Queue the builds of the packages serving decode steps of ``rows`` rows in ``modes`` that
        do not exist yet, ahead of need: a server calls it at start for the batch sizes its engine
        will step (a package serves one row, or any of `MULTI_ROWS`, on every KV capacity). The
        builder takes them in the machine's idle time, and this process picks each package up as
        it lands. The keys queued; [] where builds are off (`builds_allowed`)."""
        rows, modes = list(rows), list(modes)
        bad = [v for v in rows if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(f"prepare: rows must be integers >= 1, got {bad[0]!r}")
        bad_modes = [m for m in modes if not isinstance(m, Sampling)]
        if bad_modes:
            raise TypeError(f"prepare: modes must be infer.step.Sampling values, got {bad_modes[0]!r}")
        if not self.builds_allowed:
            return []
        requests = []
        for batch in sorted(set(rows)):
            for mode in modes:
                key = shape_key(self.fingerprint, batch, mode)
                if key is None or key in self.missing or key in self.loaded:
                    continue
                if not _done(cache_dir() / f"{key}.pt2"):
                    self.missing[key] = self._request(key, batch, mode)
                    requests.append(self.missing[key])
        self._queue(requests)
        return [r["key"] for r in requests if r["key"] in self.queued]

    def build_missing(self) -> subprocess.Popen[bytes] | None:
        """Queue the shapes noted missing that this process has not queued yet, and start the
        directory's builder if none lives (it takes the whole queue); the builder started, or
        None (one lives, or nothing is to be built). A builder this process started that still
        runs counts as living even before it takes its lock (a Python start-up: seconds on a busy
        machine), so a second is not started beside it."""
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
        gone from the queue unbuilt (the builder dropped it: the machine stayed busy; a long-running
        process asks again, as a new process would)."""
        at = self.queued.get(key)
        if at is None:
            return True
        if now - at < self.REQUEUE_S:
            return False
        if (builder.queue_dir(cache_dir()) / f"{key}.json").exists():
            self.queued[key] = now  # still waiting its turn: look again later
            return False
        return True

    def _request(self, key: str, batch: int, mode: Sampling) -> dict[str, Any]:
        assert self.recipe is not None
        return {
            "key": key, "batch": batch, "mode": asdict(mode), "out": str(cache_dir() / f"{key}.pt2"),
            "recipe": asdict(self.recipe), "files": self._files, "source": _source_digest(),
        }  # fmt: skip

    def _queue(self, requests: list[dict[str, Any]]) -> subprocess.Popen[bytes] | None:
        """Queue ``requests`` (on the step thread: a file each, and a builder started when none
        lives: 1-20 ms, or ~2.5 ms when one lives, once per shape; tiny model, 2 shared cores);
        what fails is queued at exit. The builder started, if this started one."""
        todo = [r for r in requests if not _done(Path(r["out"]))]
        if not todo:
            return None
        try:
            started = builder.submit(cache_dir(), todo)
        except OSError as e:  # costs speed only: tried again at exit
            warnings.warn(f"infer: cannot queue the build of a compiled step ({e})", stacklevel=3)
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


_MISSING: dict[str, dict[str, Any]] = {}  # build requests noted here that could not be queued yet


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
        if ENABLED and BACKGROUND_BUILDS and requests:
            builder.submit(Path(requests[0]["out"]).parent, requests)


def _prune(directory: Path) -> None:
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


def _yield_the_cpu() -> None:
    """Run (and let the compiler's children run) only when the CPU would otherwise idle.

    nice 19 is not enough: the user's eager steps are OpenMP regions over every core, and a
    region waits for its slowest thread, so a build that holds a core for a scheduler slice
    stalls the whole step (measured: SmolLM2 eager decode fell from 57 to 1.5 tok/s on 2 cores
    while a nice-19 build ran). ``SCHED_IDLE`` yields at once to any waking thread."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    with contextlib.suppress(OSError):
        os.nice(19)


def _main(argv: list[str]) -> int:
    """``python -m infer.aot REQUEST``: build the package asked for (the worker `infer.builder` starts)."""
    parser = argparse.ArgumentParser(prog="python -m infer.aot")
    parser.add_argument("request", help="JSON {recipe, key, batch, mode, out, files}")
    request = json.loads(parser.parse_args(argv).request)
    _yield_the_cpu()
    torch._inductor.config.compile_threads = 1  # this process only: leave the cores to the user's
    out = Path(request["out"])
    t0 = time.perf_counter()
    try:
        model = Recipe(**request["recipe"]).load()
        fp = fingerprint(model)
        if not request["key"].startswith(fp + "-"):
            raise RuntimeError(f"the model loaded here has fingerprint {fp}, not the one asked for")
        mode = Sampling(**request["mode"])
        build(model, request["batch"], mode, out)
    except Exception as e:
        out.with_suffix(".failed").write_text(f"{type(e).__name__}: {e}\n")
        print(f"failed {out.name}: {type(e).__name__}: {e}", flush=True)
        return 1
    finally:
        _prune(out.parent)
    print(f"built {out.name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


__all__ = [
    "MAX_LOADED", "MAX_PACKAGES", "Package", "PackageCache", "Recipe", "build", "building", "fingerprint",
    "package_key", "pays", "rows_kind", "shape_key",
]  # fmt: skip
