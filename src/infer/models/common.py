"""Building blocks shared by every architecture: norms, RoPE, attention, MLP.

Conventions:
* activations are ``[B, T, D]`` (batch, tokens, hidden); attention works on
  ``[B, H, T, hd]``;
* masks passed to attention are either float additive (``0`` attend, ``-inf`` masked)
  or boolean (``True`` attend), broadcastable to ``[B, 1, T, S]``; ``None`` means every
  key is visible (the models build boolean ones from the cache's slots: `infer.cache`);
* RoPE uses HF's ``rotate_half`` layout, so HF checkpoints need no Q/K permutation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from infer import rows
from infer.loader.config import FREQ_FACTORS, FULL_ATTENTION, ROPE_TYPES, SLIDING_ATTENTION, ModelConfig
from infer.quant.linear import QuantizedLinear


class Linear(nn.Linear):
    """``nn.Linear`` with the deterministic mode's fixed row tiles (`infer.rows`) when
    ``tile_rows`` is set (`set_deterministic`). Same parameters and names."""

    tile_rows: int = 0
    column_tile: int = 0  # the output head's column tiles in the deterministic mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows.linear(x, self.weight, self.bias, self.tile_rows, self.column_tile)


def fuse_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One module computing ``parts`` (same input) side by side, their outputs concatenated;
    the parts keep views of its weights. None when they cannot be fused."""
    if all(isinstance(p, QuantizedLinear) for p in parts):
        return QuantizedLinear.concat(parts)  # type: ignore[arg-type]
    if not all(type(p) is Linear for p in parts):
        return None
    linears: list[Linear] = parts  # type: ignore[assignment]
    first = linears[0]
    if any(p.in_features != first.in_features or (p.bias is None) != (first.bias is None) for p in linears):
        return None
    if any(p.weight.dtype != first.weight.dtype or p.weight.device != first.weight.device for p in linears):
        return None
    n = sum(p.out_features for p in linears)
    fused = Linear(first.in_features, n, bias=first.bias is not None, device="meta")
    fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in linears]), requires_grad=False)
    if first.bias is not None:
        biases = [p.bias.detach() for p in linears if p.bias is not None]
        fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    start = 0
    for p in linears:
        stop = start + p.out_features
        p.weight = nn.Parameter(fused.weight[start:stop], requires_grad=False)
        if p.bias is not None:
            p.bias = nn.Parameter(fused.bias[start:stop], requires_grad=False)
        start = stop
    return fused


class Fusable(nn.Module):
    """A module whose sibling projections can run as one product (`fuse`). The fused module is
    held outside the module tree (no second copy in ``state_dict``/``parameters``) and dropped
    when the module is moved or cast, which falls back to the separate projections."""

    def __init__(self) -> None:
        super().__init__()
        self._fused: list[nn.Module] = []

    def fuse(self) -> bool:
        parts = self.fusable()
        if len(parts) < 2:
            return False
        fused = fuse_linears(parts)
        self._fused = [fused] if fused is not None else []
        return fused is not None

    def fusable(self) -> list[nn.Module]:
        raise NotImplementedError

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        self._fused = []
        return super()._apply(fn, recurse)  # type: ignore[no-untyped-call]


def unfuse_projections(model: nn.Module) -> None:
    """Drop the fused products: each projection runs on its own again (after its weights were
    replaced, say; the fused copy would not see new Parameters)."""
    for m in model.modules():
        if isinstance(m, Fusable):
            m._fused = []


def set_deterministic(model: nn.Module, on: bool = True) -> None:
    """Switch every product and attention of ``model`` to the deterministic mode's fixed
    tiles (``on``; `infer.rows`, `attend_tiled`) or back to free shapes.

    Modules opt in with a ``tile_rows`` attribute (products) or a ``deterministic`` one
    (attention). Fused projections are dropped when ``on``: a fused q/k/v product has
    another shape than the separate products a streamed layer runs.
    """
    for m in model.modules():
        if hasattr(m, "tile_rows"):
            setattr(m, "tile_rows", rows.TILE_ROWS if on else 0)  # noqa: B010
        if hasattr(m, "deterministic"):
            setattr(m, "deterministic", on)  # noqa: B010
        if on and isinstance(m, Fusable):
            m._fused = []
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "column_tile"):  # a streamed head's chunks use its tiles too
        setattr(head, "column_tile", rows.COLUMN_TILE if on else 0)  # noqa: B010


def is_deterministic(model: nn.Module) -> bool:
    """Whether `set_deterministic` switched ``model`` on."""
    return any(getattr(m, "tile_rows", 0) for m in model.modules())


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up of every block of a resident model (fewer, larger kernel calls).

    Not for layer streaming, which swaps each projection's weights on its own, nor in the
    deterministic mode (`set_deterministic`). Returns how many groups were fused.
    """
    if is_deterministic(model):
        return 0
    return sum(m.fuse() for m in model.modules() if isinstance(m, Fusable))


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in float32 (as transformers does).

    ``unit_offset=True`` is Gemma's variant: the stored weight is a delta and the
    scale is ``(1 + weight)``, applied before casting back (transformers does the
    same: Llama casts then multiplies, Gemma multiplies then casts).
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, unit_offset={self.unit_offset}"


# --------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32) for vanilla, llama3- or linear-scaled RoPE."""
    # Explicit device: also computed on the CPU inside a meta-device context (model skeletons),
    # where meta arithmetic would pull in sympy and cost ~1 s per process.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = "default" if scaling is None else scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if scaling is None:  # unreachable; narrows the type
        raise AssertionError
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == FREQ_FACTORS:  # llama.cpp's rope_freqs tensor: a divisor per frequency
        factors = torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"RoPE frequency factors have {factors.numel()} entries, expected {inv_freq.numel()}"
            )
        return inv_freq / factors
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported RoPE type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")


class RotaryEmbedding(nn.Module):
    """Computes ``(cos, sin)`` of shape ``[B, T, head_dim]`` for given positions ``[B, T]``."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        # Computed on the CPU whatever the default device; in a meta skeleton only its shape
        # exists until `reset_buffers` (after the weights were checked against the config).
        inv_freq = torch.empty(head_dim // 2)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if not inv_freq.is_meta:
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` on the CPU (after construction on the meta device)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, hd/2], float32 like transformers
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_tables(
    config: ModelConfig, max_positions: int | None = None, device: torch.device | str | None = None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The RoPE factory: float32 ``(cos, sin)`` tables ``[max_positions, rotary_dim]`` per layer type.

    Full-attention layers use ``rope_theta`` with ``rope_scaling``; sliding-window
    layers use ``rope_local_base_freq`` (unscaled) when the config sets it (Gemma 3).
    """
    n = max_positions if max_positions is not None else config.max_position_embeddings
    positions = torch.arange(n, device=device)[None]
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer_type, rope in make_rotary_embeddings(config).items():
        cos, sin = rope.to(device)(positions, torch.float32)
        tables[layer_type] = (cos[0], sin[0])
    return tables


def make_rotary_embeddings(config: ModelConfig) -> dict[str, RotaryEmbedding]:
    """One `RotaryEmbedding` per layer type the config uses (over the rotated dimensions of a head)."""
    head_dim = config.rotary_dim
    types = set(config.layer_types) if config.layer_types is not None else {FULL_ATTENTION}
    ropes: dict[str, RotaryEmbedding] = {}
    for layer_type in sorted(types):
        if layer_type == SLIDING_ATTENTION and config.rope_local_base_freq is not None:
            ropes[layer_type] = RotaryEmbedding(head_dim, config.rope_local_base_freq, None)
        elif layer_type in (FULL_ATTENTION, SLIDING_ATTENTION):
            ropes[layer_type] = RotaryEmbedding(head_dim, config.rope_theta, config.rope_scaling)
        else:
            raise ValueError(f"unsupported layer type {layer_type!r}")
    return ropes


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, hd]`` by ``cos/sin [B, T, rd]`` (broadcast over heads).

    With partial RoPE (``rd < hd``, Phi-3 family) only the first ``rd`` dimensions rotate.
    """
    cos = cos.unsqueeze(1)  # [B, 1, T, rd]
    sin = sin.unsqueeze(1)
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        rot, rest = x[..., :rd], x[..., rd:]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------- attention


class KVStore(Protocol):
    """What attention needs from a per-layer KV cache (see `infer.cache`)."""

    key_limit: int | None  # keys at or past ``key_limit + T`` are masked for every query (None: unknown)
    key_start: int | None  # query ``t`` sees no key before ``key_start + t`` (None: no such bound)
    # A shared prefix (`infer.prefix`): keys/values ``[1, Hkv, R, hd]`` every row may read, and the
    # mask ``[B, 1, T, R]`` of what each row's queries see of them.
    shared_k: torch.Tensor | None
    shared_v: torch.Tensor | None
    shared_mask: torch.Tensor | None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [B, Hkv, T, hd]``; return the keys/values to attend to ``[B, Hkv, S, hd]``."""
        ...


class Attention(Fusable):
    """Multi-head attention with GQA, decoupled ``head_dim``, optional QK-norm.

    Projections are named as in HF checkpoints (``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj``, ``q_norm``, ``k_norm``); a subclass with fused projections overrides
    `project_qkv` (Phi-3's ``qkv_proj``). ``deterministic`` (`set_deterministic`) selects
    `attend_tiled`; otherwise `attend` runs scaled-dot-product attention.
    """

    deterministic: bool = False

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        norm_unit_offset: bool = False,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.softcap = softcap
        self.make_qkv(hidden_size, qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, norm_eps, unit_offset=norm_unit_offset)
            self.k_norm = RMSNorm(head_dim, norm_eps, unit_offset=norm_unit_offset)

    def make_qkv(self, hidden_size: int, bias: bool) -> None:
        self.q_proj = Linear(hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden_size, self.num_kv_heads * self.head_dim, bias=bias)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, T, D]`` -> q ``[B, T, H, hd]``, k and v ``[B, T, Hkv, hd]``."""
        B, T, _ = x.shape
        H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if self._fused:
            q, k, v = self._fused[0](x).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.reshape(B, T, H, hd), k.reshape(B, T, Hkv, hd), v.reshape(B, T, Hkv, hd)

    def fusable(self) -> list[nn.Module]:
        return [self.q_proj, self.k_proj, self.v_proj]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVStore | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)  # [B, H, T, hd]
        k = apply_rotary(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, hd]
        v = v.transpose(1, 2)  # [B, Hkv, T, hd]
        key_limit = key_start = None
        shared = None
        if cache is not None:
            k, v = cache.update(k, v)  # [B, Hkv, S, hd]
            key_limit, key_start = cache.key_limit, cache.key_start
            if cache.shared_k is not None:
                shared = (cache.shared_k, cache.shared_v, cache.shared_mask)
        if shared is not None:  # a prefix stored once for the rows that share it (`infer.prefix`)
            sk, sv, smask = shared
            assert sv is not None and smask is not None and mask is not None
            out = attend_shared(q, k, v, mask, sk, sv, smask, self.scale, self.softcap, key_limit, key_start)
        else:  # [B, H, T, hd]
            out = attend_any(
                q, k, v, mask, self.scale, self.softcap, key_limit, self.deterministic, key_start
            )
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # [B, T, H*hd]
        projected: torch.Tensor = self.o_proj(out)
        return projected


_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
QUERY_BLOCK = 512  # queries per attention call of a long prompt: its scores never exist whole
KEY_TILE = 256  # the deterministic mode's keys per product (`attend_tiled`)
QUERY_TILES_PER_BLOCK = 4  # ... and query tiles per call (bounds its temporaries)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    key_limit: int | None = None,
    key_start: int | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention of ``q [B, H, T, hd]`` over ``k, v [B, Hkv, S, hd]`` -> ``[B, H, T, hd]``.

    ``mask`` is boolean ``[B|1, 1, T|1, S]`` (True = attend), additive, or None. Queries go in
    blocks of `QUERY_BLOCK` through PyTorch's fused SDPA kernel (flash attention on CPU:
    an online softmax over key blocks, float32 sums for bfloat16 inputs), so no block's
    score matrix is materialized; ``key_limit`` (keys at or past ``key_limit + t + 1``
    are masked for query ``t``: a cache's slots in use before the step) trims the keys
    each block reads, so a causal prefill does about half the work of a full square; a
    sliding window's ``key_start`` (query ``t`` sees no key before ``key_start + t``) trims
    the older keys, so a long prompt's windowed layers read ``window + block`` keys a block.
    The reduction order is the kernel's: for bitwise batch invariance use `attend_tiled`.
    """
    if mask is not None and mask.dtype != torch.bool:
        mask = mask == 0  # additive (0 / -inf) -> boolean
    gqa = q.shape[1] != k.shape[1]

    def block(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, mb: torch.Tensor | None) -> torch.Tensor:
        if softcap is not None:
            return _attend_math(qb, kb, vb, mb, scale, softcap)
        if qb.is_cuda:
            return _attend_sdpa_cuda(qb, kb, vb, mb, scale)
        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mb, scale=scale, enable_gqa=gqa)

    return _blocks(q, k, v, mask, key_limit, block, key_start)


BlockFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    key_limit: int | None,
    fn: BlockFn,
    key_start: int | None = None,
) -> torch.Tensor:
    """``fn`` over blocks of `QUERY_BLOCK` queries, each on the keys it can see (``key_limit``,
    ``key_start``)."""
    T, S = q.shape[2], k.shape[2]
    outs = []
    for start in range(0, T, QUERY_BLOCK):
        stop = min(T, start + QUERY_BLOCK)
        s = S if key_limit is None else min(S, key_limit + stop)
        lo = 0 if key_start is None else min(max(0, key_start + start), s - 1)
        mb = None
        if mask is not None:
            mb = mask[..., lo:s] if mask.shape[-2] == 1 else mask[..., start:stop, lo:s]
        kb, vb = (k, v) if (lo, s) == (0, S) else (k[:, :, lo:s], v[:, :, lo:s])
        outs.append(fn(q[:, :, start:stop], kb, vb, mb))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def attend_any(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    key_limit: int | None,
    deterministic: bool,
    key_start: int | None = None,
) -> torch.Tensor:
    """`attend_tiled` in the deterministic mode (every key from slot 0, in tiles), else `attend`.

    Keys and values held in a narrower dtype than the queries (a ``kv_dtype="bfloat16"`` cache
    under float32 activations) are widened to the queries' dtype for the product: on CPU torch's
    fused attention is 2-8x slower on bfloat16 inputs than on float32 ones (decode shapes of
    SmolLM2, AMD EPYC, docs/engine.md), and the widening is exact. A cache may return fewer keys
    than its mask is wide (an int8 cache reads back only the slots in use): the mask is cut to them.
    """
    if mask is not None and mask.shape[-1] > k.shape[2]:
        mask = mask[..., : k.shape[2]]
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if deterministic:
        return attend_tiled(q, k, v, mask, scale, softcap, key_limit)
    return attend(q, k, v, mask, scale, softcap, key_limit, key_start)


def _attend_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    key_limit: int | None = None,
    key_start: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` that also returns each query's log-sum-exp of its scores: ``(out [B, H, T, hd],
    lse [B, H, T])`` (float32). A query that sees no key gets ``out = 0`` and an lse the caller
    must not use (see `attend_shared`). On CPU without soft-capping: PyTorch's flash kernel,
    which returns the lse; otherwise the scores are formed explicitly."""
    fast = q.is_cpu and softcap is None
    T, S = q.shape[2], k.shape[2]
    outs, lses = [], []
    for start in range(0, T, QUERY_BLOCK):
        stop = min(T, start + QUERY_BLOCK)
        s = S if key_limit is None else min(S, key_limit + stop)
        lo = 0 if key_start is None else min(max(0, key_start + start), s - 1)
        mb = mask[..., lo:s] if mask.shape[-2] == 1 else mask[..., start:stop, lo:s]
        qb, kb, vb = q[:, :, start:stop], k[:, :, lo:s], v[:, :, lo:s]
        if fast:
            additive = torch.zeros(mb.shape, dtype=q.dtype, device=q.device).masked_fill(~mb, float("-inf"))
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qb, kb, vb, 0.0, False, attn_mask=additive, scale=scale
            )
        else:
            qf, mf = _fold_gqa(qb, mb, kb.shape[1])  # [B, Hkv, G*T, hd]
            assert mf is not None
            scores = torch.matmul(qf.float(), kb.float().transpose(-1, -2)) * scale  # [B, Hkv, G*T, S]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~mf, float("-inf"))
            lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G*T]
            p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
            B, H, Tb, D = qb.shape
            out = torch.matmul(p, vb.float()).to(q.dtype).reshape(B, H, Tb, D)
            lse = lse.reshape(B, H, Tb)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def attend_shared(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    shared_mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    key_limit: int | None = None,
    key_start: int | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, H, T, hd]`` over each row's private keys ``k, v [B, Hkv, S, hd]``
    (``mask [B, 1, T, S]``) and a prefix stored once, ``shared_k, shared_v [1, Hkv, R, hd]``, of
    which row ``b``'s queries see ``shared_mask[b] [1, T, R]`` -> ``[B, H, T, hd]``.

    The shared keys are read once for the whole step: every row's queries are folded into one
    query axis (``[1, H, B*T, hd]``) against them, so 16 rows sharing a 2,000-token prompt read it
    once, not 16 times. The two partial results are merged by their log-sum-exps (as flash
    attention merges key blocks): ``out = (o1 e^(l1-m) + o2 e^(l2-m)) / (e^(l1-m) + e^(l2-m))``.
    Within float32 rounding of attention over the keys laid end to end (the default mode's
    contract); the deterministic mode does not share (`infer.prefix`).
    """
    B, H, T, D = q.shape
    R = shared_k.shape[2]
    if shared_k.dtype != q.dtype:
        shared_k, shared_v = shared_k.to(q.dtype), shared_v.to(q.dtype)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if mask.shape[-1] > k.shape[2]:
        mask = mask[..., : k.shape[2]]
    own, own_lse = _attend_lse(
        q, k, v, mask, scale, softcap, key_limit, key_start
    )  # [B, H, T, hd], [B, H, T]
    qs = q.transpose(0, 1).reshape(1, H, B * T, D)  # every row's queries on one axis
    ms = shared_mask.transpose(0, 1).reshape(1, 1, B * T, R)
    pre, pre_lse = _attend_lse(qs, shared_k, shared_v, ms, scale, softcap)  # [1, H, B*T, hd], [1, H, B*T]
    pre = pre.reshape(H, B, T, D).transpose(0, 1)  # [B, H, T, hd]
    pre_lse = pre_lse.reshape(H, B, T).transpose(0, 1)  # [B, H, T]
    sees = shared_mask.any(dim=-1)  # [B, 1, T]: a query sees some shared key (a window may hide them all)
    top = torch.where(sees, torch.maximum(own_lse, pre_lse), own_lse)
    a = torch.exp(own_lse - top)  # [B, H, T]
    b = torch.where(sees, torch.exp(pre_lse - top), 0.0)
    out = (own.float() * a[..., None] + pre.float() * b[..., None]) / (a + b)[..., None]
    return out.to(q.dtype)


def _fold_gqa(
    q: torch.Tensor, mask: torch.Tensor | None, Hkv: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fold the ``G = H / Hkv`` query heads of each KV head into the query axis: row ``g*T + t``."""
    B, H, T, D = q.shape
    G = H // Hkv
    q = q.reshape(B, Hkv, G * T, D)
    if G > 1 and mask is not None and mask.shape[-2] != 1:
        mask = mask.repeat(1, 1, G, 1)  # [B|1, 1, G*T, S], row g*T + t = row t
    return q, mask


def _attend_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float
) -> torch.Tensor:
    """Attention with soft-capped scores (``softcap * tanh(s / softcap)``), in float32."""
    B, H, T, D = q.shape
    qf, mask = _fold_gqa(q, mask, k.shape[1])  # [B, Hkv, G*T, D]
    scores = torch.matmul(qf.float(), k.float().transpose(-1, -2)) * scale  # [B, Hkv, G*T, S]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())  # [B, Hkv, G*T, D]
    return out.to(q.dtype).reshape(B, H, T, D)


def _attend_sdpa_cuda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    B, H, T, D = q.shape
    qf, mask = _fold_gqa(q, mask, k.shape[1])
    # cuDNN's SDPA builds a new graph whenever the key length changes: 1.35 ms of host time
    # per call measured on an H100. Flash and memory-efficient attention have no such cost.
    with sdpa_kernel(_CUDA_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, H, T, D)  # SDPA may return a non-contiguous layout (CUDA)


def attend_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    key_limit: int | None = None,
) -> torch.Tensor:
    """`attend` in the deterministic mode: every product has one fixed shape, so a query's
    result depends only on its own keys, never on the batch, the step's length or the
    buffer's size.

    In float32. The ``G`` query heads of a KV head are folded into the query rows
    (``[B, Hkv, G*T, hd]``), cut into tiles of `infer.rows.TILE_ROWS` rows (zero-padded);
    keys into tiles of `KEY_TILE` starting at key 0 (masked zeros pad the last). Scores
    are ``[16, hd] @ [hd, 256]`` products, probabilities times values ``[16, 256] @ [256,
    hd]`` products, and the per-tile partial sums are added in key order, one tile after
    the other: tiles past a query's last visible key add exact zeros, so trimming them
    (``key_limit``) or a longer buffer changes no bit. The row maximum is exact in any order.
    """
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qf, mask = _fold_gqa(q, mask, Hkv)  # [B, Hkv, M, D], M = G*T
    M = qf.shape[2]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask == 0
    if key_limit is not None and key_limit + T < S:  # whole tiles only: the sums keep their order
        S = min(S, -(-(key_limit + T) // KEY_TILE) * KEY_TILE)
        k, v = k[:, :, :S], v[:, :, :S]
        if mask is not None:
            mask = mask[..., :S]
    if mask is None:
        mask = torch.ones(1, 1, 1, S, dtype=torch.bool, device=q.device)
    extra = -S % KEY_TILE
    if extra:  # pad the keys with masked zeros to whole tiles
        k = F.pad(k, (0, 0, 0, extra))
        v = F.pad(v, (0, 0, 0, extra))
        mask = F.pad(mask, (0, extra), value=False)
        S += extra
    n = S // KEY_TILE
    R = rows.TILE_ROWS
    Mp = -(-M // R) * R
    mask = mask.expand(mask.shape[0], 1, M, S)
    qf = qf.float()
    if Mp != M:  # padding rows attend to every key (finite, discarded)
        qf = F.pad(qf, (0, 0, 0, Mp - M))
        mask = F.pad(mask, (0, 0, 0, Mp - M), value=True)
    kt = k.float().reshape(B, Hkv, 1, n, KEY_TILE, D).transpose(-1, -2)  # [B, Hkv, 1, n, D, C]
    vt = v.float().reshape(B, Hkv, 1, n, KEY_TILE, D)  # [B, Hkv, 1, n, C, D]
    qt = qf.reshape(B, Hkv, Mp // R, 1, R, D)  # [B, Hkv, tiles, 1, R, D]
    mt = mask.reshape(mask.shape[0], 1, Mp // R, R, n, KEY_TILE).transpose(3, 4)  # [B|1, 1, tiles, n, R, C]
    outs = []
    for start in range(0, Mp // R, QUERY_TILES_PER_BLOCK):
        stop = min(Mp // R, start + QUERY_TILES_PER_BLOCK)
        scores = torch.matmul(qt[:, :, start:stop], kt) * scale  # [B, Hkv, b, n, R, C]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mt[:, :, start:stop], float("-inf"))
        top = scores.amax(dim=(3, 5), keepdim=True)  # [B, Hkv, b, 1, R, 1]
        p = torch.exp(scores - top)
        den = p.sum(-1)  # [B, Hkv, b, n, R]: fixed-length sums
        pv = torch.matmul(p, vt)  # [B, Hkv, b, n, R, D]
        acc, total = pv[:, :, :, 0], den[:, :, :, 0]
        for j in range(1, n):  # in key order, one tile after the other
            acc = acc + pv[:, :, :, j]
            total = total + den[:, :, :, j]
        outs.append(acc / total[..., None])  # [B, Hkv, b, R, D]
    out = torch.cat(outs, dim=2).reshape(B, Hkv, Mp, D)[:, :, :M]
    return out.to(q.dtype).reshape(B, H, T, D)


# --------------------------------------------------------------------------- MLP


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh-GELU, written out as OpenAI (and transformers' ``gelu_new``) compute it.

    Mathematically `F.gelu(approximate="tanh")`; the fused kernel rounds differently
    (logits differ by ~1e-5 on a tiny GPT-2), so the checkpoint's own formula is used.
    """
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": gelu_new,
    "gelu": F.gelu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}") from None


class GatedMLP(Fusable):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: SwiGLU (silu) or GeGLU (gelu_pytorch_tanh)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = activation(act)

    def fusable(self) -> list[nn.Module]:
        return [self.gate_proj, self.up_proj]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused:
            gate, up = self._fused[0](x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        out: torch.Tensor = self.down_proj(self.act_fn(gate) * up)
        return out


def attention_from_config(
    config: ModelConfig,
    *,
    qk_norm: bool,
    norm_unit_offset: bool = False,
    qkv_bias: bool | None = None,
    cls: type[Attention] = Attention,
) -> Attention:
    """The config's attention; ``qkv_bias`` overrides ``attention_bias`` for Q/K/V only (Qwen 2)."""
    return cls(
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.computed_head_dim,
        qkv_bias=config.attention_bias if qkv_bias is None else qkv_bias,
        o_bias=config.attention_bias,
        qk_norm=qk_norm,
        norm_eps=config.rms_norm_eps,
        norm_unit_offset=norm_unit_offset,
        scale=config.attention_scale,
        softcap=config.attn_logit_softcapping,
    )


def mlp_from_config(config: ModelConfig) -> GatedMLP:
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
