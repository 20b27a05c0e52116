"""Tiny checkpoints built with transformers' own classes, for tests and benchmarks.

Nothing here downloads anything: `build_checkpoint` makes a small model of an architecture (one
entry of `TINY`, keeping what distinguishes it), perturbs every parameter, keeps tied-embedding
models from repeating their input (`untangle_tied_embeddings_`) and saves it with a small
byte-level tokenizer. What each tiny config keeps: docs/architecture.md, "How to add an
architecture".
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = ("llama", "qwen3", "gemma3", "gpt2", "qwen2", "mistral", "phi3")

SPECIAL_TOKENS = ["<|begin|>", "<|end|>", "<|eot|>", "<|pad|>", "<|user|>", "<|assistant|>"]
BOS, EOS, EOT, PAD = 256, 257, 258, 259  # ids of the first four special tokens
TOKENIZER_VOCAB = 256 + len(SPECIAL_TOKENS)
VOCAB_SIZE = 272  # model vocab, a little larger than the tokenizer's (as in real checkpoints)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{% else %}<|assistant|>{% endif %}"
    "{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SLIDING_WINDOW = 8

# SmolLM2-135M's dimensions (llama architecture), for benchmarks on random weights:
# `build_checkpoint(path, "llama", **SMOLLM2_SHAPE)`.
SMOLLM2_SHAPE: dict[str, Any] = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)


# Fields every tiny config shares (GPT-2 names its fields differently: it takes none of them),
# then what each architecture's tiny model changes.
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=BOS, eos_token_id=[EOS, EOT],
    pad_token_id=PAD, num_hidden_layers=3, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)  # fmt: skip
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
_GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
_SLIDING, _FULL = "sliding_attention", "full_attention"

# arch -> (transformers config class, model class, the fields of its tiny model)
TINY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        _COMMON
        | {
            "rope_parameters": _LLAMA3_ROPE
            | {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        },
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        _COMMON | dict(head_dim=24, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        _COMMON
        | dict(num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24, rms_norm_eps=1e-6)
        | dict(sliding_window=SLIDING_WINDOW, layer_types=[_SLIDING, _FULL, _SLIDING, _FULL])
        | dict(tie_word_embeddings=True, final_logit_softcapping=30.0, rope_parameters=_GEMMA3_ROPE),
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            vocab_size=VOCAB_SIZE,
            n_embd=64,
            n_layer=3,
            n_head=4,
            n_positions=256,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _COMMON | dict(rms_norm_eps=1e-6, use_sliding_window=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", _COMMON | dict(sliding_window=SLIDING_WINDOW)),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        _COMMON
        | dict(sliding_window=SLIDING_WINDOW)
        | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    ),
}
assert tuple(TINY) == ARCHITECTURES


def _tiny(arch: str) -> tuple[str, str, dict[str, Any]]:
    try:
        return TINY[arch]
    except KeyError:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES}") from None


def tiny_hf_config(arch: str, **overrides: Any) -> Any:
    """A transformers config object for a tiny model of ``arch`` (one of `ARCHITECTURES`)."""
    import transformers

    config_class, _, fields = _tiny(arch)
    return getattr(transformers, config_class)(**{**copy.deepcopy(fields), **overrides})


def tiny_hf_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    """A perturbed transformers model (float32, eval mode) of a tiny ``arch`` config."""
    import transformers

    model_class = getattr(transformers, _tiny(arch)[1])
    config = tiny_hf_config(arch, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    perturb_(model, seed)
    if config.tie_word_embeddings:
        untangle_tied_embeddings_(model, arch)
    return model


# How much a tied embedding is shrunk (see `untangle_tied_embeddings_`); others: 0.3.
TIED_EMBEDDING_SCALE = {"gemma3": 0.1, "gpt2": 0.1}
GEMMA3_POST_NORM_GAIN = 3.0  # added to Gemma 3's post-attention / post-feedforward norm weights


def untangle_tied_embeddings_(model: torch.nn.Module, arch: str) -> None:
    """Keep a random model with tied embeddings from predicting its own input.

    A tied head scores the input's own embedding at ``|e|^2 = hidden_size`` against about
    ``+-sqrt(hidden_size)`` for another token, so greedy decoding repeats the input (and hides
    norm bugs). The shared matrix is shrunk and the final norm scaled back up by the same factor;
    Gemma 3's post-norms are raised too (its sandwich norms cap each layer's output).
    """
    scale = TIED_EMBEDDING_SCALE.get(arch, 0.3)
    if arch == "gpt2":  # transformer.wte, and a LayerNorm (weight and bias) as the final norm
        stack: Any = model.transformer
        with torch.no_grad():
            stack.wte.weight.mul_(scale)
            stack.ln_f.weight.div_(scale)
            stack.ln_f.bias.div_(scale)
        return
    inner: Any = model.model  # transformers' decoder stack
    with torch.no_grad():
        inner.embed_tokens.weight.mul_(scale)
        norm = inner.norm.weight
        if arch == "gemma3":  # Gemma's RMSNorm multiplies by (1 + w)
            norm.copy_((1 + norm) / scale - 1)
            for layer in inner.layers:
                layer.post_attention_layernorm.weight.add_(GEMMA3_POST_NORM_GAIN)
                layer.post_feedforward_layernorm.weight.add_(GEMMA3_POST_NORM_GAIN)
        else:
            norm.div_(scale)


def perturb_(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every parameter random values at scales that make logits decisive."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() == 1:  # norm weights (and biases): move away from 1 / 0
                p.add_(0.2 * noise.to(p.dtype))
            elif "embed" in name or "wte" in name or "wpe" in name:
                p.copy_(noise.to(p.dtype))
            else:
                p.copy_((noise * (1.5 / p.shape[-1] ** 0.5)).to(p.dtype))


def build_tokenizer(path: str | Path) -> Any:
    """Save a byte-level BPE fast tokenizer (256 byte tokens + specials) into ``path``."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(SPECIAL_TOKENS)
    raw.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A", pair="<|begin|> $A <|begin|> $B", special_tokens=[("<|begin|>", BOS)]
    )
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw,
        bos_token="<|begin|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    return tok


def build_checkpoint(
    path: str | Path,
    arch: str,
    *,
    sharded: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a tiny ``arch`` checkpoint (config, safetensors, tokenizer) to ``path``; return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_hf_model(arch, seed=seed, **overrides).to(dtype)
    kwargs: dict[str, Any] = {"max_shard_size": "40KB"} if sharded else {}
    model.save_pretrained(str(path), **kwargs)
    build_tokenizer(path)
    gen_config = {"bos_token_id": BOS, "eos_token_id": [EOS, EOT], "pad_token_id": PAD}
    (path / "generation_config.json").write_text(json.dumps(gen_config))
    return path


def reference_sampling_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> Any:
    """The distribution sampling should draw from, in float64 numpy, written from the definitions.

    ``softmax(logits / temperature)`` over the ``top_k`` largest (0: all), then only the
    most likely tokens until their probability reaches ``top_p`` (the first always),
    renormalized. For tests of `infer.sampling` (`sample`, `probabilities`); independent of its code.
    """
    import numpy as np

    z = np.asarray(logits, dtype=np.float64) / temperature
    keep = np.ones(len(z), dtype=bool)
    if top_k:
        kth = np.sort(z)[::-1][min(top_k, len(z)) - 1]
        keep &= z >= kth
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        kept_p = np.zeros_like(p)
        total = 0.0
        for i in np.argsort(-p, kind="stable"):
            if p[i] == 0.0 or total >= top_p:
                break
            kept_p[i] = p[i]
            total += p[i]
        p = kept_p / kept_p.sum()
    return p


def random_gguf(qtype: Any, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random GGUF bytes of type ``qtype`` for a ``[rows, cols]`` weight: ``[rows, row bytes]`` uint8,
    every fp16 scale field small and finite (MXFP4: shared exponents near 1)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from infer.quant.ggml import FP16_FIELDS

    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in FP16_FIELDS.get(qtype, ()):
        scales = (rng.standard_normal(n) * 0.01).astype(np.float16)
        raw[:, off : off + 2] = scales.view(np.uint8).reshape(n, 2)
    if qtype == GGMLQuantizationType.MXFP4:
        raw[:, 0] = rng.integers(118, 124, size=n)
    return torch.from_numpy(raw.reshape(rows, -1))
