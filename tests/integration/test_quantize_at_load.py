"""Quantize-at-load (``quantize="q4_0" | "int8"``) on the tiny checkpoints.

For each architecture and scheme: the float model (our loader) is copied and
`quantize_model_` swaps its linears. Checked and printed:

* every ``nn.Linear`` (blocks and ``lm_head``) is quantized; the embedding stays float and
  untouched; a tied ``lm_head`` gets its own packed copy;
* the quantized model equals a float model running on the quantized weights
  (``effective_weight``): exactly with a float32 compute dtype, to bfloat16 rounding with
  the default bfloat16 one;
* the accuracy cost vs the float model (max logit error, top-1 agreement) and the memory saved;
* a linear whose ``in_features`` is not a multiple of 32 stays float under ``q4_0``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from infer.loader.build import load_safetensors_model
from infer.loader.config import load_config
from infer.models import model_class
from infer.quant import QuantizedLinear, module_nbytes, quantize_model_
from infer.testing import build_checkpoint

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def float_with_effective_weights(model: nn.Module, quantized: nn.Module) -> nn.Module:
    """``model`` with each quantized linear's weight replaced by what the packed module computes with."""
    ref = copy.deepcopy(model)
    for name, module in quantized.named_modules():
        if isinstance(module, QuantizedLinear):
            linear = ref.get_submodule(name)
            assert isinstance(linear, nn.Linear)
            linear.weight = nn.Parameter(module.effective_weight(), requires_grad=False)
    return ref


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(IDS)
    return out


@pytest.mark.parametrize("scheme", ["q4_0", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_quantize_model(
    arch: str, scheme: str, our_model_factory: Callable[..., Any], tiny_ckpt_factory: Any
) -> None:
    model = our_model_factory(tiny_ckpt_factory(arch))
    embed_before = model.embed_tokens.weight.detach().clone()
    ref = logits(model)
    linears = sorted(name for name, m in model.named_modules() if isinstance(m, nn.Linear))

    quantized = copy.deepcopy(model)
    report = quantize_model_(quantized, scheme)
    assert sorted(report.quantized) == linears and "lm_head" in linears and not report.kept_float
    assert isinstance(quantized.embed_tokens, nn.Embedding)
    assert torch.equal(quantized.embed_tokens.weight, embed_before)
    head = quantized.lm_head
    assert isinstance(head, QuantizedLinear)
    if model.config.tie_word_embeddings:  # the head has its own packed copy; the embedding stays float
        assert model.lm_head.weight is model.embed_tokens.weight
        assert all(b.data_ptr() != quantized.embed_tokens.weight.data_ptr() for b in head.buffers())
    out = logits(quantized)

    # Mechanics: identical to a float model on the quantized weights (float32 compute: exact).
    exact = copy.deepcopy(model)
    quantize_model_(exact, scheme, compute_dtype=torch.float32)
    eff_ref = logits(float_with_effective_weights(model, exact))
    mech_f32 = float((logits(exact) - eff_ref).abs().max())
    mech_bf16 = float((out - logits(float_with_effective_weights(model, quantized))).abs().max())

    # Accuracy cost vs the float model.
    err = float((out - ref).abs().max())
    top1 = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
    saved = report.saved_bytes / report.bytes_before
    print(
        f"{arch} {scheme}: max |logit err| {err:.3f} (logits up to {float(ref.abs().max()):.1f}), "
        f"top-1 agreement {top1:.1%} over {IDS.numel()} positions; memory {report.bytes_before} -> "
        f"{report.bytes_after} bytes ({saved:.0%} saved); vs float-on-quantized-weights: "
        f"f32 compute {mech_f32:.1e}, bf16 compute {mech_bf16:.1e}"
    )
    assert mech_f32 < 1e-3
    assert mech_bf16 < 0.05 * float(eff_ref.abs().max())
    assert report.bytes_after == module_nbytes(quantized) < report.bytes_before
    # Tiny random models are far more sensitive than trained ones (docs/quantization.md has
    # real-model numbers); these bounds only catch a broken scheme.
    assert top1 >= (0.7 if scheme == "int8" else 0.25)
    assert saved > (0.55 if scheme == "int8" else 0.65)


def test_q4_0_keeps_float_where_in_features_is_not_a_multiple_of_32(tmp_path: Path) -> None:
    path = build_checkpoint(tmp_path / "qwen3-hd20", "qwen3", head_dim=20)  # o_proj: in = 4 * 20 = 80
    config = load_config(path)
    model = load_safetensors_model(path, config, model_class(config), dtype=torch.float32, device="cpu")
    quantized = copy.deepcopy(model)
    report = quantize_model_(quantized, "q4_0")
    kept = sorted(report.kept_float)
    assert kept == [f"layers.{i}.self_attn.o_proj" for i in range(config.num_hidden_layers)]
    for name in kept:
        assert isinstance(quantized.get_submodule(name), nn.Linear)  # kept float (not packed)
    assert "layers.0.self_attn.q_proj" in report.quantized
    ref, out = logits(model), logits(quantized)
    top1 = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"qwen3 head_dim=20 q4_0: kept float {kept}; top-1 agreement {top1:.1%}; {report}")
    assert torch.isfinite(out).all()
