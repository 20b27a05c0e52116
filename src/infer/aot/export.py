"""Export: `torch.export` of `infer.execution.model_step` for one decode shape, compiled into a package.

`build` exports the step of one rows kind and sampling mode on any KV capacity (dynamic), in the
engine's layout, and compiles it with AOTInductor. The weights are *inputs* (a package holds code
only); what it assumes of its inputs is recorded (`tensor_specs`) for `infer.aot.runtime.Package`
to check, and the file is moved into place atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.export import Dim

from infer.aot.keys import MULTI_ROWS, VERIFY_WIDTHS, all_modules_named, named_tensors, rows_kind, width_kind
from infer.execution import StepFeed, model_step
from infer.kv.cache import KVCache, round_up
from infer.models.base import DecoderLM, layer_regions
from infer.sampling import Sampling, SamplingValues


class _DecodeStep(nn.Module):
    """`model_step` for one decode shape with the cache's tensors and the sampling values as inputs."""

    def __init__(self, model: DecoderLM, template: KVCache, mode: Sampling) -> None:
        super().__init__()
        self.model = model
        self.template = template
        self.mode = mode

    def forward(
        self,
        ids: torch.Tensor,
        n_new: torch.Tensor,
        last: torch.Tensor,
        state: list[torch.Tensor],
        kv: list[torch.Tensor],
        sampling: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = _bind(self.template, state, kv)
        values = noise = None
        if sampling:
            values = SamplingValues(sampling[0], sampling[1], sampling[2])
            noise = sampling[3]
        return model_step(self.model, cache, StepFeed(ids, n_new, last, self.mode, values, noise))


def state_inputs(cache: KVCache) -> list[torch.Tensor]:
    return [cache.slot, cache.pad] + ([cache.ring_slots] if cache.ring_slots is not None else [])


def _bind(template: KVCache, state: list[torch.Tensor], kv: list[torch.Tensor]) -> KVCache:
    """A copy of ``template`` whose tensors are ``state`` and ``kv`` (the exported program's inputs)."""
    import copy

    cache = copy.copy(template)
    cache.slot, cache.pad = state[0], state[1]
    if template.ring_slots is not None:
        cache.ring_slots = state[2]
    layers = []
    for i, layer in enumerate(template.layers):
        bound = copy.copy(layer)
        bound.cache = cache
        n = len(layer.tensors())  # k, v (and an int8 cache's scales)
        bound.k, bound.v = kv[n * i], kv[n * i + 1]
        if n == 4:
            bound.k_scale, bound.v_scale = kv[n * i + 2], kv[n * i + 3]
        layers.append(bound)
    cache.layers = layers
    cache.length, cache.plan = 0, None
    return cache


def kv_inputs(cache: KVCache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in layer.tensors()]


def sampling_inputs_of(values: SamplingValues | None, noise: torch.Tensor | None) -> list[torch.Tensor]:
    if values is None or noise is None:
        return []
    return [values.temperature, values.top_k, values.top_p, noise]


def build(model: DecoderLM, batch: int, mode: Sampling, path: Path, width: int = 1) -> None:
    """Export and compile the step for ``batch`` rows of ``width`` tokens into ``path``: a decode
    step of one row, or of any count in `MULTI_ROWS` (a dynamic dimension); or (``mode.every_token``)
    the verify pass of one row of any of `VERIFY_WIDTHS` tokens (dynamic too); on any KV capacity
    (dynamic: the engine's rows grow as they need), in the engine's layout (slot order, no rings)."""
    kind, wide = rows_kind(batch), width_kind(batch, width, mode)
    if kind is None or wide is None:
        raise ValueError(
            f"build: no package serves steps of {batch} rows x {width} tokens (decode steps: 1, or "
            f"{MULTI_ROWS[0]}-{MULTI_ROWS[1]} rows of 1 token; verify passes: 1 row of "
            f"{VERIFY_WIDTHS[0]}-{VERIFY_WIDTHS[1]} tokens)"
        )
    multi, verify = kind != "1", bool(wide)
    example_rows, example_capacity = (4 if multi else 1), 256
    example_width = 4 if verify else 1
    cache = KVCache(model.config, example_rows, example_capacity, dtype=model.cache_dtype,
                    device=model.device, layers=model.kv_layers, rings=False)  # fmt: skip
    step = _DecodeStep(model, cache, mode)
    batch = example_rows

    class Functional(nn.Module):
        def forward(self, ids: Any, n_new: Any, last: Any, state: Any, kv: Any, sampling: Any, w: Any) -> Any:
            return torch.func.functional_call(step, w, (ids, n_new, last, state, kv, sampling), strict=False)

    device = model.device
    # A decode step feeds each row one token and samples it; a verify pass (one row) feeds W and
    # samples every one: ``last`` then holds the W flat positions, and the sampling inputs a row each.
    ids = torch.zeros(batch, example_width, dtype=torch.long, device=device)
    n_new = torch.full((batch,), example_width, dtype=torch.long, device=device)
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    last = torch.arange(example_width, device=device) if verify else zeros
    heads = last.shape[0]  # positions through the head
    sampling: list[torch.Tensor] = []
    if not mode.greedy:
        V = model.config.vocab_size
        sampling = [
            torch.ones(heads, device=device),
            torch.zeros(heads, dtype=torch.long, device=device),
            torch.ones(heads, device=device),
            torch.zeros(heads, V, device=device),
        ]
    inputs = (ids, n_new, last, state_inputs(cache), kv_inputs(cache), sampling)
    # Dynamic dimensions: the rows (a multi-row package), the tokens per row (a verify pass) and
    # every KV buffer's slots.
    rows = Dim("rows", min=MULTI_ROWS[0], max=MULTI_ROWS[1]) if multi else None
    tokens = Dim("width", min=VERIFY_WIDTHS[0], max=VERIFY_WIDTHS[1]) if verify else None
    slots = Dim("slots", min=2, max=max(example_capacity, round_up(model.config.max_position_embeddings, 64)))

    def dims(t: torch.Tensor, kv: bool = False, head: bool = False) -> dict[int, Any] | None:
        d: dict[int, Any] = {}
        if head and tokens is not None:  # one entry per position through the head
            d[0] = tokens
        elif rows is not None:
            d[0] = rows
        if kv and t.shape[2]:
            d[2] = slots
        return d or None

    def shapes(weights: dict[str, torch.Tensor]) -> tuple[Any, ...]:
        ids_dims = dims(ids) or {}
        if tokens is not None:
            ids_dims[1] = tokens
        return (ids_dims or None, dims(n_new), dims(last, head=True), [dims(t) for t in state_inputs(cache)],
                [dims(t, kv=True) for t in kv_inputs(cache)], [dims(t, head=True) for t in sampling],
                dict.fromkeys(weights))  # fmt: skip

    def export(weights: dict[str, torch.Tensor]) -> torch.export.ExportedProgram:
        # Blocks inlined, not a nested region: their K/V writes then stay in place (`layer_regions`).
        # Non-strict: traced by running the Python with fake tensors, not by dynamo (faster; the step
        # reads nothing from the host, so both give one program: docs/engine.md).
        with all_modules_named(step), torch.no_grad(), warnings.catch_warnings(), layer_regions(False):
            warnings.simplefilter("ignore", UserWarning)
            return torch.export.export(
                Functional(), (*inputs, weights), dynamic_shapes=shapes(weights), strict=False
            )

    # Every call hands each weight to the compiled code: only the ones the step reads. The first
    # export finds them (the fused products leave their parts' views unread), the second is built.
    weights = named_tensors(step)
    used = _used_weights(export(weights), len(torch.utils._pytree.tree_leaves(inputs)), list(weights))
    weights = {name: weights[name] for name in used}
    exported = export(weights)
    # A weight not passed would be baked into the code (small constants, a scale, are fine).
    lifted = [*exported.state_dict.items(), *exported.constants.items()]
    baked = [name for name, t in lifted if isinstance(t, torch.Tensor) and t.numel() > 64]
    if baked:
        raise RuntimeError(f"the exported step holds tensors of its own: {baked[:3]}")
    names = list(weights)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        package = Path(tmp) / "package.pt2"
        torch._inductor.aoti_compile_and_package(
            exported,
            package_path=str(package),
            inductor_configs={
                "aot_inductor.metadata": {
                    "names": json.dumps(names),
                    "inputs": json.dumps(
                        _input_specs(
                            [ids, n_new, last, *state_inputs(cache)], kv_inputs(cache), sampling, verify
                        )
                    ),
                    "rows": json.dumps([1, 1] if not multi else list(MULTI_ROWS)),
                    "widths": json.dumps(list(VERIFY_WIDTHS) if verify else [1, 1]),
                    "weights": json.dumps(tensor_specs(list(weights.values()))),
                }
            },
        )
        os.replace(package, path)


def _used_weights(exported: torch.export.ExportedProgram, n_inputs: int, names: list[str]) -> list[str]:
    """The weights (``names``, the user inputs after the ``n_inputs`` step inputs) the program reads."""
    user = torch.export.graph_signature.InputKind.USER_INPUT
    by_name = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    specs = [spec for spec in exported.graph_signature.input_specs if spec.kind == user]
    if len(specs) != n_inputs + len(names):
        expected = n_inputs + len(names)
        raise RuntimeError(f"the exported step has {len(specs)} inputs, expected {expected}")
    nodes = [by_name[spec.arg.name] for spec in specs[n_inputs:]]
    return [name for name, node in zip(names, nodes, strict=True) if node.users]


# ---- what a package assumes of its inputs ------------------------------------------------


def tensor_specs(tensors: list[torch.Tensor]) -> list[list[Any]]:
    """What compiled code assumes of its inputs: shape, strides, dtype, contiguity."""
    return [[list(t.shape), list(t.stride()), str(t.dtype).removeprefix("torch.")] for t in tensors]


def _input_specs(
    state: list[torch.Tensor], kv: list[torch.Tensor], sampling: list[torch.Tensor], verify: bool = False
) -> list[Any]:
    """What a package assumes of a step's inputs: each one's dtype and contiguity, its shape with
    -1 for the dynamic dimensions (the rows; a verify pass's tokens, in ``ids``; a KV buffer's slots)."""
    out = []
    ids_dynamic = (0, 1) if verify else (0,)
    groups = ((state[:1], ids_dynamic), (state[1:], (0,)), (kv, (0, 2)), (sampling, (0,)))
    for group, dynamic in groups:
        for t in group:
            shape = [-1 if i in dynamic else n for i, n in enumerate(t.shape)]
            out.append([shape, str(t.dtype).removeprefix("torch.")])
    return out
