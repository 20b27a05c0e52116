"""Build a model from a safetensors checkpoint, tensor by tensor, with strict checking.

The model skeleton is created on the meta device (no memory), then every parameter
is read from the checkpoint's memory map, converted to the target dtype and placed
on the device one tensor at a time: peak memory is the model plus one tensor.
Every checkpoint tensor must map to a parameter and every parameter must be filled;
shapes must match. Errors name the tensor, the file, and what was expected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from infer.loader.config import ModelConfig
from infer.loader.weight_map import get_weight_map, map_checkpoint_names
from infer.loader.weights import INDEX_FILE, SafetensorsCheckpoint

ProgressFn = Callable[[int, int], None]  # (tensors done, tensors total)


def build_empty(config: ModelConfig, model_cls: Callable[[ModelConfig], nn.Module]) -> nn.Module:
    """The model with every parameter on the meta device (buffers such as RoPE on CPU)."""
    with torch.device("meta"):
        model = model_cls(config)
    # Non-persistent buffers (RoPE inverse frequencies) are computed, not loaded: recompute on CPU.
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    for name, buf in model.named_buffers():
        if buf.is_meta:
            raise RuntimeError(f"buffer {name!r} was created on the meta device and has no reset_buffers()")
    return model


def _tied_names(model: nn.Module) -> dict[str, str]:
    """Parameter names that alias another parameter (e.g. a tied lm_head) -> the name they alias."""
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases[name] = seen[id(p)]
        else:
            seen[id(p)] = name
    return aliases


def assign_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    old = getattr(module, attr)
    if isinstance(old, nn.Parameter):
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
    else:
        setattr(module, attr, tensor)


def load_into(
    model: nn.Module,
    tensors: Iterable[tuple[str, str, Callable[[], torch.Tensor]]],
    *,
    source: str,
    dtype: torch.dtype | None,
    device: torch.device | str,
    progress: ProgressFn | None = None,
    total: int | None = None,
    on_loaded: Callable[[str], None] | None = None,
) -> None:
    """Fill ``model``'s parameters from ``(hf_name, internal_name, read)`` triples, strictly.

    Tied aliases are re-pointed at their source after loading.
    """
    aliases = _tied_names(model)
    expected = {name: p for name, p in model.named_parameters() if name not in aliases}
    loaded: set[str] = set()
    done = 0
    for hf_name, name, read in tensors:
        if name in aliases:
            continue  # e.g. lm_head.weight stored although embeddings are tied: the model reuses embed
        param = expected.get(name)
        if param is None:
            raise ValueError(f"{source}: unexpected tensor {hf_name!r} (no parameter {name!r} in the model)")
        tensor = read()
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"{source}: tensor {hf_name!r} has shape {list(tensor.shape)}, expected {list(param.shape)}"
            )
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        assign_parameter(model, name, tensor.to(device))
        loaded.add(name)
        if on_loaded is not None:
            on_loaded(name)
        done += 1
        if progress is not None:
            progress(done, total if total is not None else len(expected))
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"{source}: missing tensor(s) for {missing}")
    # Re-tie: the alias must be the very same Parameter object as its source.
    for alias, target in aliases.items():
        src = model.get_parameter(target)
        module_name, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(module_name), attr, src)


def load_safetensors_model(
    path: str | Path,
    config: ModelConfig,
    model_cls: Callable[[ModelConfig], nn.Module],
    *,
    dtype: torch.dtype | None,
    device: torch.device | str,
    progress: ProgressFn | None = None,
    quantize: str | None = None,
) -> nn.Module:
    """Build ``model_cls(config)`` from the safetensors checkpoint at ``path``.

    With ``quantize`` ("q4_0" or "int8") every linear layer of the blocks and the
    head is quantized as soon as its tensors are in, so at most one float matrix
    exists beside the packed ones; norms and the embedding stay float, and a tied
    head gets its own quantized copy of the embedding.
    """
    ckpt = SafetensorsCheckpoint(path)
    names = map_checkpoint_names(config, ckpt.keys(), str(ckpt.path))  # checkpoint name -> module name
    if not config.tie_word_embeddings and "lm_head.weight" not in names.values():
        where = ckpt.files[0] if len(ckpt.files) == 1 else ckpt.path / INDEX_FILE
        raise ValueError(
            f"{where}: no 'lm_head.weight' and tie_word_embeddings is false: the output head is missing"
        )
    model = build_empty(config, model_cls)
    order = {name: i for i, name in enumerate(get_weight_map(config).values())}
    ordered = sorted(names, key=lambda n: order[names[n]])  # layer by layer, so quantization keeps up
    triples = [(n, names[n], (lambda n=n: ckpt.get(n))) for n in ordered]
    on_loaded = _quantizer(model, quantize) if quantize is not None else None
    load_into(
        model,
        triples,
        source=str(ckpt.path),
        dtype=dtype,
        device=device,
        progress=progress,
        on_loaded=on_loaded,
    )
    if quantize is not None and config.tie_word_embeddings:
        from infer.quant import quantize_linear

        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
        head.weight = model.get_parameter("embed_tokens.weight")
        model.lm_head = quantize_linear(head, quantize, head=True)
    model.to(device)  # buffers (RoPE frequencies)
    ckpt.close()
    return model.eval()


def _quantizer(model: nn.Module, scheme: str) -> Callable[[str], None]:
    """A callback that swaps each nn.Linear for its quantized version once all its tensors are loaded."""
    from infer.quant import quantize_linear

    tied = set(_tied_names(model))

    def on_loaded(name: str) -> None:
        module_name = name.rpartition(".")[0]
        if not module_name or module_name == "embed_tokens" or f"{module_name}.weight" in tied:
            return
        module = model.get_submodule(module_name)
        if not isinstance(module, nn.Linear) or any(p.is_meta for p in module.parameters()):
            return
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, quantize_linear(module, scheme, head=module_name == "lm_head"))

    return on_loaded
