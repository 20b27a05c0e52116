"""Dequantized tiles in one pass: packed int4 bytes -> the compute dtype's ``[K, rows]``, compiled.

Eagerly, a tile of packed weights takes six to eight passes over its values (split the nibbles,
interleave them, transpose, widen to float32, scale, shift, round), each through memory: 1-2 G
weights/s a thread. Written as one broadcast expression per form — the bytes viewed in their
blocked order, both nibbles taken by one broadcast shift, then scale, zero and rounding — inductor
makes of it a single vectorized loop over bytes that stay in cache: 6-8 G weights/s a thread
(docs/quantization.md, "Dequantization"). The arithmetic is the eager tile's, operation for
operation (a multiply, then an add, then one rounding), so a compiled tile equals the eager one
bitwise (`tests/unit/test_quant_tiles.py`).

A kernel is built per form and tile shape (static shapes: the shapes a model's tiles take are few,
and a static shape vectorizes best), for matrices of at least `MIN_WEIGHTS` weights. ``INFER_DEQUANT``
says how:

* ``packaged`` (the default): ahead-of-time packages built in idle time, loaded by torch's C++
  loader; a tile whose package is not built yet runs eagerly. The packages are `infer.aot.tiles`'
  (a higher floor: it registers itself here as the `Provider` when imported, as the load path does).
* ``compiled``: ``torch.compile`` in the process (inductor's cache on disk serves later processes);
  it loads inductor, ~230 MiB of resident memory (SmolLM2: 748 -> 980 MiB peak). Where inductor
  cannot compile (no C++ compiler) the first failure says so once and every tile stays eager.
* ``eager``: never.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from infer.quant import int4

GROUP = 32
MIN_WEIGHTS = 1 << 19  # matrices smaller than this keep eager tiles (a compile would not pay)
Kernel = Callable[..., torch.Tensor]
_broken: list[str] = []  # why compiling failed, once
_lock = threading.Lock()


MODES = ("packaged", "compiled", "eager")


def mode() -> str:
    """``INFER_DEQUANT`` (read when used): one of `MODES`, ``packaged`` when unset."""
    value = os.environ.get("INFER_DEQUANT", "packaged").strip().lower()
    if value not in MODES:
        raise ValueError(f"INFER_DEQUANT must be one of {', '.join(MODES)}, got {value!r}")
    return value


def enabled() -> bool:
    """Whether tiles compile in the process (``INFER_DEQUANT=compiled``, and nothing failed to)."""
    return mode() == "compiled" and not _broken


def _nibbles(byte: torch.Tensor) -> torch.Tensor:
    """``byte [..., 32]`` -> ``[..., 2, 32]``: each byte's low nibble (the block's row ``j``), then
    its high nibble (row ``j + 32``), by one broadcast shift."""
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=byte.device).view(2, 1)
    return (byte.unsqueeze(-2) >> shifts) & 15


def one_plane(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, k: int, dtype: torch.dtype
) -> torch.Tensor:
    """One int4 plane: ``packed`` ``[rows, K/2]`` (whole blocks), ``scale`` / ``zero`` ``[K/32, rows]``
    float32: ``q * scale + (zero - 8 * scale)`` as ``[K, rows]``."""
    nb = packed.shape[0] // int4.BLOCK_N
    byte = packed.reshape(nb, k, int4.BLOCK_N // 2).permute(1, 0, 2)  # [K, nb, 32]
    q = _nibbles(byte).reshape(k // GROUP, GROUP, nb * int4.BLOCK_N).to(torch.float32)
    w = q * scale[:, None, :] + (zero - 8 * scale)[:, None, :]
    return w.reshape(k, nb * int4.BLOCK_N).to(dtype)


def joined(lo: torch.Tensor, hi: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, groups: int,
           size: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Two nibbles per weight, ``c = 16 * hi + lo``: ``(c - 136) * scale + zero`` (two planes, or the
    paired form's halves). ``lo`` / ``hi``: the bytes ``[groups, size, nb, 32]`` holding each weight's
    low / high nibble; ``scale`` / ``zero`` ``[groups, rows]`` float32; out ``[groups * size, rows]``."""
    nb = lo.shape[2]
    c = torch.bitwise_left_shift(_nibbles(hi), 4).bitwise_or_(_nibbles(lo))  # [groups, size, nb, 2, 32]
    f = c.reshape(groups, size, nb * int4.BLOCK_N).to(torch.float32) - 136.0
    w = f * scale[:, None, :] + zero[:, None, :]
    return w.reshape(groups * size, nb * int4.BLOCK_N).to(dtype)


def two_planes(packed: torch.Tensor, packed_hi: torch.Tensor | None, scale: torch.Tensor, zero: torch.Tensor,
               k: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Two planes side by side in ``packed`` ``[rows, K]`` (or the high one in ``packed_hi``
    ``[rows, K/2]``), the low plane's ``scale`` / ``zero`` ``[K/32, rows]``: ``[K, rows]``."""
    nb = packed.shape[0] // int4.BLOCK_N
    half = int4.BLOCK_N // 2
    if packed_hi is None:
        byte = packed.reshape(nb, 2, k, half)  # [nb, plane, K, 32]
        lo, hi = byte[:, 0], byte[:, 1]
    else:
        lo, hi = packed.reshape(nb, k, half), packed_hi.reshape(nb, k, half)
    lo = lo.reshape(nb, k // GROUP, GROUP, half).permute(1, 2, 0, 3)  # [K/32, 32, nb, 32]
    hi = hi.reshape(nb, k // GROUP, GROUP, half).permute(1, 2, 0, 3)
    return joined(lo, hi, scale, zero, k // GROUP, GROUP, dtype)


def paired(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, k: int, dtype: torch.dtype
) -> torch.Tensor:
    """The paired form (`infer.quant.planes`): each group of 32 packed columns holds a group of 16
    weights, low nibbles first; ``scale`` / ``zero`` ``[K/16, rows]`` float32, a weight
    ``scale * (c - 136) + 17 * zero``: ``[K, rows]``."""
    nb = packed.shape[0] // int4.BLOCK_N
    half = int4.BLOCK_N // 2
    byte = packed.reshape(nb, k // 16, 2, 16, half).permute(1, 3, 2, 0, 4)  # [K/16, 16, half, nb, 32]
    return joined(byte[:, :, 0], byte[:, :, 1], scale, 17 * zero, k // 16, 16, dtype)


@functools.cache
def _compiled(fn: Kernel, key: tuple[object, ...]) -> Kernel:
    """``fn`` compiled for one tile shape (``key``), as a code object of its own: dynamo keeps its
    compiled entries (and its recompilation limit) per code object."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{len(_seen)}")
    clone = types.FunctionType(code, fn.__globals__, name=code.co_name)
    return torch.compile(clone, dynamic=False, fullgraph=True)


_seen: set[tuple[object, ...]] = set()


KERNELS = ("one_plane", "two_planes", "paired")  # what a package may be built of


class Provider(Protocol):
    """Where the packaged mode's kernels come from (`infer.aot.tiles`)."""

    def run(self, fn: Kernel, args: Sequence[object]) -> torch.Tensor | None:
        """``fn(*args)`` through its package, None where there is none (yet)."""
        ...

    def ready(self, fn: Kernel, args: Sequence[object]) -> bool:
        """Whether ``fn(*args)`` has a package loaded (a missing one is queued for a build)."""
        ...


_provider: list[Provider] = []  # the packages' provider, once registered


def register(provider: Provider) -> None:
    """Make ``provider`` the packaged mode's source of kernels (`infer.aot.tiles` at import)."""
    _provider[:] = [provider]


def fast(fn: Kernel, *args: object) -> bool:
    """Whether ``fn(*args)`` runs in one pass (compiled here, or its package loaded); in the
    packaged mode a missing package is queued for the builder."""
    if mode() == "packaged":
        return bool(_provider) and _provider[0].ready(fn, args)
    return enabled()


def run(fn: Kernel, *args: object) -> torch.Tensor | None:
    """``fn(*args)`` through its package or compiled kernel (`mode`), None where the tile stays
    eager; the first failure to compile is said once on stderr."""
    if mode() == "packaged":
        return _provider[0].run(fn, args) if _provider else None
    if not enabled():
        return None
    key = (fn, *((*a.shape, a.dtype) if isinstance(a, torch.Tensor) else a for a in args))
    try:
        if key in _seen:
            return _compiled(fn, key)(*args)
        with _lock:  # the first call compiles: one at a time (a first prompt on several threads)
            out = _compiled(fn, key)(*args)
            _seen.add(key)
            return out
    except Exception as e:  # inductor needs a C++ compiler; anything else it raises is the same case
        if not _broken:
            _broken.append(f"{type(e).__name__}: {e}")
            print(f"infer: dequantized tiles stay eager (compiling them failed: {_broken[0][:200]})",
                  file=sys.stderr, flush=True)  # fmt: skip
        return None


__all__ = [
    "KERNELS",
    "MODES",
    "enabled",
    "fast",
    "joined",
    "mode",
    "one_plane",
    "paired",
    "run",
    "two_planes",
]
