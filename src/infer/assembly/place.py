"""The one step that fills a module of a model skeleton from stored tensors.

`place_module` reads a module's tensors, checks their shapes (and, with ``validate``, that they
are finite), undoes a converter's change (`Fix`), converts the dtype and puts the result in the
module: a float parameter, a linear quantized at load (``quantize``), or a packed GGUF matrix as a
`QuantizedLinear` / `QuantizedEmbedding`. With ``lazy``, float tensors needing only a dtype
conversion stay unread on the meta device, for a streamed model to read later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from infer.assembly.names import Entry
from infer.assembly.repack_cache import RepackCache
from infer.gguf.source import GGUFSource
from infer.host.pages import drop_mapped_pages
from infer.loader.source import Slice, WeightSource, read_tensor
from infer.models.arch import Fix, unpermute_rows
from infer.quant import QuantizedEmbedding, QuantizedLinear, dequantize
from infer.quant.convert import quantize_linear
from infer.quant.ggml import QType, block_size, scale_fields_finite, type_size

_CHECK_ELEMENTS = 1 << 16  # values checked for NaN / inf at a time


@dataclass(frozen=True)
class PlaceOptions:
    """How stored values become module values.

    ``dtype``: activations, norms, biases and float matrices. ``compute_dtype``: the
    matrix products of packed modules (GGUF files: bfloat16 by default). ``quantize``:
    quantize float linear layers at load. ``validate``: refuse non-finite weights.
    ``tie``: the head reuses the embedding. ``head``: False places no head (`StreamingConfig.head`;
    a tied packed embedding still reads its rows from the head's packed form). ``repack``: where
    converted GGUF matrices are looked up and kept (`infer.assembly.repack_cache`); None converts
    every time.
    """

    dtype: torch.dtype
    compute_dtype: torch.dtype
    quantize: str | None
    validate: bool
    tie: bool
    num_heads: int
    num_kv_heads: int
    repack: RepackCache | None = None
    head: bool = True


def _rows_fixed(entry: Entry, rows: torch.Tensor, opts: PlaceOptions) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation on anything indexed by output row (packed rows too)."""
    if entry.fix is Fix.PERMUTE_Q:
        return rows[unpermute_rows(rows.shape[0], opts.num_heads)]
    if entry.fix is Fix.PERMUTE_K:
        return rows[unpermute_rows(rows.shape[0], opts.num_kv_heads)]
    return rows


def _stored_shape(entry: Entry, shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[::-1] if entry.fix is Fix.TRANSPOSE else shape


def _stored_dim(entry: Entry, part: Slice) -> int:
    """The stored tensor's dimension a part slices (a transposed tensor's is the other one)."""
    return 1 - part.dim if entry.fix is Fix.TRANSPOSE else part.dim


def _check_shape(entry: Entry, expected: tuple[int, ...], source: str) -> None:
    """The stored tensor has the shape our parameter needs (its whole shape, for a rank's part)."""
    want = list(_stored_shape(entry, expected))
    if entry.part is not None:
        want[_stored_dim(entry, entry.part)] = entry.part.full
    if list(entry.stored.shape) != want:
        raise ValueError(
            f"{source}: tensor {entry.stored.name!r} has shape {list(entry.stored.shape)}, "
            f"expected {want} (for {entry.param!r})"
        )


def read_part(source: WeightSource, entry: Entry) -> torch.Tensor:
    """The stored tensor as stored (``uint8`` rows for a packed one), or only this rank's part of it.

    Rows come straight from the source; columns (a row-parallel matrix) are cut from rows
    read a chunk at a time, and for a packed tensor must fall on whole GGML blocks.
    """
    stored, part = entry.stored, entry.part
    if part is None:
        return read_tensor(source, stored.name)
    what = f"{source.description}: tensor {stored.name!r}"
    dim = _stored_dim(entry, part)
    if dim == 0:
        return torch.cat([read_tensor(source, stored.name, (a, b)) for a, b in part.ranges])
    if len(stored.shape) != 2:
        raise ValueError(f"{what}: cannot split the columns of a {len(stored.shape)}-D tensor")
    ranges = list(part.ranges)
    if stored.packed:
        assert stored.qtype is not None
        block, size = block_size(stored.qtype), type_size(stored.qtype)
        for a, b in ranges:
            if a % block or b % block:
                raise ValueError(
                    f"{what}: tensor parallelism splits its {stored.shape[1]} columns at {a}..{b}, "
                    "which does "
                    f"not fall on whole {stored.qtype.name} blocks of {block} values; choose another "
                    "tensor_parallel size"
                )
        ranges = [(a // block * size, b // block * size) for a, b in ranges]
    rows = stored.shape[0]
    width = sum(b - a for a, b in ranges)
    out = torch.empty(rows, width, dtype=torch.uint8 if stored.packed else stored.dtype)
    step = max(1, _CHECK_ELEMENTS * 16 // max(stored.row_bytes, 1))  # rows per chunk: ~1 MiB of them
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        chunk = read_tensor(source, stored.name, (start, stop))
        out[start:stop] = torch.cat([chunk[:, a:b] for a, b in ranges], dim=1)
    return out


def _part_shape(entry: Entry) -> tuple[int, ...]:
    """The stored shape of the part this rank reads (the whole shape without tensor parallelism)."""
    shape = list(entry.stored.shape)
    if entry.part is not None:
        shape[_stored_dim(entry, entry.part)] = entry.part.size
    return tuple(shape)


def check_finite(values: torch.Tensor, what: str) -> None:
    """Raise `ValueError` naming ``what`` if ``values`` holds NaN or inf.

    A chunk's sum is finite exactly when its values are (NaN and inf propagate), unless
    huge finite values overflow it: only then are the values themselves examined. The
    sum allocates nothing, so the check costs one read of the weights and no memory.
    """
    flat = values.reshape(-1)
    for start in range(0, flat.numel(), _CHECK_ELEMENTS):
        chunk = flat[start : start + _CHECK_ELEMENTS]
        if math.isfinite(float(chunk.sum())):
            continue
        bad = (~torch.isfinite(chunk)).nonzero()
        if bad.numel():
            index = start + int(bad[0, 0])
            raise ValueError(f"{what} holds a non-finite value ({float(flat[index])} at flat index {index})")


def float_values(source: WeightSource, entry: Entry, opts: PlaceOptions) -> torch.Tensor:
    """The tensor as our module holds it: dequantized if packed, changes undone, in ``opts.dtype``."""
    stored = entry.stored
    what = f"{source.description}: tensor {stored.name!r}"
    raw = read_part(source, entry)
    if stored.packed:
        assert stored.qtype is not None
        values = dequantize(raw, stored.qtype, _part_shape(entry), name=what)
    elif not stored.dtype.is_floating_point:
        raise ValueError(f"{what} has dtype {stored.dtype}, expected a floating-point tensor")
    else:
        values = raw
    values = _rows_fixed(entry, values, opts)
    if entry.fix is Fix.UNIT_OFFSET:
        values = values.float() - 1.0
    elif entry.fix is Fix.TRANSPOSE:
        values = values.t().contiguous()
    values = values.to(opts.dtype)
    if opts.validate:
        check_finite(values, what)
    return values


def _packed_linear(
    source: WeightSource, weight: Entry, bias: torch.Tensor | None, opts: PlaceOptions, head: bool
) -> QuantizedLinear:
    stored = weight.stored
    assert stored.qtype is not None
    what = f"{source.description}: tensor {stored.name!r}"

    def raw() -> torch.Tensor:
        return _rows_fixed(weight, read_part(source, weight), opts)

    if opts.repack is not None and weight.part is None:
        n, k = _part_shape(weight)
        linear = opts.repack.linear(
            stored.name, raw, QType(stored.qtype), (n, k), bias, what=what, exact_rescoring=head
        )
    else:
        linear = QuantizedLinear.from_gguf(
            raw(),
            stored.qtype,
            _part_shape(weight),
            bias,
            name=what,
            compute_dtype=opts.compute_dtype,
            exact_rescoring=head,
        )
    repack = opts.repack if weight.part is None else None
    if opts.validate and not (repack is not None and repack.known_finite(stored.name)):
        for name, buf in linear.named_buffers():
            if buf.is_floating_point():
                check_finite(buf, f"{what} ({name} of its packed form)")
        if repack is not None:
            repack.mark_finite(stored.name)
    return linear


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_name, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def assign_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace parameter (or buffer) ``name`` of ``model`` by ``tensor`` (no gradient)."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if isinstance(getattr(module, attr), nn.Parameter):
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
    else:
        setattr(module, attr, tensor)


def place_module(
    model: nn.Module,
    path: str,
    entries: dict[str, Entry],
    source: WeightSource,
    opts: PlaceOptions,
    *,
    lazy: bool = False,
) -> list[Entry]:
    """Fill module ``path`` of ``model`` from ``entries`` (``"weight"`` / ``"bias"`` -> `Entry`).

    Returns the entries left unread (``lazy``): parameters that stay on the meta device.
    """
    module = model.get_submodule(path)
    desc = source.description
    weight = entries.get("weight")
    if weight is None:
        orphan = next(iter(entries.values()))
        raise ValueError(f"{desc}: tensor {orphan.stored.name!r} has no matching weight tensor")
    head = path == "lm_head"

    if weight.stored.packed and isinstance(module, nn.Linear):
        _check_shape(weight, (module.out_features, module.in_features), desc)
        bias = _bias(module, entries, source, opts)
        _set(model, path, _packed_linear(source, weight, bias, opts, head))
        return []
    if weight.stored.packed and isinstance(module, nn.Embedding):
        shape = (module.num_embeddings, module.embedding_dim)
        _check_shape(weight, shape, desc)
        if path == "embed_tokens" and opts.tie:
            # One packed copy serves both: the head, and the lookup reading the head's rows.
            # Without a head the embedding owns it: its rows are bitwise the resident lookup's.
            packed = _packed_linear(source, weight, None, opts, head=True)
            if opts.head:
                _set(model, "lm_head", packed)
            _set(model, path, QuantizedEmbedding.from_linear(packed, dtype=opts.dtype, owned=not opts.head))
            return []
        stored = weight.stored
        assert stored.qtype is not None
        what = f"{desc}: tensor {stored.name!r}"
        # Kept as stored: mapped from the file where it can be (rows become resident as looked up).
        if isinstance(source, GGUFSource) and weight.part is None and weight.fix is None:
            stored_rows = source.mapped(stored.name)
        else:
            stored_rows = read_part(source, weight)
        embedding = QuantizedEmbedding.from_gguf(
            stored_rows, stored.qtype, _part_shape(weight), name=what, dtype=opts.dtype
        )
        raw = embedding.raw
        finite = opts.validate and raw is not None and scale_fields_finite(raw, stored.qtype)
        if finite and raw is not None:
            drop_mapped_pages([raw])  # the check read a few bytes of every page: not needed resident
        if opts.validate and not finite:
            for start in range(0, embedding.num_embeddings, 4096):  # finds and names the bad row
                ids = torch.arange(start, min(start + 4096, embedding.num_embeddings))
                check_finite(embedding(ids), what)
        _set(model, path, embedding)
        return []

    deferred: list[Entry] = []
    to_quantize = opts.quantize is not None and isinstance(module, nn.Linear)
    for attr, entry in entries.items():
        param = getattr(module, attr, None)
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"{desc}: unexpected tensor {entry.stored.name!r}: {path!r} has no {attr}")
        _check_shape(entry, tuple(param.shape), desc)
        if lazy and entry.fix is None and entry.part is None and not entry.stored.packed and not to_quantize:
            deferred.append(entry)
            continue
        assign_parameter(model, f"{path}.{attr}", float_values(source, entry, opts))
    if to_quantize and isinstance(module, nn.Linear):
        assert opts.quantize is not None
        _set(model, path, quantize_linear(module, opts.quantize, head=head))
    return deferred


def _bias(
    module: nn.Module, entries: dict[str, Entry], source: WeightSource, opts: PlaceOptions
) -> torch.Tensor | None:
    entry = entries.get("bias")
    if entry is None:
        return None
    expected = getattr(module, "bias", None)
    if not isinstance(expected, torch.Tensor):
        raise ValueError(
            f"{source.description}: unexpected tensor {entry.stored.name!r}: the module has no bias"
        )
    _check_shape(entry, tuple(expected.shape), source.description)
    return float_values(source, entry, opts)


def tied_head(model: nn.Module, opts: PlaceOptions) -> None:
    """After the embedding is placed: a tied float head reuses it, or gets its own quantized copy."""
    embed = model.get_submodule("embed_tokens")
    if not isinstance(embed, nn.Embedding):
        return  # a packed embedding already set the head
    if opts.quantize is not None:
        linear = nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False, device="meta")
        linear.weight = embed.weight  # quantized from the embedding; the embedding stays float
        _set(model, "lm_head", quantize_linear(linear, opts.quantize, head=True))
    else:
        head = model.get_submodule("lm_head")
        if isinstance(head, nn.Linear):
            head.weight = embed.weight  # the very same Parameter


__all__ = [
    "PlaceOptions",
    "assign_parameter",
    "check_finite",
    "place_module",
    "tied_head",
]
