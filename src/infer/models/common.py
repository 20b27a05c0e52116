"""Building blocks shared by every architecture: norms, RoPE, attention, MLP.

Each concern has its module; this one names them all in one place:

* `infer.models.projections`: `Linear`, fused sibling projections, the deterministic switch;
* `infer.models.norm`: `RMSNorm`;
* `infer.models.rope`: rotary embeddings and their tables;
* `infer.models.attend`: the attention products (`attend`, `attend_tiled`, `attend_shared`);
* `infer.models.attention`: the `Attention` layer and what it needs of a cache (`KVStore`);
* `infer.models.mlp`: activations and `GatedMLP`.

Conventions:
* activations are ``[B, T, D]`` (batch, tokens, hidden); attention works on
  ``[B, H, T, hd]``;
* masks passed to attention are either float additive (``0`` attend, ``-inf`` masked)
  or boolean (``True`` attend), broadcastable to ``[B, 1, T, S]``; ``None`` means every
  key is visible (the models build boolean ones from the cache's slots: `infer.kv.cache`);
* RoPE uses HF's ``rotate_half`` layout, so HF checkpoints need no Q/K permutation.
"""

from __future__ import annotations

from infer.models.attend import (
    KEY_TILE,
    QUERY_BLOCK,
    QUERY_TILES_PER_BLOCK,
    BlockFn,
    attend,
    attend_any,
    attend_shared,
    attend_tiled,
)
from infer.models.attention import Attention, KVStore, attention_from_config
from infer.models.mlp import ACTIVATIONS, GatedMLP, activation, gelu_new, mlp_from_config
from infer.models.norm import RMSNorm
from infer.models.projections import (
    Fusable,
    Linear,
    fuse_linears,
    fuse_projections,
    is_deterministic,
    set_deterministic,
    unfuse_projections,
)
from infer.models.rope import (
    RotaryEmbedding,
    apply_rotary,
    make_rotary_embeddings,
    rope_inv_freq,
    rope_tables,
    rotate_half,
)

__all__ = [
    "ACTIVATIONS",
    "KEY_TILE",
    "QUERY_BLOCK",
    "QUERY_TILES_PER_BLOCK",
    "Attention",
    "BlockFn",
    "Fusable",
    "GatedMLP",
    "KVStore",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "activation",
    "apply_rotary",
    "attend",
    "attend_any",
    "attend_shared",
    "attend_tiled",
    "attention_from_config",
    "fuse_linears",
    "fuse_projections",
    "gelu_new",
    "is_deterministic",
    "make_rotary_embeddings",
    "mlp_from_config",
    "rope_inv_freq",
    "rope_tables",
    "rotate_half",
    "set_deterministic",
    "unfuse_projections",
]
