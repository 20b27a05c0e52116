"""`infer.quant.dequantize` against the numpy reference ``gguf.quants.dequantize``, bit for bit.

Random blocks come from ``gguf.quants.quantize`` where the package has a quantizer, and
otherwise from random bytes with fp16 scales spread over many magnitudes (including
zero, negative and subnormal ones). The real files are checked tensor by tensor.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as ref_quants

from infer.quant import SUPPORTED, UnsupportedQuantType, dequantize, quantize_q4_0

T = GGMLQuantizationType
QUANTIZED = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4]
WITH_REF_QUANTIZER = {T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4}
# Byte offsets of the fp16 scales inside each block (the rest of the block is free bits).
FP16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.MXFP4: [],
}  # fmt: skip


def random_blocks(qtype: T, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """``[n_blocks, type_size]`` random bytes whose fp16 fields are finite and of varied magnitude."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        mag = 10.0 ** rng.uniform(-7, 3, size=n_blocks)  # down to fp16 subnormals
        values = (rng.standard_normal(n_blocks) * mag).astype(np.float16)
        values[rng.random(n_blocks) < 0.05] = 0  # some all-zero scales
        blocks[:, off : off + 2] = values.view(np.uint8).reshape(n_blocks, 2)
    if qtype == T.MXFP4:  # E8M0 exponents: the two subnormal cases and a finite range
        blocks[:, 0] = rng.choice(np.array([0, 1, *range(100, 150)], dtype=np.uint8), size=n_blocks)
    return blocks


def assert_bit_exact(ours: torch.Tensor, ref: np.ndarray, what: str) -> None:
    ours_np = ours.detach().cpu().numpy()
    assert ours_np.dtype == np.float32 and ref.dtype == np.float32, what
    assert ours_np.shape == ref.shape, f"{what}: shape {ours_np.shape} != {ref.shape}"
    diff = ours_np.view(np.uint32) != ref.view(np.uint32)
    if diff.any():
        i = np.flatnonzero(diff)[0]
        pytest.fail(
            f"{what}: {int(diff.sum())} of {diff.size} values differ; first at {i}: "
            f"{ours_np.reshape(-1)[i]!r} vs reference {ref.reshape(-1)[i]!r}"
        )


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_random_bytes_bit_exact(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    block, _ = GGML_QUANT_SIZES[qtype]
    rows, cols = 24, block * 3
    raw = random_blocks(qtype, rows * cols // block, rng).reshape(rows, -1)
    ref = ref_quants.dequantize(raw, qtype)
    ours = dequantize(torch.from_numpy(raw), qtype, (rows, cols))
    assert_bit_exact(ours, ref, qtype.name)
    print(f"{qtype.name}: {ref.size} values bit-exact (random bytes), max |w| {np.abs(ref).max():.3g}")


@pytest.mark.parametrize("qtype", sorted(WITH_REF_QUANTIZER), ids=lambda t: t.name)
def test_reference_quantized_bit_exact(qtype: T) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    block, _ = GGML_QUANT_SIZES[qtype]
    weights = (rng.standard_normal((16, block * 8)) * rng.uniform(0.01, 3.0, size=(16, 1))).astype(np.float32)
    raw = ref_quants.quantize(weights, qtype)
    ref = ref_quants.dequantize(raw, qtype)
    ours = dequantize(torch.from_numpy(raw), qtype, weights.shape)
    assert_bit_exact(ours, ref, qtype.name)
    err = np.abs(ref - weights).max() / np.abs(weights).max()
    print(f"{qtype.name}: gguf-quantized blocks bit-exact; quantization error {err:.3g} of max |w|")


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_types(qtype: T) -> None:
    rng = np.random.default_rng(7)
    weights = rng.standard_normal((5, 12)).astype(np.float32)
    stored = ref_quants.quantize(weights, qtype)
    raw = np.ascontiguousarray(stored).view(np.uint8).reshape(-1)
    ref = ref_quants.dequantize(stored, qtype).reshape(5, 12).astype(np.float32)
    assert_bit_exact(dequantize(torch.from_numpy(raw.copy()), qtype, (5, 12)), ref, qtype.name)


def test_large_tensor_is_decoded_in_chunks() -> None:
    rng = np.random.default_rng(3)
    rows, cols = 2 * (1 << 21) // 256 + 3, 256  # more values than one decoding chunk
    raw = random_blocks(T.Q4_K, rows, rng)
    ours = dequantize(torch.from_numpy(raw), T.Q4_K, (rows, cols))
    assert_bit_exact(ours, ref_quants.dequantize(raw, T.Q4_K), "Q4_K (chunked)")


def test_flat_and_unaligned_raw() -> None:
    rng = np.random.default_rng(4)
    raw = random_blocks(T.Q6_K, 6, rng).reshape(-1)
    ref = ref_quants.dequantize(raw.reshape(2, -1), T.Q6_K)
    padded = torch.from_numpy(np.concatenate([np.zeros(3, np.uint8), raw]))
    assert_bit_exact(dequantize(padded[3:], T.Q6_K, (2, 768)), ref, "Q6_K from an odd offset")
    f32 = torch.from_numpy(
        np.concatenate([np.zeros(1, np.uint8), np.arange(8, dtype=np.float32).view(np.uint8)])
    )
    assert torch.equal(dequantize(f32[1:], T.F32, (2, 4)), torch.arange(8, dtype=torch.float32).reshape(2, 4))


def test_our_q4_0_quantizer_output_is_read_by_gguf() -> None:
    w = torch.randn(8, 64)
    raw = quantize_q4_0(w)
    ref = ref_quants.dequantize(raw.numpy(), T.Q4_0)
    assert_bit_exact(dequantize(raw, T.Q4_0, (8, 64)), ref, "Q4_0 from quantize_q4_0")


def test_unsupported_type_is_named() -> None:
    raw = torch.zeros(66, dtype=torch.uint8)
    with pytest.raises(UnsupportedQuantType, match=r"blk\.0\.attn_q\.weight.*IQ2_XXS"):
        dequantize(raw, T.IQ2_XXS, (1, 256), name="blk.0.attn_q.weight")
    with pytest.raises(UnsupportedQuantType, match="unknown GGML type id 99"):
        dequantize(raw, 99, (1, 256))
    assert T.IQ2_XXS not in SUPPORTED


def test_wrong_byte_count_is_named() -> None:
    with pytest.raises(
        ValueError, match=r"token_embd\.weight: Q8_0 tensor of shape \[2, 64\] needs 136 bytes, got 100"
    ):
        dequantize(torch.zeros(100, dtype=torch.uint8), T.Q8_0, (2, 64), name="token_embd.weight")
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        dequantize(torch.zeros(144, dtype=torch.uint8), T.Q4_K, (1, 128))


# ---- the real files ---------------------------------------------------------------

MAX_ROWS = 96  # rows checked per tensor (all rows of smaller tensors): keeps the test to seconds


def _real_files() -> list[tuple[str, object]]:
    from infer.realmodels import gemma3_270m_path, smollm2_path

    return [("SmolLM2-135M Q4_1", smollm2_path), ("Gemma-3-270M Q4_K_M", gemma3_270m_path)]


@pytest.mark.realmodel
@pytest.mark.parametrize("label,path_fn", _real_files(), ids=["smollm2", "gemma3"])
def test_real_file_every_tensor_bit_exact(label: str, path_fn: object) -> None:
    from infer.gguf.reader import GGUFFile

    assert callable(path_fn)
    gguf_file = GGUFFile(path_fn())
    start = time.perf_counter()
    counts: dict[str, int] = {}
    checked = 0
    rng = np.random.default_rng(0)
    for name, info in gguf_file.tensors.items():
        raw = np.asarray(gguf_file.raw(name))
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        cols = info.shape[-1]
        raw2d = raw.reshape(rows, -1)
        if rows > MAX_ROWS:  # the first, the last and random rows in between
            pick = np.unique(np.concatenate([[0, rows - 1], rng.choice(rows, MAX_ROWS - 2, replace=False)]))
            raw2d = raw2d[pick]
        raw2d = np.ascontiguousarray(raw2d)
        ref = ref_quants.dequantize(raw2d, info.ggml_type).reshape(raw2d.shape[0], cols).astype(np.float32)
        ours = dequantize(torch.from_numpy(raw2d), info.ggml_type, (raw2d.shape[0], cols), name=name)
        assert_bit_exact(ours, ref, f"{label} {name} ({info.type_name})")
        counts[info.type_name] = counts.get(info.type_name, 0) + 1
        checked += ref.size
    print(
        f"{label}: {len(gguf_file.tensors)} tensors bit-exact {counts}, {checked} values, "
        f"{time.perf_counter() - start:.1f}s"
    )
