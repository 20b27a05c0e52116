"""Checkpoint tensor names -> our parameter names, once, for both formats.

`map_names` applies the architecture's rules (`infer.models.arch.Architecture`) to every stored
tensor of a `WeightSource` (HF names through ``from_hf``, a multimodal checkpoint's language model
un-nested and its vision tower left out; llama.cpp's names through the GGUF tables), records what a
converter changed in each (`Fix`), and raises naming any tensor it cannot place.
`check_dimensions` holds the config's counts against the stored tensors before a model is built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from infer.loader.config import ModelConfig
from infer.loader.source import Slice, StoredTensor, WeightSource
from infer.models.arch import Architecture, Fix, fix_for

# Multimodal Gemma 3 checkpoints (4B and up) nest the language model: hub files name it
# ``language_model.model.*``, recent transformers ``model.language_model.*``. The vision
# tower and projector are not part of a text-only model.
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.", "language_model.": ""}
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")


@dataclass(frozen=True)
class Entry:
    """Where one of our parameters comes from: the stored tensor, what to undo in it, and
    (tensor parallelism) the part of it this rank holds."""

    param: str
    stored: StoredTensor
    fix: Fix | None
    part: Slice | None = None


def _hf(arch: Architecture, names: list[str]) -> tuple[dict[str, str], list[str]]:
    nested = any(n.startswith(p) for n in names for p in _TEXT_PREFIXES if p != "language_model.")
    mapping: dict[str, str] = {}
    unknown: list[str] = []
    for name in names:
        if any(p.search(name) for p in arch.hf_ignore):
            continue
        hf = name
        if nested:
            if name.startswith(_VISION_PREFIXES):
                continue
            for prefix, replacement in _TEXT_PREFIXES.items():
                if name.startswith(prefix):
                    hf = replacement + name[len(prefix) :]
                    break
        ours = arch.from_hf(hf)
        if ours is None:
            unknown.append(name)
        else:
            mapping[ours] = name
    return mapping, unknown


def _gguf(arch: Architecture, names: list[str]) -> tuple[dict[str, str], list[str]]:
    rules = arch.gguf
    assert rules is not None
    nonlayer = {
        f"{g}.{kind}": f"{ours}.{kind}" for g, ours in rules.nonlayer.items() for kind in ("weight", "bias")
    }
    mapping: dict[str, str] = {}
    unknown: list[str] = []
    for name in names:
        if name in rules.config_tensors:
            continue
        ours: str | None = nonlayer.get(name)
        m = _BLOCK.match(name)
        if ours is None and m is not None and m.group(2) in rules.layer:
            ours = f"layers.{m.group(1)}.{rules.layer[m.group(2)]}.{m.group(3)}"
        if ours is None:
            unknown.append(name)
        else:
            mapping[ours] = name
    return mapping, unknown


def map_names(source: WeightSource, config: ModelConfig, arch: Architecture) -> dict[str, Entry]:
    """Our parameter name -> `Entry` for every stored tensor the model uses; unknown names raise."""
    stored = source.tensors()
    names = list(stored)
    if source.naming == "gguf":
        if arch.gguf is None:
            raise ValueError(f"{source.description}: model_type {arch.model_type!r} has no GGUF rules")
        mapping, unknown = _gguf(arch, names)
        fixes = arch.gguf.fixes
        if unknown:
            arch_name = arch.gguf.architectures[0]
            raise ValueError(
                f"{source.description}: unknown tensor name(s) for architecture {arch_name!r}: "
                f"{sorted(unknown)[:10]}" + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
            )
    elif source.naming == "hf":
        mapping, unknown = _hf(arch, names)
        fixes = arch.hf_fixes
        if unknown:
            raise ValueError(
                f"{source.description}: unexpected tensor(s) for model_type {config.model_type!r}: "
                f"{sorted(unknown)[:10]}" + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
            )
    else:
        raise ValueError(
            f"{source.description}: unknown tensor naming {source.naming!r} (expected 'hf' or 'gguf')"
        )
    return {ours: Entry(ours, stored[name], fix_for(fixes, ours)) for ours, name in mapping.items()}


def stored_name(arch: Architecture, naming: str, param: str) -> str:
    """The name parameter ``param`` has in a checkpoint of ``naming`` ("hf" or "gguf"), for messages."""
    if naming != "gguf" or arch.gguf is None:
        return arch.to_hf(param)
    path, _, kind = param.rpartition(".")
    m = _LAYER.match(path + ".")
    if m is not None:
        inverse = {v: k for k, v in arch.gguf.layer.items()}
        inner = m.group(2).rstrip(".")
        return f"blk.{m.group(1)}.{inverse.get(inner, inner)}.{kind}"
    return f"{ {v: k for k, v in arch.gguf.nonlayer.items()}.get(path, path) }.{kind}"


def check_dimensions(entries: dict[str, Entry], config: ModelConfig, source: str) -> None:
    """The config's layer count and embedding size agree with the stored tensors.

    Checked before a model is built: a corrupt count (``num_hidden_layers`` of 2^31) must
    fail here, not after building billions of layers. Every other size is checked
    tensor by tensor when it is placed.
    """
    layers = {int(m.group(1)) for name in entries if (m := _LAYER.match(name))}
    n = config.num_hidden_layers
    if len(layers) != n or (layers and (min(layers) != 0 or max(layers) != n - 1)):
        have = f"{len(layers)} layer(s) ({min(layers)}..{max(layers)})" if layers else "no layers"
        missing = sorted(set(range(min(n, len(layers) + 5))) - layers)[:5]
        extra = sorted(layers - set(range(n)))[:5]
        detail = (f"; missing {missing}" if missing else "") + (f"; unexpected {extra}" if extra else "")
        raise ValueError(f"{source}: num_hidden_layers is {n}, but the checkpoint has {have}{detail}")
    embed = entries.get("embed_tokens.weight")
    if embed is None:
        raise ValueError(f"{source}: missing tensor for the embedding (embed_tokens.weight)")
    expected = (config.vocab_size, config.hidden_size)
    if tuple(embed.stored.shape) != expected:
        raise ValueError(
            f"{source}: tensor {embed.stored.name!r} has shape {list(embed.stored.shape)}, expected "
            f"{list(expected)} (vocab_size, hidden_size)"
        )


__all__ = ["Entry", "check_dimensions", "map_names", "stored_name"]
