"""`LoadOptions`: everything `infer.load` was asked, as one value that travels the load path.

The resolver (`infer.loading`) fills in what depends on the checkpoint (the
dtype a safetensors config names, a GGUF file's packed-product dtype); the builder, the
placement, the streaming and the parallel builds read what they need from it. Nothing
threads ``dtype`` / ``compute_dtype`` / ``quantize`` / ``validate`` one by one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from infer.quant.convert import check_scheme

ProgressFn = Callable[[int, int], None]  # (modules done, modules total)


@dataclass(frozen=True)
class LoadOptions:
    """How a checkpoint becomes a model.

    * ``dtype``: activations, norms, biases and float matrices.
    * ``compute_dtype``: the matrix products of packed modules (GGUF: bfloat16 unless a
      dtype was asked for); None means ``dtype``.
    * ``quantize``: ``"q4_0"`` / ``"int8"`` quantizes float linear layers at load.
    * ``validate``: refuse weights holding NaN or inf.
    * ``device``: where the model runs (a parallel run: each rank's own device).
    * ``streaming``: stream the layers under a memory budget (`infer.streaming`), or None.
    * ``tensor_parallel`` / ``pipeline_parallel``: split across processes (`infer.distributed`).
    * ``deterministic``: fixed-tile products and attention (docs/numerics.md); otherwise a
      resident model gets its Q/K/V and gate/up projections fused.
    * ``repack_cache``: keep a GGUF file's converted matrices on disk (`infer.assembly.repack_cache`;
      resident, one-process loads only).
    * ``progress(done, total)``: called as modules load.
    """

    dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype | None = None
    quantize: str | None = None
    validate: bool = True
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    streaming: object | None = None  # an `infer.streaming.StreamingConfig`, checked by the streamed build
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    deterministic: bool = False
    repack_cache: bool = False
    progress: ProgressFn | None = None

    def __post_init__(self) -> None:
        if self.quantize is not None:
            check_scheme(self.quantize)
        if not isinstance(self.deterministic, bool):
            raise TypeError(f"deterministic must be a bool, got {self.deterministic!r}")
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def products_dtype(self) -> torch.dtype:
        """The dtype of packed matrix products: ``compute_dtype``, else ``dtype``."""
        return self.compute_dtype if self.compute_dtype is not None else self.dtype

    @property
    def parallel(self) -> bool:
        return self.tensor_parallel != 1 or self.pipeline_parallel != 1


__all__ = ["LoadOptions", "ProgressFn"]
