"""One builder for every checkpoint and every mode: a walk over the model's modules.

`ModelBuilder` maps a `WeightSource`'s names to our parameters (`infer.assembly.names`), checks
the config against them, builds the model on the meta device and fills it module by module
(`infer.assembly.place`). Where the filled modules go is a destination (`Build`): `load_model`
(resident: each module to the device as it is filled) or `infer.streaming.build_streamed`.
Every stored tensor must map to a parameter and every parameter be filled; errors name the
file, the tensor, the expected and the found value (docs/architecture.md, *One load path*).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from infer.assembly.names import Entry, check_dimensions, map_names, stored_name
from infer.assembly.options import LoadOptions, ProgressFn
from infer.assembly.place import PlaceOptions, place_module, tied_head
from infer.assembly.repack_cache import RepackCache
from infer.host.pages import release_freed_memory
from infer.loader.config import ModelConfig
from infer.loader.source import Slice, WeightSource, read_tensor
from infer.models import architecture
from infer.models.base import DecoderLM
from infer.models.common import RotaryEmbedding

NONLAYER = ("embed_tokens", "embed_positions", "norm", "lm_head")


def build_empty(config: ModelConfig) -> DecoderLM:
    """The model of ``config`` with every parameter and buffer on the meta device (no memory)."""
    cls = architecture(config.model_type, "config").model_class
    with torch.device("meta"):
        model = cls(config)
    if not isinstance(model, DecoderLM):
        raise TypeError(f"{cls!r} built a {type(model).__name__}, expected a DecoderLM")
    return model


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Parameter names that alias another parameter (a tied lm_head) -> the name they alias."""
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases[name] = seen[id(p)]
        else:
            seen[id(p)] = name
    return aliases


def reset_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Compute the non-persistent buffers (RoPE inverse frequencies) on ``device``.

    Done after the weights are placed, so a config whose sizes disagree with the
    weights has already failed a shape check before anything is computed from it.
    """
    rotary = model.get_submodule("rotary")
    for module in rotary.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()
    for name, buf in rotary.named_buffers():
        if buf.is_meta:
            raise RuntimeError(f"buffer {name!r} was created on the meta device and has no reset_buffers()")
    rotary.to(device)


def _check_types(entries: dict[str, Entry], source: str) -> None:
    """Every packed tensor is of a GGML type we can hold (checked before anything is read)."""
    from infer.quant.ggml import SUPPORTED

    for entry in entries.values():
        qtype = entry.stored.qtype
        if qtype is not None and qtype not in SUPPORTED:
            supported = sorted(t.name for t in SUPPORTED)
            raise ValueError(
                f"{source}: tensor {entry.stored.name!r} has unsupported quant type {qtype.name}; "
                f"supported: {supported}"
            )


COMPARE_BYTES = 64 << 20  # rows read at a time when a stored head is compared with the embedding


def _check_tied_head(entries: dict[str, Entry], source: WeightSource) -> None:
    """A tied model whose checkpoint also stores ``lm_head.weight``: it must hold the embedding.

    transformers ties such a head only when its values are the embedding's; a differing one it
    keeps, untied. infer takes the tie from config.json in every mode (streaming and parallel
    plans too), so a differing head is refused, naming it, rather than dropped. Equal ones (a
    redundant copy, common in real checkpoints) load tied; the comparison reads both tensors
    in row blocks of `COMPARE_BYTES`.
    """
    head, embed = entries.get("lm_head.weight"), entries.get("embed_tokens.weight")
    if head is None or embed is None:
        return
    h, e = head.stored, embed.stored
    same = h.shape == e.shape and h.dtype == e.dtype and h.qtype == e.qtype and head.fix == embed.fix
    step = max(1, COMPARE_BYTES // max(1, h.row_bytes))
    for start in range(0, h.rows, step) if same else ():
        rows = (start, min(h.rows, start + step))
        if not torch.equal(read_tensor(source, h.name, rows), read_tensor(source, e.name, rows)):
            same = False
            break
    if not same:
        raise ValueError(
            f"{source.description}: tensor {h.name!r} (the output head) differs from the embedding "
            f"{e.name!r}, but config.json says tie_word_embeddings: true; transformers would use the "
            "stored head, untied: set tie_word_embeddings to false to load it as transformers does"
        )


class Sharding(Protocol):
    """A rank's tensor-parallel share (`infer.distributed.shard.TensorParallel`), as its builder and
    `infer.distributed` read it: the config of its part, each parameter's slice, the row-parallel
    modules, its vocabulary rows, the rank count."""

    @property
    def local_config(self) -> ModelConfig: ...
    @property
    def vocab_range(self) -> tuple[int, int]: ...
    @property
    def size(self) -> int: ...
    def slice_for(self, param: str) -> Slice | None: ...
    def row_parallel(self, module: str) -> bool: ...


@dataclass(frozen=True)
class Partition:
    """The part of a model one rank of a parallel run builds and holds.

    ``layers``: its pipeline stage's layers. ``embed`` / ``head``: whether it holds the
    embedding (the first stage, and the last when the head is tied to it) and the final
    norm and head (the last stage). ``tensor_parallel``: its share of every layer
    (`infer.distributed.shard.TensorParallel`), or None.
    """

    layers: range
    embed: bool = True
    head: bool = True
    tensor_parallel: Sharding | None = None


class ModelBuilder:
    """A checkpoint mapped onto a model skeleton, ready to be placed module by module.

    ``layer_groups`` and ``nonlayer`` list the walk: one group per layer (its modules),
    and the modules outside the layers. ``place(group)`` fills them on the CPU. With a
    ``partition`` only its layers and modules are placed (the rest stay on the meta
    device), each tensor-parallel weight from its rank's part of the stored tensor.
    ``repack``: the on-disk cache of converted GGUF matrices (`infer.assembly.repack_cache`)
    that placement reads and fills. A destination (`Build`: `load_model`,
    `infer.streaming.build_streamed`) takes the builder and walks it.
    """

    def __init__(
        self,
        source: WeightSource,
        config: ModelConfig,
        options: LoadOptions,
        *,
        partition: Partition | None = None,
        repack: RepackCache | None = None,
    ) -> None:
        self.source = source
        self.config = config
        desc = source.description
        arch = architecture(config.model_type, desc)
        entries = map_names(source, config, arch)
        check_dimensions(entries, config, desc)
        if not config.tie_word_embeddings and "lm_head.weight" not in entries:
            raise ValueError(
                f"{desc}: no 'lm_head.weight' and tie_word_embeddings is false: the output head is missing"
            )
        if config.tie_word_embeddings:
            _check_tied_head(entries, source)
        tp = partition.tensor_parallel if partition is not None else None
        local = tp.local_config if tp is not None else config
        self.partition = partition
        self.model = build_empty(local)
        aliases = tied_aliases(self.model)
        params = {n for n, _ in self.model.named_parameters(remove_duplicate=False) if n not in aliases}
        owned = {n for n in params if self.owns(n)}
        missing = sorted(owned - set(entries))
        if missing:
            names = [stored_name(arch, source.naming, p) for p in missing[:10]]
            raise ValueError(f"{desc}: missing tensor(s) {names} (for parameters {missing[:10]})")
        _check_types(entries, desc)
        unexpected = sorted(entries[n].stored.name for n in set(entries) - params - set(aliases))
        if unexpected:
            raise ValueError(
                f"{desc}: unexpected tensor(s) for model_type {config.model_type!r}: {unexpected[:10]}"
            )
        if tp is not None:
            entries = {n: dataclasses.replace(e, part=tp.slice_for(n)) for n, e in entries.items()}
        self.options = options
        self.opts = PlaceOptions(
            dtype=options.dtype,
            compute_dtype=options.products_dtype,
            quantize=options.quantize,
            validate=options.validate,
            tie=config.tie_word_embeddings,
            num_heads=local.num_attention_heads,
            num_kv_heads=local.num_key_value_heads,
            repack=repack,
        )
        # module path -> {"weight": Entry, "bias": Entry}, in the model's order
        by_module: dict[str, dict[str, Entry]] = {}
        for name in (n for n, _ in self.model.named_parameters() if n in entries and n in owned):
            path, _, attr = name.rpartition(".")
            by_module.setdefault(path, {})[attr] = entries[name]
        self.modules = by_module
        self.layer_groups: list[list[str]] = [[] for _ in range(config.num_hidden_layers)]
        self.nonlayer: list[str] = []
        for path in by_module:
            parts = path.split(".")
            if parts[0] == "layers":
                self.layer_groups[int(parts[1])].append(path)
            else:
                self.nonlayer.append(path)
        # The head is placed after the embedding it may be tied to.
        self.nonlayer.sort(key=lambda p: NONLAYER.index(p) if p in NONLAYER else len(NONLAYER))

    def owns(self, param: str) -> bool:
        """Whether this rank holds parameter ``param`` (always, without a partition)."""
        p = self.partition
        if p is None:
            return True
        if param.startswith("layers."):
            return int(param.split(".", 2)[1]) in p.layers
        if param.startswith(("norm.", "lm_head.")):
            return p.head
        return p.embed

    @property
    def total(self) -> int:
        return len(self.modules)

    def place(self, paths: list[str], *, lazy: bool = False) -> list[Entry]:
        """Fill the modules ``paths`` (one group); returns the entries left on meta (``lazy``)."""
        deferred: list[Entry] = []
        for path in paths:
            deferred.extend(
                place_module(self.model, path, self.modules[path], self.source, self.opts, lazy=lazy)
            )
            if path == "embed_tokens" and self.opts.tie and self.opts.head:
                tied_head(self.model, self.opts)
        return deferred

    def check_complete(self) -> None:
        """Every parameter and buffer this rank holds has a value."""
        tensors = [*self.model.named_parameters(), *self.model.named_buffers()]
        meta = [n for n, t in tensors if t.is_meta and self.owns(n)]
        if meta:
            raise ValueError(f"{self.source.description}: missing tensor(s) for {meta[:10]}")


Build = Callable[[ModelBuilder], DecoderLM]  # a destination of the walk: `load_model`, `build_streamed`


def load_model(builder: ModelBuilder) -> DecoderLM:
    """The builder's model resident, every module on ``options.device`` (the builder's `LoadOptions`).

    ``options.quantize`` ("q4_0" / "int8") quantizes each float linear layer as soon as
    its tensors are in; ``options.validate`` refuses weights with NaN or inf;
    ``options.progress(done, total)`` is called per module. The builder's ``partition``:
    only the part one rank of a parallel run holds (`infer.distributed`); its ``repack``
    cache is written at the end when a matrix had to be converted.
    """
    config, options, repack = builder.config, builder.options, builder.opts.repack
    device, progress = options.device, options.progress
    model = builder.model
    done = 0
    # The embedding and head first: theirs are the largest temporaries (a packed head's
    # conversion), best paid while nothing else is held.
    for group in [builder.nonlayer, *builder.layer_groups]:
        builder.place(group)
        for path in group:
            model.get_submodule(path).to(device)
            done += 1
            if progress is not None:
                progress(done, builder.total)
    if (
        config.tie_word_embeddings
        and isinstance(model.lm_head, nn.Linear)
        and isinstance(model.embed_tokens, nn.Embedding)
    ):
        model.lm_head.weight = model.embed_tokens.weight  # re-tie after the moves: one Parameter
    reset_buffers(model, device)
    builder.check_complete()
    if repack is not None:
        repack.save(order=list(model.modules()))
    release_freed_memory()
    return model.eval()


__all__ = [
    "NONLAYER",
    "Build",
    "ModelBuilder",
    "Partition",
    "ProgressFn",
    "Sharding",
    "build_empty",
    "load_model",
    "release_freed_memory",
    "reset_buffers",
    "tied_aliases",
]
