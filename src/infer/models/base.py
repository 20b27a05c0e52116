"""`DecoderLM`: embed -> N blocks -> final norm -> lm_head, shared by every architecture.

A model is walkable from outside: `prepare` computes what every layer of a step
needs (positions, RoPE tables and masks per layer type), `embed`, ``layers[i]`` and
`head` are the pieces. ``self.executor`` (an `Executor`, chosen at load) decides how
the whole walk runs — where the embedding rows come from, how the layers run, how the
vocabulary projection is computed: `ResidentExecutor` by default; layer streaming
(`infer.streaming`) and tensor / pipeline parallelism (`infer.distributed`) install
their own, so no model file knows about any of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from infer.host.pages import reusing_blocks
from infer.kv.cache import KVCache, StepKV, slot_mask
from infer.loader.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from infer.models.common import Attention, make_rotary_embeddings
from infer.models.hooks import HookWatch, calls_hooks
from infer.models.projections import Linear
from infer.models.record import record_forward
from infer.quant.head import fixed_order_dots
from infer.quant.linear import QuantizedLinear


@dataclass
class StepInputs:
    """Per-step inputs shared by the layers: the same for every layer of a type.

    All tensors, computed once per step by `DecoderLM.prepare`: a step reads nothing
    from the host, so the same code runs eagerly or compiled whole (`infer.execution`).
    """

    positions: torch.Tensor  # [B, T]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer type -> (cos, sin) [B, T, hd]
    masks: dict[str, torch.Tensor]  # layer type -> [B, 1, T, S] bool (True = attend)
    cache: KVCache | None
    shared_masks: dict[str, torch.Tensor] | None = None  # layer type -> [B, 1, T, R]: a shared prefix

    def rows(self, start: int, stop: int) -> StepInputs:
        """The inputs of rows ``[start, stop)`` alone (a pipeline micro-batch; the cache as a view)."""
        rows = slice(start, stop)
        return StepInputs(
            positions=self.positions[rows],
            rope={lt: (cos[rows], sin[rows]) for lt, (cos, sin) in self.rope.items()},
            masks={lt: m if m.shape[0] == 1 else m[rows] for lt, m in self.masks.items()},
            cache=self.cache.rows(start, stop) if self.cache is not None else None,
            shared_masks=None
            if self.shared_masks is None
            else {lt: m[rows] for lt, m in self.shared_masks.items()},
        )


@dataclass(frozen=True)
class ExecutorLimits:
    """The shapes an executor reserved memory for; generation stays inside them.

    ``max_batch_size x max_context`` cached tokens and ``max_batch_size x
    max_prefill_tokens`` tokens per forward (batches trade with length).
    """

    max_context: int
    max_batch_size: int
    max_prefill_tokens: int


class Executor(Protocol):
    """Runs one forward of a whole `DecoderLM`: the embedding, the layer stack and the head.

    `DecoderLM.embed`, `hidden` and `head` delegate to ``model.executor``, chosen at load:
    `ResidentExecutor` (everything on the device, in order), or a mode's implementation —
    layer streaming (`infer.streaming.StreamingExecutor`), tensor parallelism
    (`infer.distributed.TensorParallelExecutor`), pipeline parallelism
    (`infer.distributed.PipelineExecutor`) — which may wrap another executor (a pipeline
    stage around a tensor-parallel or streamed one). Every implementation runs a layer
    through `DecoderLM.run_layer` (the one KV-binding path), and leaves what is the
    architecture's to the model: `DecoderLM.embed_rows` after the token lookup, the final
    norm and `DecoderLM.cap_logits` around the vocabulary projection.

    ``limits`` is None when the executor takes any shape (resident layers); a streaming
    executor planned its memory for `ExecutorLimits` and generation respects them.
    ``stats``: the layer-streaming counters (`infer.streaming.StreamingStats`) of the
    layers it streams, also through a wrapping executor; None when nothing streams.
    ``shares_prefixes``: whether its attention may read one copy of a prefix that several rows
    share (`infer.kv.prefix`): the resident default only; the other modes copy it per row.
    """

    @property
    def limits(self) -> ExecutorLimits | None: ...

    @property
    def shares_prefixes(self) -> bool: ...

    @property
    def stats(self) -> Any: ...  # StreamingStats | None

    def embed(self, model: DecoderLM, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, T]`` -> the first layer's input ``[B, T, D]``."""
        ...

    def run_layers(self, model: DecoderLM, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """The layer stack on ``x [B, T, D]``: hidden states ``[B, T, D]`` before the final norm."""
        ...

    def head(self, model: DecoderLM, h: torch.Tensor, greedy: bool) -> torch.Tensor:
        """Final norm + vocabulary projection (+ soft-capping): ``[B, T, D] -> [B, T, V]``."""
        ...


class ResidentExecutor:
    """Everything on the device: the embedding table, the layers in order, the head.

    ``layers``: the layer indices this process runs (a pipeline stage's), None for all.
    The token lookup (`lookup`) and the vocabulary projection (`project`) are the parts a
    mode may replace (`infer.streaming.StreamingExecutor`,
    `infer.distributed.TensorParallelExecutor`); the architecture's parts around them stay.
    """

    layers: range | None = None
    shares_prefixes = True  # a mode built on this one sets False (`Executor.shares_prefixes`)

    def __init__(self, layers: range | None = None) -> None:
        self.layers = layers

    @property
    def limits(self) -> ExecutorLimits | None:
        return None

    @property
    def stats(self) -> Any:  # StreamingStats | None
        return None

    def embed(self, model: DecoderLM, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model.embed_rows(self.lookup(model, input_ids), positions)

    def run_layers(self, model: DecoderLM, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        if self.layers is None:
            for i, layer in enumerate(model.layers):
                x = model.run_layer(i, layer, x, step)
        else:
            for i in self.layers:
                x = model.run_layer(i, model.layers[i], x, step)
        return x

    def head(self, model: DecoderLM, h: torch.Tensor, greedy: bool) -> torch.Tensor:
        return model.cap_logits(self.project(model, model.norm(h), greedy))

    def lookup(self, model: DecoderLM, input_ids: torch.Tensor) -> torch.Tensor:
        """The token rows ``[B, T, D]`` of ``input_ids [B, T]``."""
        rows: torch.Tensor = model.embed_tokens(input_ids)
        return rows

    def project(self, model: DecoderLM, x: torch.Tensor, greedy: bool) -> torch.Tensor:
        """``lm_head``: normed ``x [..., D] -> [..., V]`` logits.

        ``greedy``: only each row's argmax must be exact (`QuantizedLinear.greedy`: a
        packed head may then scan fewer bytes); the other logits may be approximate. A head
        carrying a forward hook is called as a module, so the hook runs (`infer.models.hooks`).
        """
        lm_head = model.lm_head
        if (
            greedy
            and isinstance(lm_head, QuantizedLinear)
            and (torch.compiler.is_compiling() or not calls_hooks(lm_head))
        ):
            return lm_head.greedy(x)
        logits: torch.Tensor = lm_head(x)
        return logits


def _run_block(
    layer: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    mask: torch.Tensor,
    kv: StepKV | None,
) -> torch.Tensor:
    """One block, everything it reads passed in (``kv``: its K/V bound to the step, None without a
    cache; a pytree of tensors, so a compiled region takes them as inputs). Compiled, the blocks of
    a model form one region, traced and code-generated once per kind of layer and stamped out per
    layer (eagerly a plain call)."""
    out: torch.Tensor = layer(x, cos, sin, mask, kv)
    return out


# Compiled in-process (``torch.compile``), the blocks form one nested region: traced and
# code-generated once per kind of layer, which halves the compile. But a region's inputs cannot be
# written in place: its K/V writes become a copy of the layer's whole cache and back. An
# ahead-of-time build, compiled in the background where compile time costs the user nothing, turns
# regions off (`layer_regions`) so its K/V writes stay in place (docs/performance.md has both costs).
_run_block_region = torch.compiler.nested_compile_region(_run_block)
_REGIONS = [True]


@contextlib.contextmanager
def layer_regions(on: bool) -> Iterator[None]:
    """Within: whether compiled blocks form a nested compile region (the default) or are inlined."""
    before = _REGIONS[0]
    _REGIONS[0] = on
    try:
        yield
    finally:
        _REGIONS[0] = before


def _block_fn() -> Callable[..., torch.Tensor]:
    return _run_block_region if _REGIONS[0] else _run_block


def pad_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Left-padding counts ``[B]`` from a ``[B, T]`` 0/1 mask; only left padding is supported."""
    mask = attention_mask.to(torch.long)
    pad = (mask.cumsum(-1) == 0).sum(-1)  # leading zeros per row
    expected = torch.arange(mask.shape[1], device=mask.device)[None] >= pad[:, None]
    if not torch.equal(mask.bool(), expected):
        raise ValueError("attention_mask must be left padding: zeros first, then ones, in every row")
    return pad


def check_input_ids(input_ids: object, vocab_size: int | None = None) -> None:
    """`ValueError` unless ``input_ids`` is a ``[batch, length]`` tensor of integer token ids (in
    ``[0, vocab_size)`` when given: an embedding's lookup would wrap a negative id to the last rows,
    or fail on a packed row index that names nothing the caller sent)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids: expected a tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.ndim != 2 or 0 in input_ids.shape:
        raise ValueError(
            "input_ids: expected a 2-D tensor of token ids [batch, length] (both >= 1; "
            f"one prompt is ids[None]), got shape {tuple(input_ids.shape)}"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids: expected integer token ids, got {input_ids.dtype}")
    if vocab_size is not None:
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"input_ids: token id {lo if lo < 0 else hi} is out of range [0, {vocab_size})")


class DecoderLM(nn.Module):
    """A decoder-only causal LM. Subclasses set the block class and the norm flavour.

    Module names follow the HF checkpoint less its ``model.`` prefix:
    ``embed_tokens``, ``layers.{i}``, ``norm``, ``lm_head``.
    """

    block_class: type[nn.Module]  # the architecture's transformer block, built from a config
    embed_scale: float | None = None  # Gemma scales embeddings by sqrt(hidden_size)
    deterministic: bool = False  # `infer.models.projections.set_deterministic`: caches without rings
    kv_dtype: torch.dtype | None = None  # what KV caches hold (`cache_dtype`); None: the model's dtype

    def __init__(self, config: ModelConfig, layers: Sequence[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.config = config
        # An explicit (uninitialized) weight skips nn.Embedding's normal_() init: weights are
        # loaded anyway, and normal_ on the meta device costs ~1.6 s of imports per process.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = nn.ModuleDict(make_rotary_embeddings(config))
        self.layer_types = [config.layer_type(i) for i in range(config.num_hidden_layers)]
        self.executor: Executor = ResidentExecutor()
        self.kv_layers: range | None = None  # the layers whose K/V this process keeps (None: all)
        self.vocab_size = (
            config.vocab_size
        )  # the logits' width and the ids' range (a tensor-parallel shard's config has its slice)

    @property
    def hooks(self) -> HookWatch:
        """The forward hooks on this model's modules (`infer.models.hooks`; made on first use)."""
        watch = self.__dict__.get("_hook_watch")
        if watch is None:
            watch = self.__dict__["_hook_watch"] = HookWatch(self)
        assert isinstance(watch, HookWatch)
        return watch

    # ---- pieces of the walk -------------------------------------------------

    def _norm_weight(self) -> torch.Tensor:
        """The final norm's weight, whose dtype and device are the model's."""
        weight = self.norm.weight
        if not isinstance(weight, torch.Tensor):
            raise TypeError("the final norm has no weight tensor")
        return weight

    @property
    def dtype(self) -> torch.dtype:
        return self._norm_weight().dtype

    @property
    def device(self) -> torch.device:
        return self._norm_weight().device

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype of the K/V a cache holds: ``kv_dtype`` (set at load, `infer.load`'s ``kv_dtype``),
        else the model's; ``torch.int8`` is int8 values with a scale per token and head."""
        return self.kv_dtype if self.kv_dtype is not None else self.dtype

    @property
    def shares_prefixes(self) -> bool:
        """Whether this model's attention reads a prefix stored once for several rows
        (`infer.kv.prefix`: every attention an `infer.models.common.Attention`, the resident
        default mode); otherwise a prefix is copied into each row that continues it."""
        if self.deterministic or not self.executor.shares_prefixes or self.kv_layers is not None:
            return False
        attentions = [m for m in self.modules() if hasattr(m, "num_kv_heads") and hasattr(m, "o_proj")]
        return bool(attentions) and all(isinstance(m, Attention) for m in attentions)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first layer's input ``[B, T, D]`` for ``input_ids [B, T]`` (the executor's lookup)."""
        return self.executor.embed(self, input_ids, positions)

    def embed_rows(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The architecture's embedding of looked-up token ``rows [B, T, D]`` (Gemma: scaled)."""
        if self.embed_scale is not None:
            # Like transformers: the scale is rounded to the weight dtype before multiplying.
            rows = rows * torch.tensor(self.embed_scale, dtype=rows.dtype)
        return rows

    def prepare(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        n_new: torch.Tensor | None = None,
    ) -> StepInputs:
        """What every layer of a step shares. With a ``cache``, ``n_new [B]`` counts each row's
        real tokens (a right-padded batch; default: all ``T``)."""
        B, T = input_ids.shape
        device = input_ids.device
        masks: dict[str, torch.Tensor] = {}
        shared_masks: dict[str, torch.Tensor] | None = None
        if cache is not None:
            plan = cache.make_plan(T, n_new)
            cache.plan = plan
            positions = plan.positions
            for lt in set(self.layer_types):
                masks[lt] = cache.mask(lt, plan)
            if cache.shared is not None:
                shared_masks = {lt: cache.shared_mask(lt, plan) for lt in set(self.layer_types)}
        else:
            pad = (
                pad_from_attention_mask(attention_mask)
                if attention_mask is not None
                else torch.zeros(B, dtype=torch.long, device=device)
            )
            slots = torch.arange(T, device=device)
            positions = (slots[None] - pad[:, None]).clamp_min(0)
            for lt in set(self.layer_types):
                window = self.config.sliding_window if lt == SLIDING_ATTENTION else None
                masks[lt] = slot_mask(slots, slots, pad, window)
        rope = {lt: rot(positions, self.dtype) for lt, rot in self.rotary.items()}
        return StepInputs(positions=positions, rope=rope, masks=masks, cache=cache, shared_masks=shared_masks)

    def run_layer(self, index: int, layer: nn.Module, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """Layer ``index`` on ``x``, its K/V bound to the step's plan: the one KV-binding path.

        An architecture without RoPE (GPT-2: no ``rotary`` tables) gets ``cos = sin = None``.
        """
        lt = self.layer_types[index]
        cos, sin = step.rope.get(lt, (None, None))
        cache = step.cache
        if cache is None or cache.plan is None:
            out: torch.Tensor = _block_fn()(layer, x, cos, sin, step.masks[lt], None)
            return out
        held, plan = cache.layers[index], cache.plan
        # Keys past the slots in use are masked for every query: attention may skip them
        # (eagerly: a host int; compiled, shapes stay static).
        # Keys before a sliding window's first visible slot likewise (eagerly, when the caller
        # knows where the step starts: `KVCache.first`).
        key_limit = key_start = None
        if not (held.ring or torch.compiler.is_compiling()):
            key_limit = cache.length
            window = self.config.sliding_window
            if lt == SLIDING_ATTENTION and window is not None and cache.first is not None:
                key_start = max(0, cache.first - window + 1)
        shared_k = shared_v = shared_mask = None
        if cache.shared is not None and step.shared_masks is not None:
            shared_k, shared_v = cache.shared.kv(index)
            shared_mask = step.shared_masks[lt]
        kv = StepKV(
            held.k, held.v, held.ring, plan.slots, plan.n_new, plan.ring_write, plan.ring_src,
            key_limit, key_start, held.k_scale, held.v_scale, shared_k, shared_v, shared_mask,
        )  # fmt: skip
        out = _block_fn()(layer, x, cos, sin, step.masks[lt], kv)
        return out

    def head(self, h: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        """Final norm + lm_head (+ soft-capping): ``[B, T, D] -> [B, T, V]`` logits.

        ``greedy``: only each row's argmax must be exact (`ResidentExecutor.project`).
        """
        if torch.compiler.is_compiling():
            return self.executor.head(self, h, greedy)
        with reusing_blocks(h.shape[:-1].numel()):  # whole-sequence logits: large temporaries
            return self.executor.head(self, h, greedy)

    def exact_logits(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The exact logits ``[K]`` (float32) of tokens ``ids [K]`` for one row's hidden state ``h [D]``
        (before the final norm, as `infer.execution.model_step` returns it), without computing the
        rest of the vocabulary where the head can help (a packed head's rows, dequantized with their
        exact scales: `QuantizedLinear.exact_rows`). A token's logit is the same bits whichever
        ``ids`` it is computed with (`infer.quant.head.fixed_order_dots`; another head: the whole
        head's product, indexed), so a few candidates rank as they do in the whole vocabulary."""
        x = self.norm(h[None, None, :])[0, 0].float()  # [D]
        head = self.lm_head
        if (
            isinstance(head, QuantizedLinear)
            and hasattr(head, "scale_zero_residual")
            and not head.packed.is_meta
            and not calls_hooks(head)  # a hooked head runs as a module (`infer.models.hooks`)
        ):
            values = fixed_order_dots(head.exact_rows(ids), x)  # [K]
            if head.bias is not None:
                values = values + head.bias.float()[ids]
        else:
            values = self.executor.head(self, h[None, None, :], False)[0, 0].float()[ids]
            return values  # (the executor's head soft-caps already)
        return self.cap_logits(values)

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The architecture's final-logit soft-capping (Gemma), if its config has one."""
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- the walk -----------------------------------------------------------

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[B, T, D]`` after the last block (before the final norm).

        With a ``cache`` every row continues its cached sequence with all ``T`` tokens.
        Positions past ``max_position_embeddings`` are refused here, on the host.
        """
        check_input_ids(input_ids, self.vocab_size)
        T = input_ids.shape[1]
        limit = self.config.max_position_embeddings
        if cache is not None:
            cache.check(T)
            if cache.length + T > limit:
                raise ValueError(f"position {cache.length + T - 1} is past the model's {limit} positions")
        elif limit < T:
            raise ValueError(f"{T} tokens are more than the model's {limit} positions")
        x = self.hidden(input_ids, cache, attention_mask)
        if cache is not None:
            cache.length += T
        return x

    def hidden(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        n_new: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The walk itself, tensors only (no host bounds checks: `forward_hidden` and
        `infer.execution` do them): prepare, embed, the executor's layers, advance the cache. Eagerly,
        fused products whose parts carry forward hooks are unfused first (`HookWatch.honour`)."""
        if not torch.compiler.is_compiling():
            watch = self.hooks
            if watch.active():
                watch.honour()
        step = self.prepare(input_ids, cache, attention_mask, n_new)
        x = self.embed(input_ids, step.positions)
        if torch.compiler.is_compiling():
            x = self.executor.run_layers(self, x, step)
        else:
            with reusing_blocks(input_ids.numel()):  # a prompt's temporaries reuse freed blocks
                x = self.executor.run_layers(self, x, step)
        if cache is not None and cache.plan is not None:
            cache.advance(cache.plan)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> Any:  # torch.Tensor, or CausalLMOutput when more than logits is asked
        """Logits ``[B, T, vocab]`` for ``input_ids [B, T]``.

        With a ``cache`` the tokens continue the cached sequence; without one they are
        a whole sequence (``attention_mask [B, T]`` marks left padding).

        ``output_hidden_states`` / ``output_attentions`` (a whole sequence, no ``cache``): a
        `infer.models.record.CausalLMOutput` instead, with ``.logits``, ``.hidden_states`` and
        ``.attentions`` as transformers gives them (`infer.models.record.record_forward`).
        """
        if output_hidden_states or output_attentions:
            if cache is not None:
                raise ValueError(
                    "output_hidden_states / output_attentions run a whole sequence: pass no cache"
                )
            check_input_ids(input_ids, self.vocab_size)
            return record_forward(self, input_ids, attention_mask, output_hidden_states, output_attentions)
        return self.head(self.forward_hidden(input_ids, cache, attention_mask))

    def make_cache(self, batch_size: int, max_len: int, pad: torch.Tensor | None = None) -> KVCache:
        return KVCache(
            self.config,
            batch_size,
            max_len,
            dtype=self.cache_dtype,
            device=self.device,
            pad=pad,
            layers=self.kv_layers,
            rings=not self.deterministic,
        )


__all__ = [
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "DecoderLM",
    "Executor",
    "ExecutorLimits",
    "ResidentExecutor",
    "StepInputs",
]
