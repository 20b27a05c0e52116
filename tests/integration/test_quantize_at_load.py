"""Quantize-at-load (``quantize="q4_0" | "int8"``) on the tiny checkpoints.

For each architecture and scheme, ``infer.load(path, quantize=scheme)`` against the float
model ``infer.load(path)``. Checked and printed:

* every ``nn.Linear`` (blocks and ``lm_head``) is quantized; the embedding stays float and
  untouched; a tied ``lm_head`` gets its own packed copy;
* the quantized model equals a float model running on the quantized weights
  (``effective_weight``): to bfloat16 rounding with the default bfloat16 compute dtype,
  and to float32 rounding when its packed modules compute in float32;
* the accuracy cost vs the float model (max logit error, top-1 agreement) and the memory saved;
* a linear whose ``in_features`` is not a multiple of 32 stays float under ``q4_0``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import infer
from infer.models.projections import unfuse_projections
from infer.quant import QuantizedLinear, module_nbytes
from infer.testing import build_checkpoint

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def float_with_effective_weights(model: nn.Module, quantized: nn.Module) -> nn.Module:
    """``model`` with each quantized linear's weight replaced by what the packed module computes with."""
    ref = copy.deepcopy(model)
    unfuse_projections(ref)  # the fused q/k/v and gate/up would keep the old weights
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


def float32_compute(model: nn.Module) -> nn.Module:
    """A copy whose packed modules dequantize and multiply in float32 (no bfloat16 rounding).

    The head's exact re-scoring is switched off: it uses the float32 scales, which
    ``effective_weight`` (the bfloat16 ones) does not.
    """
    exact = copy.deepcopy(model)
    unfuse_projections(exact)  # the fused products would keep bfloat16 compute
    for module in exact.modules():
        if isinstance(module, QuantizedLinear):
            module.compute_dtype = torch.float32
            module.use_kernel = False
            module._buffers.pop("scale_zero_residual", None)
            for name, buf in list(module.named_buffers()):
                if buf.is_floating_point():
                    setattr(module, name, buf.float())
    return exact


@pytest.mark.parametrize("scheme", ["q4_0", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_quantize_at_load(arch: str, scheme: str, tiny_ckpt_factory: Any) -> None:
    path = tiny_ckpt_factory(arch)
    model = infer.load(path).model
    quantized = infer.load(path, quantize=scheme).model
    ref = logits(model)
    linears = sorted(name for name, m in model.named_modules() if isinstance(m, nn.Linear))
    packed = sorted(name for name, m in quantized.named_modules() if isinstance(m, QuantizedLinear))
    assert packed == linears and "lm_head" in linears
    assert isinstance(quantized.embed_tokens, nn.Embedding)
    assert torch.equal(quantized.embed_tokens.weight, model.embed_tokens.weight)  # the embedding stays float
    head = quantized.lm_head
    assert isinstance(head, QuantizedLinear)
    if model.config.tie_word_embeddings:  # the head has its own packed copy; the embedding stays float
        assert model.lm_head.weight is model.embed_tokens.weight
        assert all(b.data_ptr() != quantized.embed_tokens.weight.data_ptr() for b in head.buffers())
    out = logits(quantized)

    # Mechanics: a float model on the quantized weights computes the same.
    eff_ref = logits(float_with_effective_weights(model, quantized))
    mech_f32 = float((logits(float32_compute(quantized)) - eff_ref).abs().max())
    mech_bf16 = float((out - eff_ref).abs().max())

    # Accuracy cost vs the float model.
    err = float((out - ref).abs().max())
    top1 = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
    before, after = module_nbytes(model), module_nbytes(quantized)
    saved = 1 - after / before
    print(
        f"{arch} {scheme}: max |logit err| {err:.3f} (logits up to {float(ref.abs().max()):.1f}), "
        f"top-1 agreement {top1:.1%} over {IDS.numel()} positions; memory {before} -> "
        f"{after} bytes ({saved:.0%} saved); vs float-on-quantized-weights: "
        f"f32 compute {mech_f32:.1e}, bf16 compute {mech_bf16:.1e}"
    )
    assert mech_f32 < 1e-3
    assert mech_bf16 < 0.05 * float(eff_ref.abs().max())
    # Tiny random models are far more sensitive than trained ones (docs/quantization.md has
    # real-model numbers); these bounds only catch a broken scheme.
    assert top1 >= (0.7 if scheme == "int8" else 0.25)
    assert saved > (0.55 if scheme == "int8" else 0.65)


def test_q4_0_keeps_float_where_in_features_is_not_a_multiple_of_32(tmp_path: Path) -> None:
    path = build_checkpoint(tmp_path / "qwen3-hd20", "qwen3", head_dim=20)  # o_proj: in = 4 * 20 = 80
    model = infer.load(path).model
    quantized = infer.load(path, quantize="q4_0").model
    kept = sorted(n for n, m in quantized.named_modules() if isinstance(m, nn.Linear))
    layers = model.config.num_hidden_layers
    assert kept == [f"layers.{i}.self_attn.o_proj" for i in range(layers)]
    assert isinstance(quantized.get_submodule("layers.0.self_attn.q_proj"), QuantizedLinear)
    ref, out = logits(model), logits(quantized)
    top1 = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"qwen3 head_dim=20 q4_0: kept float {kept}; top-1 agreement {top1:.1%}")
    assert torch.isfinite(out).all()
