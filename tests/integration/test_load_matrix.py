"""Every checkpoint layout in every load mode, through the one builder (`infer.assembly.build`).

Layouts: plain (Llama, untied), sharded, tied (Qwen 3), stored RoPE ``inv_freq`` buffers,
the multimodal Gemma 3 layout (language model nested, a vision tower beside it), GPT-2 with
and without the ``transformer.`` prefix, Gemma 3, and the architectures added with the one
load path: Qwen 2 (Q/K/V biases), Mistral (sliding window on every layer), Phi-3 (fused
``qkv_proj`` / ``gate_up_proj``, partial RoPE). Modes: resident, streamed, ``quantize`` int8
and q4_0, and streamed + each quantization.

Checked, cell by cell: it loads; resident float32 logits equal transformers' (its default
SDPA attention, the reference) within 1e-5 plus float32 rounding at the logits' scale
(2e-6 x max |logit|), and are as close to transformers' float64 logits as transformers'
own float32 ones (within 2x: two float32 rounding walks of the same sums). Our attention
sums keys in fixed float32 chunks (a row's result does not depend on its batch) and takes
its reductions and exp / cos / tanh in float64 (so compiled and eager steps agree);
transformers' SDPA blocks the keys another way. Measured: 5e-6 to 4.2e-5 from
transformers' float32, whose own error against float64 is as large (tied Qwen 3, logits up
to 30: ours 4.7e-5 from float64, transformers' 5.2e-5).
Streamed logits equal
resident ones bitwise; streamed + quantized equal resident + quantized bitwise. GGUF files
of every architecture and several quant types: streamed equal resident bitwise (their
parity with transformers is `test_gguf_models`).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_gguf import write_gguf_files

import infer
from infer.testing import build_tokenizer, tiny_hf_model

pytestmark = pytest.mark.slow

IDS = torch.randint(0, 260, (2, 20), generator=torch.Generator().manual_seed(0))
PARITY = 1e-5  # absolute, plus RELATIVE x max |logit| (float32 rounding at the logits' scale)
RELATIVE = 2e-6  # ~16 float32 steps at the logits' scale

# layout -> (architecture, how the directory differs from `save_pretrained`'s)
LAYOUTS = {
    "plain": "llama",
    "sharded": "llama",
    "tied": "qwen3",
    "inv_freq": "llama",
    "gemma3": "gemma3",
    "multimodal_gemma3": "gemma3",
    "gpt2": "gpt2",
    "gpt2_bare": "gpt2",
    "qwen2": "qwen2",
    "mistral": "mistral",
    "phi3": "phi3",
}
MODES = ["resident", "streamed", "int8", "q4_0", "streamed+int8", "streamed+q4_0"]


def _rewrite(
    src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None = None
) -> Path:
    shutil.copytree(src, dst)
    for f in dst.glob("model*.safetensors*"):
        f.unlink()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """layout -> (checkpoint directory, the transformers model with the same weights)."""
    root = tmp_path_factory.mktemp("matrix")
    tokenizer = build_tokenizer(root / "tokenizer")
    models: dict[str, Any] = {}
    out: dict[str, tuple[Path, Any]] = {}
    for layout, arch in LAYOUTS.items():
        if arch not in models:
            models[arch] = tiny_hf_model(arch)
        model = models[arch]
        path = root / layout
        if layout in ("sharded",):
            model.save_pretrained(str(path), max_shard_size="40KB")
        else:
            model.save_pretrained(str(path))
        tokenizer.save_pretrained(str(path))
        if layout == "inv_freq":
            tensors = load_file(path / "model.safetensors")
            for i in range(model.config.num_hidden_layers):
                tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
            path = _rewrite(path, root / "inv_freq_stored", tensors)
        elif layout == "multimodal_gemma3":
            tensors = {
                ("language_model.model." + k.removeprefix("model.")) if k.startswith("model.") else k: v
                for k, v in load_file(path / "model.safetensors").items()
            }
            tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(8, 3, 2, 2)
            tensors["multi_modal_projector.mm_input_projection_weight"] = torch.zeros(8, 64)
            text = json.loads((path / "config.json").read_text())
            config = {"model_type": "gemma3", "text_config": text, "vision_config": {"hidden_size": 8}}
            path = _rewrite(path, root / "multimodal", tensors, config)
        elif layout == "gpt2_bare":
            tensors = {
                k.removeprefix("transformer."): v for k, v in load_file(path / "model.safetensors").items()
            }
            path = _rewrite(path, root / "gpt2_bare_names", tensors)
        out[layout] = (path, model)
    return out


def _streaming(quantized: bool) -> infer.StreamingConfig:
    return infer.StreamingConfig(
        memory_budget="256MB",
        max_resident_layers=0,
        layer_group_size=2,
        max_batch_size=2,
        max_context=64,
        resident_embeddings=None if quantized else False,  # quantized heads stay resident
    )


def _logits(path: Path, mode: str) -> torch.Tensor:
    quantize = mode.split("+")[-1] if mode.endswith(("int8", "q4_0")) else None
    streaming = _streaming(quantize is not None) if mode.startswith("streamed") else None
    llm = infer.load(path, dtype=torch.float32, quantize=quantize, streaming=streaming)
    with torch.inference_mode():
        logits: torch.Tensor = llm.model(IDS)
    return logits


_resident_cache: dict[tuple[str, str], torch.Tensor] = {}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cell(checkpoints: dict[str, tuple[Path, Any]], layout: str, mode: str) -> None:
    path, hf = checkpoints[layout]
    got = _logits(path, mode)
    assert got.shape == (*IDS.shape, hf.config.vocab_size) and torch.isfinite(got).all()
    if mode == "resident":
        hf.config._attn_implementation = "sdpa"
        with torch.no_grad():
            sdpa = hf(IDS).logits
            hf.config._attn_implementation = "eager"
            eager = hf(IDS).logits
            truth = copy.deepcopy(hf).double()(IDS).logits
        err, err_eager = (got - sdpa).abs().max().item(), (got - eager).abs().max().item()
        ours64 = (got.double() - truth).abs().max().item()
        theirs64 = (sdpa.double() - truth).abs().max().item()
        scale = sdpa.abs().max().item()
        print(
            f"{layout}: vs transformers sdpa {err:.2e}, eager {err_eager:.2e} (logits up to {scale:.1f}); "
            f"vs float64: ours {ours64:.2e}, transformers' float32 {theirs64:.2e}"
        )
        assert err <= PARITY + RELATIVE * scale
        assert ours64 <= max(PARITY, 2 * theirs64)  # two float32 rounding walks of the same sums
        _resident_cache[layout, "float"] = got
        return
    base = mode.removeprefix("streamed+") if "+" in mode else "resident" if mode == "streamed" else mode
    if mode.startswith("streamed"):
        key = base if base != "resident" else "float"
        want = _resident_cache.get((layout, key))
        if want is None:
            want = _logits(path, base)
        diff = (got - want).abs().max().item()
        print(f"{layout} {mode}: max |streamed - resident| {diff:.3g}")
        assert torch.equal(got, want)
    else:
        _resident_cache[layout, mode] = got
        agree = (got.argmax(-1) == _logits(path, "resident").argmax(-1)).float().mean().item()
        print(f"{layout} {mode}: top-1 agreement with float {agree:.2f}")


GGUF_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {},
    "gemma3": {"query_pre_attn_scalar": 32, "final_logit_softcapping": None},
    "gpt2": {},
    "qwen2": {},
    "mistral": {"sliding_window": None},
    "phi3": {},
}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    return write_gguf_files(tmp_path_factory.mktemp("matrix-gguf"), GGUF_OVERRIDES, ("F16", "Q8_0", "Q4_0"))


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", list(GGUF_OVERRIDES))
def test_gguf_streamed_equals_resident(
    gguf_files: dict[tuple[str, str], Path],
    arch: str,
    qtype: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = gguf_files[arch, qtype]
    resident = infer.load(path)
    streamed = infer.load(path, streaming=_streaming(quantized=True))
    with torch.inference_mode():
        want, got = resident.model(IDS), streamed.model(IDS)
    print(f"GGUF {arch} {qtype}: max |streamed - resident| {(got - want).abs().max().item():.3g}")
    assert torch.equal(got, want)
    assert streamed.streaming_stats.bytes_loaded > 0
