"""A prompt through the one-pass dequantized tiles (`infer.quant.tiles`) gives the eager tiles'
logits bitwise, and so their tokens: the kernels are the eager tiles' operations, one for one.

Per packed form the GGUF writer writes (one plane; two planes: the paired groups of 16 are K-quants,
which it does not write, so `test_quant_tiles.py` / `test_aot_tiles.py` check them per product), on
a tiny Llama; the routes' fixed bounds (``INFER_ROUTES=off``) send a 160-token prompt to the tiles
in both modes, and every matrix is eligible for one-pass tiles (``tiles.MIN_WEIGHTS`` 0). The
compiled mode stands for the packages: the same kernels (`test_aot_tiles.py` checks packages
against eager tiles bitwise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import infer
from infer.gguf.writer import write_gguf
from infer.quant import tiles
from infer.testing import build_tokenizer, tiny_hf_model

pytestmark = pytest.mark.slow  # the compiled mode compiles each tile shape (~1-4 s each)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])  # one plane, two planes
def test_a_prompt_through_one_pass_tiles_gives_the_eager_logits_and_tokens(
    qtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("INFER_ROUTES", "off")  # the fixed bounds (96 / 48 rows): the prompt takes tiles
    monkeypatch.setattr(tiles, "MIN_WEIGHTS", 0)
    hf = tiny_hf_model("llama")
    path = write_gguf(tmp_path / f"llama-{qtype}.gguf", hf, build_tokenizer(tmp_path / "tok"), qtype=qtype)
    ids = torch.randint(5, 250, (160,), generator=torch.Generator().manual_seed(0)).tolist()

    one_pass: list[str] = []
    real = tiles.run

    def counted(fn: tiles.Kernel, *args: Any) -> torch.Tensor | None:
        out = real(fn, *args)
        if out is not None:
            one_pass.append(fn.__name__)
        return out

    monkeypatch.setattr(tiles, "run", counted)
    logits, tokens = {}, {}
    for mode in ("eager", "compiled"):
        monkeypatch.setenv("INFER_DEQUANT", mode)
        llm = infer.load(path)
        with torch.inference_mode():
            logits[mode] = llm.model(torch.tensor([ids]))
        tokens[mode] = llm.generate(ids, max_new_tokens=8).token_ids
    kernels = sorted(set(one_pass))
    err = (logits["compiled"].float() - logits["eager"].float()).abs().max().item()
    print(f"\n{qtype}: {len(one_pass)} one-pass tiles ({', '.join(kernels)}); max |logits diff| {err:.1e}; "
          f"tokens {tokens['compiled']}")  # fmt: skip
    assert kernels, "the compiled run's tiles never went through the one-pass kernels"
    assert kernels == (["two_planes"] if qtype in ("Q5_0", "Q8_0") else ["one_plane"])
    assert torch.equal(logits["compiled"], logits["eager"])
    assert tokens["compiled"] == tokens["eager"]
