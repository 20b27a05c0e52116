"""`infer.quant.tiles`: the compiled one-pass dequantized tiles equal the eager tiles bitwise, for
every packed form (one plane, two planes side by side or split, paired groups of 16) and tile
dtype, and a product through them equals the eager product; within one rounding of `dequantize`."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from infer.quant import QuantizedLinear, dequantize, int4, tiles
from infer.testing import random_gguf

pytestmark = pytest.mark.slow  # each form's kernels compile (inductor): ~20 s in all


@pytest.fixture(autouse=True)
def compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFER_DEQUANT", "compiled")  # the mode these tests check (off by default)


FORMS = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q8_0, T.MXFP4, T.Q2_K, T.Q3_K, T.Q6_K]


def _module(
    qtype: T, n: int = 320, split: bool = False, dtype: torch.dtype = torch.bfloat16
) -> QuantizedLinear:
    k = 512  # a multiple of every type's block (256 for K-quants)
    raw = random_gguf(qtype, n, k, seed=int(qtype))
    return QuantizedLinear.from_gguf(raw, qtype, (n, k), exact_rescoring=split, compute_dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qtype", FORMS, ids=lambda t: t.name)
def test_compiled_tiles_equal_eager_tiles(
    qtype: T, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each form's compiled tile is the eager tile, bitwise; both within the compute dtype's
    rounding of `dequantize` (bfloat16: scales and values rounded; float32: exact to 1e-6)."""
    lin = _module(qtype, dtype=dtype)
    if lin.fmt != "int4":
        pytest.skip(f"{qtype.name} is held {lin.fmt}")
    spans = [(0, int4.BLOCK_N), (int4.BLOCK_N, 4 * int4.BLOCK_N)]
    with torch.inference_mode():
        fast = [lin._compiled_tile(a, b, dtype) for a, b in spans]
        monkeypatch.setenv("INFER_DEQUANT", "eager")
        eager = [lin._dequant_tile_t(a, b, dtype) for a, b in spans]
        exact = dequantize(random_gguf(qtype, 320, 512, seed=int(qtype)), qtype, (320, 512))
    form = "paired" if lin.paired else f"{lin.planes} plane(s)"
    for (a, b), f, e in zip(spans, fast, eager, strict=True):
        assert f is not None and f.dtype == dtype and f.shape == (512, b - a)
        err = (f.float() - exact[a:b].T).abs().max().item() / exact.abs().max().item()
        print(f"{qtype.name} ({form}) rows {a}:{b} {dtype}: compiled == eager {torch.equal(f, e)}, "
              f"relative error to dequantize {err:.1e}")  # fmt: skip
        assert torch.equal(f, e)
        assert err < (2**-7 if dtype == torch.bfloat16 else 1e-6)


def test_split_planes_of_a_head_equal_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q8_0 head's planes held apart (`exact_rescoring`: ``packed`` and ``packed_hi``)."""
    lin = _module(T.Q8_0, split=True)
    assert lin.split
    with torch.inference_mode():
        fast = lin._compiled_tile(0, 2 * int4.BLOCK_N, torch.bfloat16)
        monkeypatch.setenv("INFER_DEQUANT", "eager")
        eager = lin._dequant_tile_t(0, 2 * int4.BLOCK_N, torch.bfloat16)
    assert fast is not None and torch.equal(fast, eager)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_0, T.Q6_K], ids=lambda t: t.name)
def test_products_through_compiled_tiles_equal_eager(qtype: T, monkeypatch: pytest.MonkeyPatch) -> None:
    """A many-row product (tiles; the tail block eager) gives the eager route's outputs bitwise."""
    monkeypatch.setattr(tiles, "MIN_WEIGHTS", 0)  # (this small matrix would keep eager tiles)
    lin = _module(qtype, n=300)  # 300 rows: whole blocks and a tail block
    x = torch.randn(200, 512, generator=torch.Generator().manual_seed(1))
    ran: list[bool] = []
    real = tiles.run

    def counted(*args: object) -> torch.Tensor | None:
        out = real(*args)  # type: ignore[arg-type]
        ran.append(out is not None)
        return out

    monkeypatch.setattr(tiles, "run", counted)
    with torch.inference_mode():
        fast = lin._product(x.bfloat16(), False, 0)
        monkeypatch.setenv("INFER_DEQUANT", "eager")
        eager = lin._product(x.bfloat16(), False, 0)
    assert torch.equal(fast, eager)
    assert ran and all(ran[: len(ran) // 2]), "the whole blocks' tiles were not compiled"


def test_the_switch_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFER_DEQUANT", "fast")
    with pytest.raises(ValueError, match="INFER_DEQUANT must be"):
        tiles.enabled()
