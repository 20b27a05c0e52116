"""`StreamingConfig`: how a model larger than the device memory is run layer group by layer group."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from infer.streaming.stats import ProgressEvent

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
}
MAX_BYTES = 2**63 - 1
DEFAULT_READ_TIMEOUT = 60.0  # seconds; generous: a healthy disk reads a layer group in well under a second
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: int | str, field: str = "size") -> int:
    """``6GB`` (10^9), ``512MiB`` (2^20), ``1.5G`` (2^30) or an int -> bytes.

    Raises `ValueError` naming ``field`` and the value for anything else: other types,
    unparsable text, negative sizes and sizes of 2^63 bytes or more.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{field}: expected bytes as an int or a string like '6GB', found {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(value)
        unit = m.group(2).upper() if m else ""
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"{field}: cannot parse {value!r} as a size; expected a number with a unit in "
                "B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB, K, M, G (powers of 2)"
            )
        if len(m.group(1)) > 40:  # far beyond MAX_BYTES; keeps Fraction's work bounded
            raise ValueError(f"{field}: {value!r} is too large a size (at most 2^63 - 1 bytes)")
        n = int(Fraction(m.group(1)) * _UNITS[unit])  # exact: no float overflow or rounding
    if n < 0:
        raise ValueError(f"{field}: expected a size >= 0, found {value!r}")
    if n > MAX_BYTES:
        raise ValueError(f"{field}: {value!r} is too large a size (at most 2^63 - 1 bytes)")
    return n


def format_bytes(n: float) -> str:
    """Bytes in MiB/GiB with two decimals: ``1.50 GiB``."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    if abs(n) >= 2**10:
        return f"{n / 2**10:.2f} KiB"
    return f"{int(n)} B"


@dataclass
class StreamingConfig:
    """How to stream a model's layers through a memory budget.

    Only ``memory_budget`` needs setting: every setting left at ``None`` is chosen so
    the plan fits the budget (the longest context up to the default, the largest
    prefill chunk, prefetch if it fits, groups of 4, 2 or 1 layers, as many resident
    layers as fit). A setting given explicitly is a constraint; if it cannot fit,
    loading fails with a `BudgetError` that says what would.

    Args:
        layer_group_size: layers moved to the device as one unit (>= 1; None: chosen).
        memory_budget: the device memory the model may use, as bytes or a string
            (``"6GB"``, the default; ``"512MiB"``). It covers the resident weights, the group buffers,
            the KV cache for ``max_batch_size`` x ``max_context`` tokens and the
            activation workspace of one forward of ``max_prefill_tokens`` tokens. On
            CPU, device memory is the process's anonymous memory.
        prefetch: double buffering: load group ``i + 1`` while group ``i`` computes.
            ``False`` is the synchronous debugging mode (one buffer, no thread); None:
            on when it fits.
        pin_memory: page-locked host staging buffers for asynchronous copies (CUDA).
        on_progress: called with a `ProgressEvent` after each layer group (or head
            chunk) is loaded and after it is computed.
        host_memory_budget: bytes of page-locked host memory for caching streamed
            groups after their first read (CUDA: later tokens copy from host RAM instead
            of reading the checkpoint again). ``0`` disables the host tier. Ignored on
            CPU, where host and device are the same memory and the OS page cache of the
            memory-mapped checkpoint plays this role.
        max_context: tokens per sequence the KV cache is planned for (None: the
            model's ``max_position_embeddings``, at most 4096, shorter if that does not fit).
        max_batch_size: sequences per batch the KV cache and workspace are planned for.
        max_prefill_tokens: tokens per forward the activation workspace is planned for
            (None: up to 512, fewer if that does not fit). Generation feeds longer prompts
            in chunks of this size; a longer forward is refused.
        max_resident_layers: cap on the layers kept resident (``None``: as many as fit;
            ``0`` streams every layer, for debugging and tests).
        resident_embeddings: keep the embedding and ``lm_head`` on the device
            (``None``: when they fit; ``False``: always stream them: float ones only, in one
            process, `infer.combinations.REFUSED`).
        head: ``False`` loads no output head and plans no logits: the model computes hidden states
            and hook points only (`infer.lens`: ``run_with_cache(..., stop_at_layer=n)``,
            ``save_activations``), and a forward that needs logits is refused by name. A tied
            packed embedding keeps the head's packed rows as its own (lookups as resident).
        trace: record a per-unit timeline (read / copy / compute intervals) in the stats.
        read_timeout: seconds a forward waits for one unit's weights before raising
            ``TimeoutError`` (a stalled disk or network file system; default 60); ``None``: forever.
    """

    layer_group_size: int | None = None
    memory_budget: int | str = "6GB"
    prefetch: bool | None = None
    pin_memory: bool = True
    on_progress: Callable[[ProgressEvent], None] | None = None
    host_memory_budget: int | str = 0
    max_context: int | None = None
    max_batch_size: int = 1
    max_prefill_tokens: int | None = None
    max_resident_layers: int | None = None
    resident_embeddings: bool | None = None
    head: bool = True
    trace: bool = False
    read_timeout: float | None = DEFAULT_READ_TIMEOUT

    def __post_init__(self) -> None:
        self.validate()

    @property
    def budget_bytes(self) -> int:
        return parse_bytes(self.memory_budget, "StreamingConfig.memory_budget")

    @property
    def host_budget_bytes(self) -> int:
        return parse_bytes(self.host_memory_budget, "StreamingConfig.host_memory_budget")

    def validate(self) -> None:
        """Raise `ValueError` naming the field, the expected and the found value."""

        def positive_int(name: str, value: object, allow_none: bool = False, minimum: int = 1) -> None:
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"StreamingConfig.{name}: expected an int >= {minimum}, found {value!r}")

        positive_int("layer_group_size", self.layer_group_size, allow_none=True)
        if self.budget_bytes <= 0:
            raise ValueError(
                f"StreamingConfig.memory_budget: expected a positive size, found {self.memory_budget!r}"
            )
        if self.host_budget_bytes < 0:
            raise ValueError(
                f"StreamingConfig.host_memory_budget: expected a size >= 0, found {self.host_memory_budget!r}"
            )
        if self.prefetch is not None and not isinstance(self.prefetch, bool):
            raise ValueError(
                f"StreamingConfig.prefetch: expected None, True or False, found {self.prefetch!r}"
            )
        for name in ("pin_memory", "trace", "head"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"StreamingConfig.{name}: expected True or False, found {getattr(self, name)!r}"
                )
        if self.resident_embeddings is not None and not isinstance(self.resident_embeddings, bool):
            raise ValueError(
                "StreamingConfig.resident_embeddings: expected None, True or False, "
                f"found {self.resident_embeddings!r}"
            )
        if self.on_progress is not None and not callable(self.on_progress):
            raise ValueError(
                f"StreamingConfig.on_progress: expected a callable or None, found {self.on_progress!r}"
            )
        timeout = self.read_timeout
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ValueError(
                "StreamingConfig.read_timeout: expected None or a finite number of seconds > 0, "
                f"found {timeout!r}"
            )
        positive_int("max_context", self.max_context, allow_none=True)
        positive_int("max_batch_size", self.max_batch_size)
        positive_int("max_prefill_tokens", self.max_prefill_tokens, allow_none=True)
        positive_int("max_resident_layers", self.max_resident_layers, allow_none=True, minimum=0)
        if (
            self.max_context is not None
            and self.max_prefill_tokens is not None
            and self.max_prefill_tokens > self.max_context
        ):
            raise ValueError(
                f"StreamingConfig.max_prefill_tokens ({self.max_prefill_tokens}) exceeds "
                f"max_context ({self.max_context})"
            )
