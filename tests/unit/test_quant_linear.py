"""`QuantizedLinear` / `QuantizedEmbedding`: outputs vs ``F.linear`` on the dequantized weight.

Two references: the exact weight (`infer.quant.dequantize`, itself bit-exact with gguf)
and the module's `effective_weight` (the exact weight with scales rounded to the compute
dtype). With a float32 compute dtype the effective weight *is* the exact one (so the
packed forms are exact mappings); with bfloat16 the error is that of bfloat16 scales
and activations. Both the packed kernel (decode) and the tile-wise dequantization
(prefill) paths are forced and checked, for T=1 and T>1. Errors are printed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from infer.host import rows
from infer.models.projections import set_deterministic
from infer.quant import (
    QuantizedEmbedding,
    QuantizedLinear,
    dequantize,
    int4,
    quantize_linear,
    quantize_q4_0,
    routes,
)
from infer.quant.quantize import quantize_int8_per_channel
from infer.testing import random_gguf

T = GGMLQuantizationType
QUANTIZED = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4]
FP16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.MXFP4: [],
}  # fmt: skip
# Packed bytes / GGUF bytes expected per type (int4: bf16 scale+zero per group of 32 and plane;
# paired (groups of 16): two nibbles a value and a bf16 scale+zero per 16 values;
# dense: a bfloat16 copy), for a shape with no row padding.
MEMORY_RATIO = {
    T.Q4_0: 20 / 18, T.Q4_1: 1.0, T.Q4_K: 160 / 144, T.Q5_0: 40 / 22, T.Q5_1: 40 / 24,
    T.Q5_K: 320 / 176, T.Q8_0: 40 / 34, T.MXFP4: 40 / 17,
    T.Q2_K: 320 / 84, T.Q3_K: 320 / 110, T.Q6_K: 320 / 210,
}  # fmt: skip
# Input shapes: decode steps (one token per sequence: the packed kernel with bfloat16 compute)
# and prefill steps (several tokens: tile-wise dequantization + matmul).
DECODE_SHAPES = {"decode": (1, 1), "batched decode": (2, 1)}
PREFILL_SHAPES = {"prefill": (1, 9), "batched prefill": (2, 35)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def shape_for(qtype: T) -> tuple[int, int]:
    """(out, in): out is not a multiple of 64 (a tail block in the packing) nor of 16 (padding)."""
    block, _ = GGML_QUANT_SIZES[qtype]
    return 200, 512 if block == 256 else 96


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_float32_compute_is_an_exact_mapping(qtype: T) -> None:
    n, k = shape_for(qtype)
    raw = random_gguf(qtype, n, k, int(qtype))
    exact = dequantize(raw, qtype, (n, k))
    lin = QuantizedLinear.from_gguf(raw, qtype, (n, k), compute_dtype=torch.float32)
    w_err = rel_err(lin.effective_weight(), exact)
    errs = {}
    for label, lead in (DECODE_SHAPES | PREFILL_SHAPES).items():
        x = torch.randn(*lead, k)
        errs[label] = rel_err(lin(x), F.linear(x, exact))
    print(f"{qtype.name} fmt={lin.fmt} planes={lin.planes}: weight {w_err:.1e}; output {errs}")
    # Exact up to float32 rounding: the zero of K-quants is 8*d*sc - dmin*m, rounded once.
    assert w_err < 1e-6
    assert max(errs.values()) < 1e-5


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_bfloat16_paths_match_effective_weight(qtype: T) -> None:
    n, k = shape_for(qtype)
    raw = random_gguf(qtype, n, k, 50 + int(qtype))
    exact = dequantize(raw, qtype, (n, k))
    lin = QuantizedLinear.from_gguf(raw, qtype, (n, k))
    eff = lin.effective_weight()
    report = {"weight vs exact": rel_err(eff, exact)}
    assert lin.use_kernel == (lin.fmt in ("int4", "int8"))
    for label, lead in (DECODE_SHAPES | PREFILL_SHAPES).items():
        x = torch.randn(*lead, k)
        y = lin(x)
        assert y.shape == (*lead, n) and y.dtype == torch.float32
        report[f"{label} vs eff"] = rel_err(y, F.linear(x, eff))
        report[f"{label} vs exact"] = rel_err(y, F.linear(x, exact))
    print(f"{qtype.name} ({lin.fmt}): " + ", ".join(f"{k} {v:.1e}" for k, v in report.items()))
    assert report["weight vs exact"] < 2**-8  # bfloat16 scales: relative rounding 2^-9
    assert max(v for key, v in report.items() if "vs eff" in key) < 2e-2  # bfloat16 activations/output
    assert max(v for key, v in report.items() if "vs exact" in key) < 2e-2


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_memory_is_about_the_file_size(qtype: T) -> None:
    n, k = 256, 1024
    raw = random_gguf(qtype, n, k, 3)
    lin = QuantizedLinear.from_gguf(raw, qtype, (n, k))
    ratio = lin.packed_nbytes() / raw.numel()
    print(f"{qtype.name}: {raw.numel()} GGUF bytes -> {lin.packed_nbytes()} held ({ratio:.3f}x, {lin.fmt})")
    assert ratio == pytest.approx(MEMORY_RATIO[qtype], rel=1e-6)


def test_bias_dtype_and_leading_shape() -> None:
    raw = random_gguf(T.Q4_0, 64, 64, 1)
    bias = torch.randn(64)
    lin = QuantizedLinear.from_gguf(raw, T.Q4_0, (64, 64), bias=bias)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    y = lin(x)
    ref = F.linear(x.float(), lin.effective_weight(), bias)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 64)
    assert rel_err(y, ref) < 2e-2


def test_float_gguf_types_are_dense() -> None:
    w = torch.randn(32, 48)
    lin = QuantizedLinear.from_gguf(
        w.view(torch.uint8).reshape(-1), T.F32, (32, 48), compute_dtype=torch.float32
    )
    assert lin.fmt == "dense"
    x = torch.randn(3, 48)
    assert torch.equal(lin(x), rows.linear(x, lin.weight))  # the row-invariant product (same tensor:
    # MKL's rounding can depend on the weight's memory alignment)
    torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-6, atol=1e-6)


def test_wrong_byte_count_names_the_tensor() -> None:
    with pytest.raises(
        ValueError, match=r"blk\.3\.ffn_up\.weight: Q4_1 tensor of shape \[64, 64\] needs 2560 bytes"
    ):
        QuantizedLinear.from_gguf(
            torch.zeros(100, dtype=torch.uint8), T.Q4_1, (64, 64), name="blk.3.ffn_up.weight"
        )


# ---- the packed layout --------------------------------------------------------------


@pytest.mark.parametrize("rows", [16, 64, 112, 192, 208])
def test_int4_layout_matches_torch_converter(rows: int) -> None:
    q = torch.randint(0, 16, (rows, 96), dtype=torch.int32)
    ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(int4.pack(q), ref)
    assert torch.equal(int4.unpack(ref), q.to(torch.uint8))
    idx = torch.tensor([0, rows - 1, rows // 2, 5])
    assert torch.equal(int4.gather_rows(ref, idx), q[idx].to(torch.uint8))
    for start in range(0, rows, 64):
        assert torch.equal(int4.unpack_transposed(ref, start, rows), q[start:].T.to(torch.uint8))
    assert int4.cpu_kernel_usable()


@pytest.mark.parametrize("rows", [64, 80, 192, 208])
def test_joined_planes_unpack_as_both_planes(rows: int) -> None:
    """`int4.unpack_joined_transposed` = the two planes unpacked one by one and joined, for the
    planes side by side in one packed matrix and in two, full 64-row blocks and the tail."""
    gen = torch.Generator().manual_seed(rows)
    k = 96
    nib = torch.randint(0, 16, (rows, 2 * k), generator=gen, dtype=torch.uint8)
    both = int4.pack(nib)
    lo, hi = int4.pack(nib[:, :k].contiguous()), int4.pack(nib[:, k:].contiguous())
    for start, stop in [(0, rows), (64, rows), (0, 64)]:
        if stop <= start:
            continue
        want = (nib[start:stop, k:] << 4 | nib[start:stop, :k]).T
        assert torch.equal(int4.unpack_joined_transposed(both, start, stop, k), want)
        assert torch.equal(int4.unpack_joined_transposed(lo, start, stop, k, hi), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_0, T.Q6_K], ids=lambda t: t.name)
def test_a_tiles_scales_are_the_widened_scale_zero(qtype: T, dtype: torch.dtype) -> None:
    """`_tile_scales` (a bfloat16 pair widened by integer shifts) = ``scale_zero``'s slice widened
    to float32 and split, bitwise, for each form's groups (two planes: the low plane's) and every
    scale dtype, and contiguous (what a tile package reads)."""
    n, k = 320, 512
    lin = QuantizedLinear.from_gguf(random_gguf(qtype, n, k, seed=1), qtype, (n, k), compute_dtype=dtype)
    groups = k // (16 if lin.paired else 32)
    for start, stop in [(0, 64), (64, 256), (256, lin.packed.shape[0])]:
        scale, zero = lin._tile_scales(start, stop)
        want = lin.scale_zero[:groups, start:stop].to(torch.float32)
        assert scale.is_contiguous() and zero.is_contiguous() and scale.dtype == torch.float32
        assert torch.equal(scale, want[..., 0]) and torch.equal(zero, want[..., 1])


def test_a_paired_tile_at_an_odd_offset_is_not_read_as_words() -> None:
    """The read in order before a paired tile (`_read_in_order`) views the bytes as int64 words:
    packed bytes at an odd offset (a view into a larger buffer) are left unread, never an error,
    and the tile is the same."""
    lin = QuantizedLinear.from_gguf(random_gguf(T.Q6_K, 128, 512, seed=2), T.Q6_K, (128, 512))
    assert lin.paired
    want = lin._dequant_tile_t(0, 64)
    buffer = torch.empty(lin.packed.numel() + 1, dtype=torch.uint8)
    odd = buffer[1:].view(lin.packed.shape)
    odd.copy_(lin.packed)
    lin.packed = odd
    assert odd.storage_offset() % 8
    lin._read_in_order(0, 64)  # would raise if it viewed them
    assert torch.equal(lin._dequant_tile_t(0, 64), want)


# ---- embeddings -------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_embedding_lookup(qtype: T) -> None:
    n, k = shape_for(qtype)
    raw = random_gguf(qtype, n, k, 9)
    exact = dequantize(raw, qtype, (n, k))
    ids = torch.tensor([[0, 5, n - 1], [7, 7, 199]])
    emb = QuantizedEmbedding.from_gguf(raw, qtype, (n, k))
    assert torch.equal(emb(ids), exact[ids])  # from the GGUF bytes: bit-exact
    head = QuantizedLinear.from_gguf(raw, qtype, (n, k))
    tied = QuantizedEmbedding.from_linear(head)
    assert torch.equal(tied(ids), head.effective_weight()[ids])  # shares the head's packed storage
    assert tied.weight_nbytes == 0
    print(f"{qtype.name}: tied lookup vs exact rows {rel_err(tied(ids), exact[ids]):.1e}")


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q8_0], ids=lambda t: t.name)
def test_an_embedding_kept_as_stored_exports_with_a_dynamic_token_count(qtype: T) -> None:
    """A verify pass's package looks up a dynamic number of tokens (`infer.aot`): the embedding read
    from its GGUF bytes must not fix that count to the example's (``int()`` of a size did)."""
    n, k = shape_for(qtype)
    raw = random_gguf(qtype, n, k, 9)
    emb = QuantizedEmbedding.from_gguf(raw, qtype, (n, k))
    tokens = torch.export.Dim("tokens", min=2, max=16)
    ids = torch.tensor([[0, 5, n - 1, 7]])
    program = torch.export.export(emb, (ids,), dynamic_shapes=({1: tokens},), strict=False)
    other = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    assert torch.equal(program.module()(other), emb(other))


# ---- quantize at load ---------------------------------------------------------------


def reference_q4_0(w: np.ndarray) -> np.ndarray:
    """The reference loader's Q4_0 (shared/seeds/001), block by block, in float32."""
    out = []
    for row in w.astype(np.float32):
        for blk in row.reshape(-1, 32):
            d = np.float32(np.abs(blk).max()) / np.float32(7.0)
            inv = np.float32(0.0) if d == 0 else np.float32(1.0) / d
            q = []
            for v in blk:
                x = np.float32(v) * inv
                r = np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))  # Rust f32::round: half away from 0
                q.append(int(np.clip(r, -8, 7)) + 8)
            qs = [q[z] | (q[z + 16] << 4) for z in range(16)]
            out.append(np.concatenate([np.array([d], np.float16).view(np.uint8), np.array(qs, np.uint8)]))
    return np.concatenate(out).reshape(w.shape[0], -1)


def test_q4_0_quantizer_follows_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=gen)
    w[0, :32] = 0  # an all-zero block: d = 0
    w[1, :32] = torch.tensor([7.0] + [(i % 14) - 6.5 for i in range(31)])  # d = 1: ties at every value
    ours = quantize_q4_0(w).numpy()
    ref = reference_q4_0(w.numpy())
    assert np.array_equal(ours, ref)
    err = rel_err(dequantize(torch.from_numpy(ours), T.Q4_0, (6, 64)), w)
    print(f"q4_0 bytes identical to the reference; quantization error {err:.3f} of max |w|")


def test_quantize_linear_q4_0_and_int8() -> None:
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=gen) * 0.05)
    x = torch.randn(4, 96, generator=gen)
    ref = linear(x)
    q4 = quantize_linear(linear, "q4_0")
    q8 = quantize_linear(linear, "int8")
    assert isinstance(q4, QuantizedLinear) and isinstance(q8, QuantizedLinear)
    q, s = quantize_int8_per_channel(linear.weight)
    assert torch.equal(q8.effective_weight(), q.float() * s.float()[:, None])
    e4, e8 = rel_err(q4(x), ref), rel_err(q8(x), ref)
    print(f"quantize_linear: q4_0 output error {e4:.3f}, int8 {e8:.4f} (of max |y|)")
    assert e4 < 0.15 and e8 < 0.02
    odd = nn.Linear(40, 8)
    assert quantize_linear(odd, "q4_0") is odd  # 40 % 32 != 0: stays float
    assert isinstance(quantize_linear(odd, "int8"), QuantizedLinear)
    with pytest.raises(ValueError, match="unknown quantization scheme 'q3'"):
        quantize_linear(linear, "q3")


# ---- CUDA ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype: T) -> None:
    n, k = shape_for(qtype)
    raw = random_gguf(qtype, n, k, 11)
    cpu = QuantizedLinear.from_gguf(raw, qtype, (n, k))
    gpu = QuantizedLinear.from_gguf(raw.cuda(), qtype, (n, k))
    x = torch.randn(3, k)
    ref = F.linear(x, cpu.effective_weight())
    assert torch.equal(gpu.effective_weight().cpu(), cpu.effective_weight())
    err = rel_err(gpu(x.cuda()).cpu(), ref)
    print(f"{qtype.name} on CUDA: {err:.1e}")
    assert err < 2e-2


def test_head_rescoring_makes_top_logits_exact() -> None:
    """An output head built with exact_rescoring: its top-k outputs per row equal float32 arithmetic."""
    import gguf.quants as gq
    from gguf import GGMLQuantizationType as G

    from infer.quant import QuantizedLinear, dequantize

    gen = torch.Generator().manual_seed(0)
    n, k = 300, 64
    w = torch.randn(n, k, generator=gen)
    raw = torch.from_numpy(gq.quantize(w.numpy(), G.Q8_0))
    exact_w = dequantize(raw, G.Q8_0, (n, k))
    fast = QuantizedLinear.from_gguf(raw, G.Q8_0, (n, k))
    head = QuantizedLinear.from_gguf(raw, G.Q8_0, (n, k), exact_rescoring=True)
    x = torch.randn(5, k, generator=gen)
    ref = x @ exact_w.T
    with torch.no_grad():
        y_fast, y_head = fast(x), head(x)
    idx = y_head.topk(16, dim=-1).indices
    err_fast = (y_fast.gather(-1, idx) - ref.gather(-1, idx)).abs().max().item()
    err_head = (y_head.gather(-1, idx) - ref.gather(-1, idx)).abs().max().item()
    print(f"\ntop-16 logits vs float32: bfloat16 path {err_fast:.2e}, re-scored {err_head:.2e}")
    assert err_head <= 1e-4 < err_fast
    assert torch.equal(y_head.argmax(-1), ref.argmax(-1))
    assert torch.equal(head.exact_rows(torch.tensor([0, 17, 299])), exact_w[[0, 17, 299]])


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q5_0])
@pytest.mark.parametrize("n", [320, 300])  # whole 64-row packing blocks, and a tail block
def test_exact_outputs_are_float32_products_of_the_exact_rows(qtype: T, n: int) -> None:
    """`QuantizedLinear.exact_outputs` (the re-scoring's products, from the packed bytes) equals
    float32 products of the GGUF weights' exact rows: a Q8_0 head's two planes joined in one byte,
    other types plane by plane."""
    import gguf.quants as gq
    from gguf import GGMLQuantizationType as G

    from infer.quant import QuantizedLinear, dequantize

    gen = torch.Generator().manual_seed(n)
    k = 96
    raw = torch.from_numpy(gq.quantize(torch.randn(n, k, generator=gen).numpy(), G(int(qtype))))
    exact_w = dequantize(raw, qtype, (n, k))
    head = QuantizedLinear.from_gguf(raw, qtype, (n, k), exact_rescoring=True)
    assert head.split == (qtype == T.Q8_0)
    x = torch.randn(3, k, generator=gen) * 3
    idx = torch.randint(0, n, (3, 40), generator=gen)
    idx[0, :3] = torch.tensor([0, 63, n - 1])
    want = torch.einsum("mk,mjk->mj", x, exact_w[idx])
    got = head.exact_outputs(x, idx)
    scale = torch.einsum("mk,mjk->mj", x.abs(), exact_w[idx].abs())  # what float32 rounding scales with
    err = ((got - want).abs() / scale).max().item()
    print(f"\n{qtype.name} n={n}: exact_outputs vs float32 products, error {err:.1e} of sum|x w|")
    assert err <= 2 * k * 2.0**-24  # both sides' float32 summation orders, nothing more


@pytest.mark.parametrize(
    ("rows", "n", "k"), [(1, 262144, 128), (3, 49152, 128), (2, 49152, 16), (2, 300, 16)]
)
def test_top_indices_are_topk(rows: int, n: int, k: int) -> None:
    """The block-wise top-k an output head re-scores (`infer.quant.linear.top_indices`) picks
    entries of the same values as ``topk``, ties (repeated values) included."""
    from infer.quant.linear import top_indices

    gen = torch.Generator().manual_seed(n + k)
    y = torch.randn(rows, n, generator=gen)
    y[:, ::7] = y[:, ::7].round(decimals=1)  # many equal values near the top
    got = top_indices(y, k)
    want = y.topk(k, dim=-1).values
    assert got.shape == (rows, k) and all(len(set(r)) == k for r in got.tolist())  # k distinct indices
    assert torch.equal(y.gather(-1, got).sort(dim=-1, descending=True).values, want)


@pytest.mark.parametrize("k", [96, 128, 576, 1])
def test_fixed_order_dots_give_a_row_the_same_bits_among_any_rows(k: int) -> None:
    """`infer.quant.head.fixed_order_dots` (a processed row's exact logits, `DecoderLM.exact_logits`):
    a row's dot product is the same bits computed alone, among a few rows in any order, or in the
    whole matrix, and within float32 rounding of float64's."""
    from infer.quant.head import fixed_order_dots

    gen = torch.Generator().manual_seed(k)
    rows = torch.randn(3000, k, generator=gen) * torch.logspace(-3, 3, k)[torch.randperm(k, generator=gen)]
    x = torch.randn(k, generator=gen)
    whole = fixed_order_dots(rows, x)  # [3000]
    for ids in (torch.randperm(3000, generator=gen)[:64], torch.tensor([2999, 0, 17]), torch.tensor([5])):
        assert torch.equal(fixed_order_dots(rows[ids], x), whole[ids])
    assert torch.equal(fixed_order_dots(rows[1:], x), whole[1:])  # rows shifted against the vector lanes
    want = rows.double() @ x.double()
    scale = rows.double().abs() @ x.double().abs()
    err = ((whole.double() - want).abs() / scale).max().item()
    print(f"\nK={k}: fixed-order float32 vs float64, error {err:.1e} of sum|x w|")
    assert err <= (k.bit_length() + 1) * 2.0**-24  # a pairwise tree's rounding, nothing more


def _linears() -> dict[str, nn.Module]:
    """One module per product path: float (float32 / bfloat16), packed int4 (one and two planes),
    int8, dense bfloat16 GGUF, and packed weights with float32 compute."""
    torch.manual_seed(0)
    k, n = 576, 200
    dense = nn.Linear(k, n, bias=True)
    from infer.models.projections import Linear

    float_lin = Linear(k, n, bias=True)
    float_lin.load_state_dict(dense.state_dict())
    bf16_lin = Linear(k, n, bias=True).to(torch.bfloat16)
    bf16_lin.load_state_dict(dense.state_dict())
    return {
        "float32": float_lin,
        "bfloat16": bf16_lin,
        "Q4_1": QuantizedLinear.from_gguf(random_gguf(T.Q4_1, n, k, 1), T.Q4_1, (n, k)),
        "Q8_0 (two planes)": QuantizedLinear.from_gguf(random_gguf(T.Q8_0, n, k, 2), T.Q8_0, (n, k)),
        "Q6_K (dense bf16)": QuantizedLinear.from_gguf(random_gguf(T.Q6_K, n, 512, 3), T.Q6_K, (n, 512)),
        "Q4_0 float32": QuantizedLinear.from_gguf(
            random_gguf(T.Q4_0, n, k, 4), T.Q4_0, (n, k), compute_dtype=torch.float32
        ),
        "int8": quantize_linear(dense, "int8"),
    }


@pytest.mark.parametrize("name", list(_linears()))
def test_deterministic_rows_do_not_depend_on_the_other_rows(name: str) -> None:
    """In the deterministic mode, row 0's output is bitwise the same alone and beside 1..6 other
    rows, for decode steps ([B, 1, K]) and prefill steps ([B, T, K]), and whatever follows it
    in its step: every product is a tile of `TILE_ROWS` rows, one shape for every call."""
    lin = _linears()[name]
    set_deterministic(lin)
    k = 512 if name.startswith("Q6_K") else 576  # in_features, as _linears builds them
    dtype = torch.bfloat16 if name == "bfloat16" else torch.float32
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(7, 40, k, generator=gen).to(dtype)
    with torch.no_grad():
        for T in (1, 2, 3, 40):
            alone = lin(x[:1, :T])
            for B in range(2, 8):
                assert torch.equal(lin(x[:B, :T])[:1], alone), (name, T, B)
            if T > 1:  # a prefill's rows also do not depend on later tokens of the step
                assert torch.equal(lin(x[:1, : T + 5])[:, :T], alone), (name, T)


@pytest.mark.parametrize("name", list(_linears()))
def test_a_tile_computes_each_row_on_its_own(name: str) -> None:
    """What the deterministic mode rests on (`infer.host.rows`): a product of the fixed tile shape
    gives a row the same bits at every position of the tile, whatever the other rows hold."""
    lin = _linears()[name]
    k = 512 if name.startswith("Q6_K") else 576
    dtype = torch.bfloat16 if name == "bfloat16" else torch.float32
    gen = torch.Generator().manual_seed(11)
    row = torch.randn(1, k, generator=gen).to(dtype)
    results = []
    with torch.no_grad():
        for pos in range(rows.TILE_ROWS):
            for neighbours in ("zeros", "random"):
                tile = torch.zeros(rows.TILE_ROWS, k, dtype=dtype)
                if neighbours == "random":
                    tile = torch.randn(rows.TILE_ROWS, k, generator=gen).to(dtype)
                tile[pos] = row[0]
                results.append(lin(tile)[pos])
    same = sum(torch.equal(r, results[0]) for r in results)
    print(f"{name}: {same} of {len(results)} placements give the same bits")
    assert same == len(results)


@pytest.mark.parametrize("qtype", [t for t in QUANTIZED if t != T.MXFP4], ids=lambda t: t.name)
def test_scale_fields_tell_finiteness_exactly(qtype: T) -> None:
    """`scale_fields_finite` agrees with dequantizing every value: True on finite fields (even the
    largest fp16), False with one NaN or inf field, whichever field of a block it is."""
    from infer.quant.ggml import FP16_FIELDS, scale_fields_finite

    n, k = 64, 512
    raw = random_gguf(qtype, n, k, 7).clone()
    big = raw.clone()
    largest = torch.tensor([0xFF, 0x7B], dtype=torch.uint8)  # 65504, the largest finite fp16
    for off in FP16_FIELDS[qtype]:  # in every field of one row: the values stay finite
        big[3].view(-1, GGML_QUANT_SIZES[qtype][1])[:, off : off + 2] = largest
    for blocks in (raw, big):
        assert scale_fields_finite(blocks, qtype) is True
        assert bool(torch.isfinite(dequantize(blocks, qtype, (n, k))).all())
    for off in FP16_FIELDS[qtype]:
        for bad in (0x7E00, 0x7C00, 0xFC00):  # NaN, inf, -inf
            broken = raw.clone()
            blocks = broken.view(-1, GGML_QUANT_SIZES[qtype][1])
            blocks[5, off : off + 2] = torch.tensor([bad & 0xFF, bad >> 8], dtype=torch.uint8)
            assert scale_fields_finite(broken, qtype) is False
            assert not bool(torch.isfinite(dequantize(broken, qtype, (n, k))).all())
    assert scale_fields_finite(raw, T.F16) is None and scale_fields_finite(raw, T.MXFP4) is None


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_tiles_multiply_in_float32_without_bfloat16_arithmetic(
    qtype: T, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the CPU has no bfloat16 arithmetic (`native_bf16_gemm`, forced both ways here so every
    CPU runs both) prefill's dequantized tiles multiply in float32, elsewhere in bfloat16; the
    output is the effective weight's product either way, in the activations' dtype."""
    from infer.quant import linear

    n, k = shape_for(qtype)
    lin = QuantizedLinear.from_gguf(random_gguf(qtype, n, k, 11), qtype, (n, k))
    x = torch.randn(2, 60, k)  # prefill: past the kernel's rows (KERNEL_MAX_ROWS)
    ref = F.linear(x, lin.effective_weight())
    seen: list[torch.dtype] = []
    matmul = rows.matmul

    def recording(a: torch.Tensor, w_t: torch.Tensor, tile: int = 0) -> torch.Tensor:
        seen.append(w_t.dtype)
        return matmul(a, w_t, tile)

    gemm = routes.gemm

    def recording_gemm(a: torch.Tensor, w_t: torch.Tensor, how: str) -> torch.Tensor:
        seen.append(w_t.dtype)
        return gemm(a, w_t, how)

    monkeypatch.setattr(rows, "matmul", recording)
    monkeypatch.setattr(routes, "gemm", recording_gemm)
    monkeypatch.setenv("INFER_ROUTES", "off")  # the fixed bounds: 120 rows take the tiles
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(linear, "native_bf16_gemm", lambda native=native: native)
        seen.clear()
        y = lin(x)
        err = rel_err(y, ref)
        print(f"{qtype.name}: native bfloat16 {native}: tiles {set(seen)}, error {err:.1e}")
        assert seen and set(seen) == {want}
        assert y.dtype == torch.float32 and y.shape == (2, 60, n) and err < 2e-2
