"""Which part of every weight a tensor-parallel rank holds (Megatron-style), and its config.

Attention heads split across ranks: Q/K/V are column-parallel (each rank holds its heads'
output rows), O is row-parallel (its input columns; the partial sums are all-reduced). The
MLP's gate / up are column-parallel, down row-parallel. The embedding and the head split
the vocabulary (rows). Norms and row-parallel biases are replicated. KV heads split too;
when there are more ranks than KV heads each KV head is replicated on the ranks whose
query heads use it, as vLLM does. Fused modules (Phi-3's ``qkv_proj`` and
``gate_up_proj``, GPT-2's ``c_attn``) split segment by segment.

A rank builds its model from `TensorParallel.local_config` (its share of heads,
intermediate size and vocabulary, with an explicit ``head_dim``) and the loader reads only
its `Slice` of each stored tensor (`infer.assembly.place`).
"""

from __future__ import annotations

import dataclasses

from infer.loader.config import ModelConfig
from infer.loader.source import Slice
from infer.models import architecture

VOCAB_PARALLEL = ("embed_tokens", "lm_head")


class TensorParallel:
    """The tensor-parallel layout of ``config`` over ``size`` ranks, seen from ``rank``.

    Raises `ValueError` naming the sizes when a size does not divide (heads, KV heads,
    intermediate size, vocabulary), so every rank refuses before loading anything.
    """

    def __init__(self, config: ModelConfig, size: int, rank: int, source: str = "config") -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(
                f"tensor parallel size {size}, rank {rank}: expected size >= 1 and 0 <= rank < size"
            )
        c = config
        problems = []
        if c.num_attention_heads % size:
            problems.append(f"num_attention_heads {c.num_attention_heads}")
        if c.num_key_value_heads % size and size % c.num_key_value_heads:
            problems.append(
                f"num_key_value_heads {c.num_key_value_heads} "
                "(the size must divide it, or be a multiple of it to replicate them)"
            )
        if c.intermediate_size % size:
            problems.append(f"intermediate_size {c.intermediate_size}")
        if c.vocab_size % size:
            problems.append(f"vocab_size {c.vocab_size}")
        if problems:
            raise ValueError(
                f"{source}: tensor_parallel={size} does not divide " + ", ".join(problems) + "; choose a "
                "tensor-parallel size that divides them"
            )
        self.config = config
        self.size = size
        self.rank = rank
        self.arch = architecture(config.model_type, source)
        self.head_dim = c.computed_head_dim
        self.heads = c.num_attention_heads // size
        self.kv_heads = max(1, c.num_key_value_heads // size)
        group = c.num_attention_heads // c.num_key_value_heads  # query heads per KV head
        # The KV heads this rank's query heads use (replicated when size > kv heads).
        self.kv_first = (rank * self.heads) // group if size > c.num_key_value_heads else rank * self.kv_heads
        self.local_config = dataclasses.replace(
            config,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate_size=c.intermediate_size // size,
            vocab_size=c.vocab_size // size,
        )

    @property
    def vocab_range(self) -> tuple[int, int]:
        n = self.config.vocab_size // self.size
        return self.rank * n, (self.rank + 1) * n

    def _segment(self, name: str) -> tuple[int, tuple[int, int]]:
        """A segment's full length and this rank's range in it."""
        hd, c = self.head_dim, self.config
        if name == "q":
            return c.num_attention_heads * hd, (
                self.rank * self.heads * hd,
                (self.rank + 1) * self.heads * hd,
            )
        if name == "kv":
            return c.num_key_value_heads * hd, (self.kv_first * hd, (self.kv_first + self.kv_heads) * hd)
        if name == "mlp":
            n = c.intermediate_size // self.size
            return c.intermediate_size, (self.rank * n, (self.rank + 1) * n)
        raise ValueError(f"unknown tensor-parallel segment {name!r}")

    def role(self, module: str) -> tuple[str, tuple[str, ...]] | None:
        """``("column" | "row", segments)`` of module path ``module``, or None (replicated / vocabulary)."""
        inner = module.split(".", 2)[2] if module.startswith("layers.") else module
        roles = self.arch.tp_roles
        return roles.get(inner) or roles.get(inner.rsplit(".", 1)[-1])

    def slice_for(self, param: str) -> Slice | None:
        """The part of parameter ``param`` (our name) this rank holds; None when it holds all of it."""
        module, _, kind = param.rpartition(".")
        if module in VOCAB_PARALLEL and kind == "weight":
            start, stop = self.vocab_range
            return Slice(0, ((start, stop),), self.config.vocab_size)
        role = self.role(module)
        if role is None:
            return None
        how, segments = role
        if how == "row" and kind != "weight":
            return None  # a row-parallel bias is added once, after the all-reduce
        ranges, offset = [], 0
        for name in segments:
            full, (a, b) = self._segment(name)
            ranges.append((offset + a, offset + b))
            offset += full
        return Slice(0 if how == "column" else 1, tuple(ranges), offset)

    def row_parallel(self, module: str) -> bool:
        role = self.role(module)
        return role is not None and role[0] == "row"


def split_layers(num_layers: int, stages: int, source: str = "config") -> list[range]:
    """Contiguous layer ranges for ``stages`` pipeline stages (the first ones take the remainder)."""
    if stages < 1:
        raise ValueError(f"pipeline_parallel={stages}: expected >= 1")
    if num_layers < stages:
        raise ValueError(
            f"{source}: num_hidden_layers {num_layers} cannot be split into "
            f"pipeline_parallel={stages} stages "
            "(each stage needs at least one layer)"
        )
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


__all__ = ["VOCAB_PARALLEL", "Slice", "TensorParallel", "split_layers"]
