"""`QuantizedEmbedding`: an ``nn.Embedding`` lookup over quantized rows, dequantized on the fly.

`from_gguf` keeps the GGUF bytes (a view of the mapped file is fine) and dequantizes only the rows
looked up, bit-exactly; `from_linear` shares a tied ``lm_head``'s packed storage (rows are its
`effective_weight` rows).
"""

from __future__ import annotations

import torch
from torch import nn

from infer.quant.dequant import dequantize
from infer.quant.ggml import QType, as_rows, check_supported
from infer.quant.linear import QuantizedLinear


class QuantizedEmbedding(nn.Module):
    """``ids [...] -> [..., embedding_dim]`` in ``dtype`` (float32 by default)."""

    raw: torch.Tensor | None

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        raw: torch.Tensor | None = None,
        qtype: QType | None = None,
        linear: QuantizedLinear | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.qtype = qtype
        self.register_buffer("raw", raw)  # None when sharing a linear's storage
        # A shared QuantizedLinear is held outside the module tree (it is already the lm_head).
        self._linear = [linear] if linear is not None else []

    @classmethod
    def from_gguf(
        cls,
        raw: torch.Tensor,
        qtype: int | QType,
        shape: tuple[int, ...] | list[int],
        *,
        name: str = "token_embd.weight",
        dtype: torch.dtype = torch.float32,
    ) -> QuantizedEmbedding:
        """From a GGUF embedding's bytes, ``shape = (num_embeddings, embedding_dim)``; kept, not copied."""
        qt = check_supported(qtype, name)
        n, d = (int(s) for s in shape)
        return cls(n, d, raw=as_rows(raw, qt, n, d, name), qtype=qt, dtype=dtype)

    @classmethod
    def from_linear(
        cls, linear: QuantizedLinear, *, dtype: torch.dtype = torch.float32, owned: bool = False
    ) -> QuantizedEmbedding:
        """An embedding reading the rows of a (tied) ``lm_head`` without a copy of its own;
        ``owned``: the linear is no model's head, so it is this module's child ``linear``."""
        embedding = cls(linear.out_features, linear.in_features, linear=linear, dtype=dtype)
        if owned:
            embedding.linear = linear  # in the module tree: moved, counted and saved with it
        return embedding

    @property
    def weight_nbytes(self) -> int:
        """Bytes this module holds itself (0 when it shares a linear's storage)."""
        if self.raw is not None:
            return self.raw.numel()
        owned = self._modules.get("linear")
        return sum(t.numel() * t.element_size() for t in owned.buffers()) if owned is not None else 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self._rows(flat)  # [R, D] float32
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def _rows(self, flat: torch.Tensor) -> torch.Tensor:
        if self.raw is not None:
            assert self.qtype is not None
            return dequantize(self.raw[flat], self.qtype, (flat.numel(), self.embedding_dim))
        lin = self._linear[0]
        if lin.fmt == "dense":
            return lin.weight[flat].to(torch.float32)
        if lin.fmt == "int8":
            return lin.qweight[flat].to(torch.float32) * lin.scales[flat].to(torch.float32)[:, None]
        return lin.compose(lin.unpacked_rows(flat), lin.scale_zero[:, flat].to(torch.float32))

    def extra_repr(self) -> str:
        src = self.qtype.name if self.qtype is not None else "shared with a QuantizedLinear"
        return f"{self.num_embeddings}, {self.embedding_dim}, source={src}, dtype={self.dtype}"


__all__ = ["QuantizedEmbedding"]
