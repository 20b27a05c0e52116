"""The attention products: ``q [B, H, T, hd]`` over ``k, v [B, Hkv, S, hd]`` -> ``[B, H, T, hd]``.

`attend` (PyTorch's fused SDPA in query blocks), `attend_tiled` (the deterministic mode's fixed
tiles), `attend_any` (the one of the two a layer asks for) and `attend_shared` (private keys
plus a prefix stored once, `infer.kv.prefix`); `recording_attention` (inspection: probabilities
materialized, on the calling thread only). Masks are boolean (True = attend) or additive,
broadcastable to ``[B, 1, T, S]``; None: every key is visible.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from infer.host import rows

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

    return _blocks(q, k, v, mask, key_limit, block, key_start, softcap)


BlockFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    key_limit: int | None,
    fn: BlockFn,
    key_start: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``fn`` over blocks of `QUERY_BLOCK` queries, each on the keys it can see (``key_limit``,
    ``key_start``). ``softcap``: ``fn`` materializes a block's scores (blocks bound them)."""
    T, S = q.shape[2], k.shape[2]
    if torch.compiler.is_compiling() and key_limit is None and key_start is None and softcap is None:
        # Compiled, keys are never trimmed: one call (an exported verify pass has a dynamic query
        # count, which a loop over blocks would fix); the fused kernel never materializes scores.
        return fn(q, k, v, mask)
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


class AttentionProbe:
    """Attention probabilities recorded by `recording_attention`: each call of `attend_any` on the
    thread that opened it appends ``[B, H, T, S]`` (the queries' dtype; a query that sees no key:
    zeros), in call order (a forward's layers in order)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.probs: list[torch.Tensor] = []
        # The layers of a type share one mask tensor: inverted once per call.
        self.masks: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {}

    def hidden(self, mask: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``~mask`` (True: masked), and whether some query sees no key at all (its probabilities
        are NaN until zeroed)."""
        hit = self.masks.get(id(mask))
        if hit is None or hit[0] is not mask:
            boolean = mask if mask.dtype == torch.bool else mask == 0
            hit = self.masks[id(mask)] = (mask, ~boolean, bool((~boolean.any(dim=-1)).any()))
        return hit[1], hit[2]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        """Attention with its probabilities materialized, as transformers' eager attention computes
        it (K/V repeated per query head, float32 scores and softmax): ``q [B, H, T, hd]`` over
        ``k, v [B, Hkv, S, hd]``. Per head, not folded as `_fold_gqa` folds: faster here
        (docs/notebooks.md)."""
        k, v = repeat_kv(q.shape[1], k, v)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)  # [B, H, T, S]
        if softcap is not None:
            scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
        blind = False
        if mask is not None:
            hidden, blind = self.hidden(mask)
            scores.masked_fill_(hidden, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        del scores
        if blind:
            p.nan_to_num_(0.0)  # a query that sees no key: zeros
        out = torch.matmul(p, v.float()).to(q.dtype)  # [B, H, T, hd]
        self.probs.append(p.to(q.dtype))
        return out


def repeat_kv(heads: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k, v [B, Hkv, S, hd]`` repeated per query head, ``[B, heads, S, hd]`` (query head ``h``
    reads KV head ``h // (heads // Hkv)``), as transformers' eager attention repeats them."""
    B, Hkv, S, D = k.shape
    if Hkv == heads:
        return k, v
    return (k[:, :, None].expand(B, Hkv, heads // Hkv, S, D).reshape(B, heads, S, D),
            v[:, :, None].expand(B, Hkv, heads // Hkv, S, D).reshape(B, heads, S, D))  # fmt: skip


_PROBE: list[AttentionProbe | None] = [None]


@contextlib.contextmanager
def recording_attention() -> Iterator[AttentionProbe]:
    """Within, attention on this thread runs `AttentionProbe.attend` (probabilities materialized and
    kept); other threads (an engine's steps) and the default path are untouched."""
    before = _PROBE[0]
    probe = _PROBE[0] = AttentionProbe()
    try:
        yield probe
    finally:
        _PROBE[0] = before


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
    under float32 activations) are widened to the queries' dtype for the product: torch's fused CPU
    attention is much slower on bfloat16 inputs (docs/engine.md), and the widening is exact. A
    cache may return fewer keys than its mask is wide (an int8 cache reads back only the slots in
    use): the mask is cut to them.
    """
    if mask is not None and mask.shape[-1] > k.shape[2]:
        mask = mask[..., : k.shape[2]]
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    probe = _PROBE[0]
    if probe is not None and probe.thread == threading.get_ident():  # `recording_attention`
        return probe.attend(q, k, v, mask, scale, softcap)
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
    contract); the deterministic mode does not share (`infer.kv.prefix`).
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
    # cuDNN's SDPA builds a new graph whenever the key length changes (its host cost:
    # docs/performance.md); flash and memory-efficient attention do not.
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
    (``[B, Hkv, G*T, hd]``), cut into tiles of `infer.host.rows.TILE_ROWS` rows (zero-padded);
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
