"""How many prompt tokens one forward reads while no stream waits: measured per CPU and model shape.

A prompt read in chunks of ``C`` tokens pays once per chunk what a forward pays whatever its rows
(each packed weight dequantized, every kernel started), and each chunk's attention reads the keys
before it again, without the causal skipping of one pass; longer chunks cost more a token where
the activations outgrow the caches. Which wins depends on the CPU, so `measure` reads a
reference prompt (`REFERENCE` tokens, or the model's positions) through the first block in
chunks of each of `CANDIDATES`, and `choose` takes the shortest within `TOLERANCE` of the
fastest (less memory, the same time). One block is the model's per-layer cost (the layers share
their shapes): ~6 s on Qwen2.5-Coder-1.5B, once; the result is kept in the product-route table of
the CPU (`infer.quant.routes`, ``chunks``), keyed by the model's shape. Where nothing is measured
(``INFER_ROUTES=off``, a streamed, parallel or non-CPU model) the chunk is `DEFAULT`.
docs/engine.md, "Prompt chunks".
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time

import torch

from infer.kv.cache import KVCache
from infer.models.base import DecoderLM
from infer.models.hooks import scoped
from infer.quant import routes

CANDIDATES = (512, 1024, 2048, 4096)
REFERENCE = 4096  # the prompt measured (at most the model's positions)
DEFAULT = 2048  # where nothing is measured
TOLERANCE = 1.02  # the shortest chunk within this factor of the fastest time is taken


def measurable(model: DecoderLM, streamed: bool, parallel: bool) -> bool:
    """Whether the chunk is measured for ``model``: resident on the CPU, one process, routes on."""
    return not streamed and not parallel and model.device.type == "cpu" and routes.enabled()


def shape_key(model: DecoderLM) -> str:
    """What the measurement depends on besides the CPU: the config's shapes, the dtypes, and the
    first block's weights' forms (packed format, planes, ``K``)."""
    c = model.config
    forms = sorted(
        f"{name}:{m.route_form()}" if hasattr(m, "route_form") else f"{name}:{type(m).__name__}"
        for name, m in model.layers[0].named_modules()
        if hasattr(m, "in_features")
    )
    parts = [c.model_type, c.hidden_size, c.intermediate_size, c.num_attention_heads,
             c.num_key_value_heads, c.computed_head_dim, c.sliding_window, str(model.dtype),
             str(model.cache_dtype), forms]  # fmt: skip
    return "chunk-" + hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


class _Stop(Exception):
    """Raised before the second block: the measured forward is the first block's alone."""


def _block_seconds(model: DecoderLM, tokens: int, chunk: int, generator: torch.Generator) -> float:
    """``tokens`` fresh tokens through the embedding and the first block in chunks of ``chunk``,
    timed."""
    cache = KVCache(model.config, 1, tokens, dtype=model.cache_dtype, device=model.device, layers=[0],
                    rings=not model.deterministic)  # fmt: skip
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=generator, device=model.device)
    here = threading.get_ident()

    def ours() -> bool:  # (a forward on another thread runs on)
        return threading.get_ident() == here

    def stop(_module: torch.nn.Module, _args: object) -> None:
        if ours():
            raise _Stop

    handle = model.layers[1].register_forward_pre_hook(scoped(stop, ours)) if len(model.layers) > 1 else None
    try:
        t0 = time.perf_counter()
        for start in range(0, tokens, chunk):
            part = ids[:, start : start + chunk]
            try:
                model.forward_hidden(part, cache)
            except _Stop:  # the walk stopped before the second block: move the cache on as it would
                if cache.plan is not None:
                    cache.advance(cache.plan)
                cache.length += part.shape[1]
        return time.perf_counter() - t0
    finally:
        if handle is not None:
            handle.remove()


def measure(model: DecoderLM) -> dict[int, float]:
    """Milliseconds per token of a `REFERENCE`-token prompt through the first block, by chunk
    length (`CANDIDATES` up to the reference)."""
    g = torch.Generator().manual_seed(0)
    tokens = min(REFERENCE, model.config.max_position_embeddings)
    lengths = [n for n in CANDIDATES if n <= tokens] or [tokens]
    with torch.inference_mode():
        _block_seconds(model, lengths[0], lengths[0], g)  # warm: the products' routes are measured here
        return {n: 1e3 * _block_seconds(model, tokens, n, g) / tokens for n in lengths}


def choose(per_token: dict[int, float]) -> int:
    """The shortest chunk length within `TOLERANCE` of the fastest."""
    fastest = min(per_token.values())
    return min(n for n, ms in per_token.items() if ms <= TOLERANCE * fastest)


def prompt_chunk(model: DecoderLM) -> int:
    """The measured chunk length of ``model`` on this CPU (measured now if its shape is new here).
    While a forward hook acts on the model the shape is not measured (`DEFAULT`): the hook would
    see the measurement's random tokens."""
    key = shape_key(model)
    table = routes.table()
    found = table.chunks.get(key)
    if found is None and model.hooks.active():
        return DEFAULT
    if found is None:
        print(f"infer: measuring the prompt chunk length of this model on this CPU (once; "
              f"{routes.routes_dir()})", file=sys.stderr, flush=True)  # fmt: skip
        per_token = measure(model)
        times = {str(n): round(ms, 5) for n, ms in per_token.items()}
        found = {"chunk": choose(per_token), "ms_per_token": times}
        table.put_chunk(key, found)
    return int(found["chunk"])


__all__ = ["CANDIDATES", "DEFAULT", "REFERENCE", "TOLERANCE", "choose", "measurable", "measure",
           "prompt_chunk", "shape_key"]  # fmt: skip
