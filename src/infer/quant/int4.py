"""The packed 4-bit layout of torch's CPU kernel ``aten._weight_int4pack_mm_for_cpu``.

``_convert_weight_to_int4pack_for_cpu`` takes ``[N, K]`` int32 nibbles and returns
``[N, K/2]`` uint8 in this layout (checked at run time by `cpu_kernel_usable`):

- rows in blocks of `BLOCK_N` (64 where torch's CPU kernels are built for AVX-512, 32 for
  AVX2): for each block, ``[K, BLOCK_N/2]`` bytes; byte ``(k, j)`` holds row ``j`` of the
  block in its low nibble and row ``j + BLOCK_N/2`` in its high nibble;
- a last block of ``r < BLOCK_N`` rows (``r`` a multiple of 16): ``[K, r/2]`` bytes; byte
  ``(k, j)`` holds rows ``2j`` (low) and ``2j + 1`` (high).

`BLOCK_N` is read off torch's converter at import: packed bytes (the repack cache's) are valid
only where the block size is the same. We pack and unpack in torch ourselves (no ``[N, K]`` int32
temporary; weights can be unpacked again: docs/quantization.md). The kernel computes
``y = x @ ((q - 8) * scale + zero).T``, ``scale``/``zero`` ``[K/group, N, 2]`` in x's dtype.
"""

from __future__ import annotations

import functools

import torch

from infer.quant.operands import INT32_LIMIT, plain_cpu_operands

ROW_MULTIPLE = 16  # the kernel needs N % 16 == 0
_BLOCK_SIZES = (64, 32)  # the converter's row blocks: AVX-512 builds, AVX2 builds


def _block_starts(n_rows: int) -> list[tuple[int, int]]:
    return [(s, min(BLOCK_N, n_rows - s)) for s in range(0, n_rows, BLOCK_N)]


def pack(nibbles: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` values 0..15 (any integer dtype) -> ``[N, K/2]`` uint8 in the CPU kernel layout."""
    return _pack(nibbles, BLOCK_N)


def _pack(nibbles: torch.Tensor, block_n: int) -> torch.Tensor:
    n, k = nibbles.shape
    if n % ROW_MULTIPLE or k % 2:
        raise ValueError(f"int4 packing needs rows % {ROW_MULTIPLE} == 0 and even columns, got {n}x{k}")
    q = nibbles.to(torch.uint8)
    out = torch.empty(n * k // 2, dtype=torch.uint8, device=nibbles.device)
    full = n - n % block_n
    if full:
        blk = q[:full].reshape(full // block_n, 2, block_n // 2, k)  # [nb, half, j, K]
        byte = blk[:, 0] | (blk[:, 1] << 4)  # [nb, 32, K]
        out[: full * k // 2] = byte.transpose(1, 2).reshape(-1)  # [nb, K, 32]
    if full < n:
        r = n - full
        tail = q[full:].reshape(r // 2, 2, k)  # [j, pair, K]
        byte = tail[:, 0] | (tail[:, 1] << 4)  # [r/2, K]
        out[full * k // 2 :] = byte.T.reshape(-1)  # [K, r/2]
    return out.reshape(n, k // 2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: ``[N, K/2]`` uint8 -> ``[N, K]`` uint8 values 0..15."""
    n, half_k = packed.shape
    k = half_k * 2
    flat = packed.reshape(-1)
    out = torch.empty(n, k, dtype=torch.uint8, device=packed.device)
    full = n - n % BLOCK_N
    if full:
        byte = flat[: full * half_k].reshape(full // BLOCK_N, k, BLOCK_N // 2)  # [nb, K, BLOCK_N/2]
        view = out[:full].reshape(full // BLOCK_N, 2, BLOCK_N // 2, k)  # [nb, half, j, K]
        view[:, 0] = (byte & 0x0F).transpose(1, 2)
        view[:, 1] = (byte >> 4).transpose(1, 2)
    if full < n:
        r = n - full
        byte = flat[full * half_k :].reshape(k, r // 2)  # [K, r/2]
        view = out[full:].reshape(r // 2, 2, k)
        view[:, 0] = (byte & 0x0F).T
        view[:, 1] = (byte >> 4).T
    return out


def unpack_transposed(
    packed: torch.Tensor, start: int, stop: int, dtype: torch.dtype = torch.uint8
) -> torch.Tensor:
    """Rows ``start:stop`` of a packed ``[N, K/2]`` matrix, unpacked and transposed: ``[K, rows]``.

    ``start`` must be a multiple of `BLOCK_N`. The values (0..15) come out in the
    transposed layout (the order of the packed bytes) as ``dtype``, ready for
    ``x @ w_t``. Functional (no writes into views), so it compiles into one loop.
    """
    n, half_k = packed.shape
    k = half_k * 2
    if start % BLOCK_N:
        raise ValueError(f"unpack_transposed: start {start} is not a multiple of {BLOCK_N}")
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=packed.device)  # low nibble, high nibble
    parts = []
    full_stop = min(stop, n - n % BLOCK_N)
    if full_stop > start:
        nb = (full_stop - start) // BLOCK_N
        byte = packed[start:full_stop].reshape(nb, k, BLOCK_N // 2)  # contiguous: fast shifts
        both = torch.stack((byte & 0x0F, byte >> 4), dim=2)  # [nb, K, 2, 32]: rows j, j + 32
        parts.append(both.permute(1, 0, 2, 3).reshape(k, nb * BLOCK_N))  # [K, nb * BLOCK_N]
    if stop > full_stop:
        r = stop - full_stop  # the tail block (stop == N)
        byte = packed[full_stop:stop].reshape(k, r // 2)  # [K, r/2]
        parts.append(((byte[:, :, None] >> shifts) & 0x0F).reshape(k, r))  # rows 2j, 2j + 1
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out.to(dtype)


def _plane_bytes(packed: torch.Tensor, start: int, stop: int, k: int, plane: int) -> torch.Tensor:
    """The bytes of plane ``plane`` (columns ``plane*k .. (plane+1)*k`` of the unpacked matrix)
    of rows ``start:stop`` (whole 64-row blocks, or the tail block): ``[blocks, k, width]``."""
    half_k = packed.shape[1]
    width = BLOCK_N // 2 if stop - start >= BLOCK_N else (stop - start) // 2
    byte = packed[start:stop].reshape(-1, 2 * half_k, width)  # [blocks, K', width]
    return byte[:, plane * k : (plane + 1) * k]


def unpack_joined_transposed(
    packed: torch.Tensor, start: int, stop: int, k: int, packed_hi: torch.Tensor | None = None
) -> torch.Tensor:
    """Two planes of ``k`` columns each, their nibbles joined as ``hi << 4 | lo``: ``[k, rows]``
    uint8 for rows ``start:stop`` (``start`` a multiple of `BLOCK_N`), transposed as
    `unpack_transposed` returns them.

    The planes sit side by side in ``packed`` (``[N, k]`` bytes), or ``packed`` holds the low
    one and ``packed_hi`` the high one (``[N, k/2]`` each). The bytes are joined before they
    are spread: for the row in a byte's low nibble ``(hi << 4) | (lo & 15)``, for the one in
    its high nibble ``(hi & 0xF0) | (lo >> 4)``, so one pass makes both.
    """
    n = packed.shape[0]
    if start % BLOCK_N:
        raise ValueError(f"unpack_joined_transposed: start {start} is not a multiple of {BLOCK_N}")
    parts = []
    full_stop = min(stop, n - n % BLOCK_N)
    spans = [(start, full_stop)] if full_stop > start else []
    if stop > full_stop:
        spans.append((full_stop, stop))  # the tail block (stop == N)
    for a, b in spans:
        if packed_hi is None:
            lo, hi = _plane_bytes(packed, a, b, k, 0), _plane_bytes(packed, a, b, k, 1)
        else:
            lo, hi = _plane_bytes(packed, a, b, k, 0), _plane_bytes(packed_hi, a, b, k, 0)
        first = torch.bitwise_left_shift(hi, 4).bitwise_or_(lo & 0x0F)  # rows in the low nibbles
        second = (hi & 0xF0).bitwise_or_(lo >> 4)  # ... and in the high nibbles
        blocks, width = lo.shape[0], lo.shape[2]
        if b - a >= BLOCK_N:  # full blocks: rows j, j + BLOCK_N/2
            both = torch.stack((first, second), dim=2)  # [blocks, k, 2, 32]
            parts.append(both.permute(1, 0, 2, 3).reshape(k, blocks * BLOCK_N))
        else:  # the tail block: rows 2j, 2j + 1
            parts.append(torch.stack((first[0], second[0]), dim=2).reshape(k, 2 * width))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def gather_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Unpack only ``rows`` (``[R]`` int64) of a packed ``[N, K/2]`` matrix -> ``[R, K]`` uint8."""
    n, half_k = packed.shape
    k = half_k * 2
    full = n - n % BLOCK_N
    block, within = rows // BLOCK_N, rows % BLOCK_N
    if full == n:  # whole blocks only: one strided gather, no [R, K] index tensor
        shift = ((within // (BLOCK_N // 2)) * 4).to(torch.uint8)
        byte = packed.reshape(n // BLOCK_N, k, BLOCK_N // 2)[block, :, within % (BLOCK_N // 2)]  # [R, K]
        return (byte >> shift[:, None]) & 0x0F
    flat = packed.reshape(-1)
    # Full blocks: row j of a block is byte column j % 32, nibble j // 32.
    col = within % (BLOCK_N // 2)
    shift = (within // (BLOCK_N // 2)) * 4
    width = torch.full_like(rows, BLOCK_N // 2)
    base = block * BLOCK_N * half_k
    if full < n:  # the tail block: pairs of adjacent rows
        r = n - full
        in_tail = rows >= full
        t = rows - full
        col = torch.where(in_tail, t // 2, col)
        shift = torch.where(in_tail, (t % 2) * 4, shift)
        width = torch.where(in_tail, torch.full_like(rows, r // 2), width)
        base = torch.where(in_tail, torch.full_like(rows, full * half_k), base)
    ks = torch.arange(k, device=packed.device)
    index = base[:, None] + ks[None, :] * width[:, None] + col[:, None]  # [R, K] byte positions
    return (flat[index] >> shift[:, None].to(torch.uint8)) & 0x0F


def _converter_block_n() -> int:
    """The converter's row block (`_BLOCK_SIZES`), found by packing a probe both ways; 64 when
    no layout matches (`cpu_kernel_usable` then says no)."""
    try:
        gen = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (64 + 48, 64), generator=gen, dtype=torch.int32)
        ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    except (RuntimeError, AttributeError, NotImplementedError):
        return _BLOCK_SIZES[0]
    return next((b for b in _BLOCK_SIZES if torch.equal(ref, _pack(q, b))), _BLOCK_SIZES[0])


BLOCK_N = _converter_block_n()  # rows per packing block


@functools.cache
def cpu_kernel_usable() -> bool:
    """Whether this torch has the CPU int4 kernel and its converter uses the layout `pack` writes."""
    try:
        gen = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (BLOCK_N + 48, 64), generator=gen, dtype=torch.int32)
        ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        if not torch.equal(ref, pack(q)):
            return False
        x = torch.ones(1, 64, dtype=torch.bfloat16)
        sz = torch.zeros(2, q.shape[0], 2, dtype=torch.bfloat16)
        sz[..., 0] = 1.0
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, ref, 32, sz)
        return bool(torch.equal(y.float()[0], (q - 8).sum(1).float()))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


KERNEL_GROUP_SIZES = (32, 64, 128, 256)


def cpu_kernel_accepts(
    x: torch.Tensor,
    packed: torch.Tensor,
    group_size: int,
    scale_zero: torch.Tensor,
    *,
    usable_checked: bool = False,
) -> bool:
    """Whether ``_weight_int4pack_mm_for_cpu`` computes ``x @ W.T`` correctly for these operands.

    What torch does not check and the kernel assumes: ``N % 16 == 0``, ``scale_zero`` of shape
    ``[K / group_size, N, 2]``, contiguous, in x's dtype, ``M*K``, ``N*K``, ``M*N`` below 2^31;
    plus torch's own checks (refused here rather than raised). ``usable_checked``: the caller knows
    `cpu_kernel_usable` holds (inside a compiled graph). Why each: docs/quantization.md.
    """
    if not plain_cpu_operands(x, packed, torch.uint8, scale_zero, 3):
        return False
    m, k = x.shape
    n = packed.shape[0]
    return (
        group_size in KERNEL_GROUP_SIZES
        and k % group_size == 0
        and packed.shape[1] * 2 == k
        and n % ROW_MULTIPLE == 0
        and scale_zero.shape == (k // group_size, n, 2)
        and max(m * k, n * k, m * n, 2 * n * (k // group_size)) < INT32_LIMIT
        and (usable_checked or cpu_kernel_usable())
    )


def cpu_matmul(
    x: torch.Tensor, packed: torch.Tensor, group_size: int, scale_zero: torch.Tensor
) -> torch.Tensor:
    """``x [M, K]`` (bfloat16) times the packed weight: ``[M, N]`` in x's dtype.

    The caller checks `cpu_kernel_accepts` first.
    """
    y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_zero)
    return y


__all__ = [
    "BLOCK_N",
    "KERNEL_GROUP_SIZES",
    "ROW_MULTIPLE",
    "cpu_kernel_accepts",
    "cpu_kernel_usable",
    "cpu_matmul",
    "gather_rows",
    "pack",
    "unpack",
    "unpack_joined_transposed",
    "unpack_transposed",
]
