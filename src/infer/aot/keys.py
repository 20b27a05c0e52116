"""Fingerprinting: which package serves a decode step.

`fingerprint` hashes everything a package's code depends on (weights' names, shapes, dtypes and
strides, module classes, config, torch, CPU capability, machine, `PACKAGE_VERSION`, infer's
source); `shape_key` / `package_key` add the step's shape and sampling mode. `named_tensors` names
every tensor of the model for the fingerprint, the export and the loaded package.
"""

from __future__ import annotations

import contextlib
import hashlib
import platform
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from infer.aot import builder
from infer.kv.cache import KVCache
from infer.models.base import DecoderLM
from infer.sampling import Sampling

PACKAGE_VERSION = 4  # 2: one package per rows kind and mode, for every KV capacity; 3: the hidden state
# out; 4: verify passes (every fed token through the head)
MULTI_ROWS = (
    2,
    16,
)  # the rows one multi-row package serves (inside every packed kernel's and the head's branches)
# Tokens per row one verify package serves (a dynamic dimension): a pass of one row's last token and
# up to 15 proposals. Its products have at most 16 rows, inside every packed kernel's branches.
VERIFY_WIDTHS = (2, 16)


# ---- the model's tensors, by name --------------------------------------------------------


@contextlib.contextmanager
def all_modules_named(model: nn.Module) -> Iterator[None]:
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
    with all_modules_named(model):
        out = {n: t.detach() for n, t in model.named_parameters()}
        out.update((n, t) for n, t in model.named_buffers())
        return out


# ---- the fingerprint and the package keys --------------------------------------------------


def fingerprint(model: DecoderLM) -> str:
    """A hash of what a package of ``model`` depends on besides the step's shape (module docstring)."""
    h = hashlib.sha256()
    parts: list[Any] = [
        PACKAGE_VERSION,
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        platform.machine(),
        builder.source_digest(),  # a package is code generated from infer's source
        repr(model.config),
        str(model.cache_dtype),  # the KV tensors' dtype (`DecoderLM.kv_dtype`)
        [type(m).__qualname__ for m in model.modules()],
    ]
    for name, t in named_tensors(model).items():
        parts.append((name, tuple(t.shape), tuple(t.stride()), str(t.dtype), t.device.type))
    h.update(repr(parts).encode())
    return h.hexdigest()[:24]


def rows_kind(batch: int) -> str | None:
    """Which package a step of ``batch`` rows runs: ``"1"``, ``"2-16"`` (`MULTI_ROWS`), or None (eager)."""
    if batch == 1:
        return "1"
    lo, hi = MULTI_ROWS
    return f"{lo}-{hi}" if lo <= batch <= hi else None


def width_kind(batch: int, width: int, mode: Sampling) -> str | None:
    """Which tokens-per-row a package of this step serves: ``""`` (a decode step: one token per
    row), ``"w2-16"`` (a verify pass of one row, `VERIFY_WIDTHS`), or None (it runs eagerly: a
    verify pass of several rows, or wider than `VERIFY_WIDTHS`)."""
    if not mode.every_token:
        return "" if width == 1 else None
    lo, hi = VERIFY_WIDTHS
    return f"w{lo}-{hi}" if batch == 1 and lo <= width <= hi else None


def package_key(fp: str, cache: KVCache, batch: int, mode: Sampling, width: int = 1) -> str | None:
    """The package a step of ``batch`` rows of ``width`` tokens on ``cache`` runs, or None (it runs
    eagerly: more rows than `MULTI_ROWS`, a verify pass no package serves, or a cache with ring
    buffers, which only the engine's never has)."""
    if cache.ring_slots is not None:
        return None
    return shape_key(fp, batch, mode, width)


def shape_key(fp: str, batch: int, mode: Sampling, width: int = 1) -> str | None:
    """The name of the package serving steps of ``batch`` rows of ``width`` tokens in ``mode``
    (`package_key`): one package per rows kind (`rows_kind`), width kind (`width_kind`) and
    sampling mode, for every KV capacity."""
    kind, wide = rows_kind(batch), width_kind(batch, width, mode)
    if kind is None or wide is None:
        return None
    flags = "".join(str(int(f)) for f in (mode.greedy, mode.filtered, mode.exact_head))
    return f"{fp}-b{kind}{'-' + wide if wide else ''}-{flags}"
