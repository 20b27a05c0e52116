"""GGUF metadata -> `ModelConfig`.

The ``{arch}.*`` keys every architecture shares are read here; what is particular to one is read
by its model file's `GGUFRules.metadata`. Every count and dimension is checked against the tensor
table before use (a file cannot make infer allocate more than its tensors imply), values too, with
errors naming the file and the key. No ``output.weight``: the head is tied to ``token_embd``.
See docs/gguf.md, "Metadata -> ModelConfig".
"""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING, Any

from infer.gguf.metadata import GGUFMetadata
from infer.loader.config import ModelConfig, config_from_dict

if TYPE_CHECKING:
    from infer.gguf.reader import GGUFFile
    from infer.models.arch import Architecture

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def gguf_architecture(gguf: GGUFFile) -> Architecture:
    """The `Architecture` whose GGUF rules accept the file's ``general.architecture``."""
    from infer.models import ARCHITECTURES

    name = gguf.architecture
    supported: list[str] = []
    for arch in ARCHITECTURES.values():
        if arch.gguf is None:
            continue
        if name in arch.gguf.architectures:
            return arch
        supported.extend(arch.gguf.architectures)
    raise ValueError(
        f"{gguf.path}: unsupported architecture {name!r} (metadata 'general.architecture'); "
        f"supported: {sorted(supported)}"
    )


def _check_blocks(gguf: GGUFFile, meta: GGUFMetadata, n_layers: int) -> None:
    """``block_count`` is the number of ``blk.N`` blocks the tensor table holds: 0 .. n-1, each present."""
    blocks = {int(m.group(1)) for name in gguf.tensors if (m := _BLOCK.match(name))}
    if len(blocks) != n_layers or (blocks and (min(blocks) != 0 or max(blocks) != n_layers - 1)):
        have = f"{len(blocks)} block(s) ({min(blocks)}..{max(blocks)})" if blocks else "no blocks"
        raise ValueError(
            f"{gguf.path}: metadata '{meta.full_key('block_count')}' = {n_layers}, "
            f"but the tensor table has {have}"
        )


def _special_ids(gguf: GGUFFile, vocab: int) -> dict[str, Any]:
    md = gguf.metadata
    out: dict[str, Any] = {}

    def token(key: str) -> int | None:
        value = md.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
            raise ValueError(
                f"{gguf.path}: metadata {key!r}: expected an integer token id in 0..{vocab - 1}, "
                f"found {gguf.describe(key)}"
            )
        return value

    bos = token("tokenizer.ggml.bos_token_id")
    if bos is not None:
        out["bos_token_id"] = bos
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = token(key)
        if value is not None and value not in eos:
            eos.append(value)
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    pad = token("tokenizer.ggml.padding_token_id")
    if pad is not None:
        out["pad_token_id"] = pad
    return out


def _rope_scaling(meta: GGUFMetadata) -> dict[str, Any] | None:
    kind = meta.opt_str("rope.scaling.type")
    if kind is None or kind == "none":
        return None
    factor = meta.opt_float("rope.scaling.factor")
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "factor": factor}
    raise ValueError(
        f"{meta.path}: unsupported RoPE scaling '{meta.full_key('rope.scaling.type')}' = {kind!r} "
        f"(factor {factor}); supported: none, linear"
    )


def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    """The `ModelConfig` a GGUF file's metadata describes (errors name the file and the key)."""
    arch = gguf_architecture(gguf)
    assert arch.gguf is not None
    meta = GGUFMetadata(gguf, gguf.architecture)
    embd = gguf.tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"{gguf.path}: missing required tensor 'token_embd.weight'")
    if len(embd.shape) != 2:
        raise ValueError(
            f"{gguf.path}: tensor 'token_embd.weight' has shape {list(embd.shape)}, expected 2-D"
        )
    vocab, embd_width = embd.shape
    hidden = meta.int("embedding_length")
    if hidden != embd_width:
        raise ValueError(
            f"{gguf.path}: metadata '{meta.full_key('embedding_length')}' = {hidden}, "
            f"but token_embd.weight has {embd_width} columns"
        )
    declared_vocab = meta.opt_int("vocab_size")
    if declared_vocab is not None and declared_vocab != vocab:
        raise ValueError(
            f"{gguf.path}: '{meta.full_key('vocab_size')}' = {declared_vocab} "
            f"but token_embd.weight has {vocab} rows"
        )
    n_layers = meta.int("block_count")
    _check_blocks(gguf, meta, n_layers)
    heads = meta.int("attention.head_count")
    kv_heads = meta.opt_int("attention.head_count_kv", heads)
    assert kv_heads is not None
    if heads % kv_heads:
        raise ValueError(
            f"{gguf.path}: '{meta.full_key('attention.head_count')}' = {heads} is not a multiple of "
            f"'{meta.full_key('attention.head_count_kv')}' = {kv_heads}"
        )
    key_len = meta.opt_int("attention.key_length")
    value_len = meta.opt_int("attention.value_length")
    if key_len is not None and value_len is not None and key_len != value_len:
        raise ValueError(
            f"{gguf.path}: '{meta.full_key('attention.key_length')}' = {key_len} differs from "
            f"'{meta.full_key('attention.value_length')}' = {value_len}; only equal lengths are supported"
        )
    if key_len is None and hidden % heads:
        raise ValueError(
            f"{gguf.path}: '{meta.full_key('embedding_length')}' = {hidden} is not divisible by "
            f"'{meta.full_key('attention.head_count')}' = {heads} (and no key_length is given)"
        )
    head_dim = key_len if key_len is not None else hidden // heads
    raw: dict[str, Any] = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": meta.opt_int("feed_forward_length", 4 * hidden),
        "vocab_size": vocab,
        "max_position_embeddings": meta.int("context_length"),
        "head_dim": head_dim,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "rms_norm_eps": meta.opt_float("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.opt_float("rope.freq_base"),
        "rope_scaling": _rope_scaling(meta),
        **_special_ids(gguf, vocab),
    }
    rope_dims = meta.opt_int("rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        if rope_dims > head_dim or rope_dims % 2:
            raise ValueError(
                f"{gguf.path}: '{meta.full_key('rope.dimension_count')}' = {rope_dims}, "
                f"expected an even number <= the head dimension {head_dim}"
            )
        raw["partial_rotary_factor"] = rope_dims / head_dim
    if arch.gguf.metadata is not None:
        raw.update(arch.gguf.metadata(meta))
    config = config_from_dict({k: v for k, v in raw.items() if v is not None}, source=str(gguf.path))
    config.extra["gguf"] = {
        "file_type": gguf.metadata.get("general.file_type"),
        "name": gguf.metadata.get("general.name"),
        "tensor_types": dict(Counter(t.type_name for t in gguf.tensors.values())),
    }
    return config


__all__ = ["GGUFMetadata", "config_from_gguf", "gguf_architecture"]
