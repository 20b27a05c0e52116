"""Memory planning (FR-005): what stays resident, what streams, and whether it fits the budget.

The plan adds up resident weights, the group buffers, the KV cache for ``max_batch_size x
max_context`` tokens and the workspace of one forward of ``max_prefill_tokens`` tokens, and keeps
resident what fits (the head or not, then layers ``0 .. r-1``, then the embedding), choosing the
layout that streams the fewest bytes per forward. Settings left at ``None`` are chosen
(`plan_memory`); only explicit ones can fail, with a `BudgetError` that says what would fit.
See docs/streaming.md, "How it works" (*Plan*).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from infer.host.rows import COLUMN_TILE
from infer.kv.cache import KVCache
from infer.loader.config import ModelConfig
from infer.models.base import ExecutorLimits
from infer.streaming.config import StreamingConfig, format_bytes
from infer.streaming.layout import Unit, align_up, head_units, layer_bytes, layer_unit
from infer.streaming.store import TensorRef

DEFAULT_MAX_CONTEXT = 4096
DEFAULT_MAX_PREFILL = 512
AUTO_GROUP_SIZES = (4, 2, 1)
WORKSPACE_SLACK = 4 * 2**20  # small temporaries (rope tables, masks of decode steps, allocator rounding)


class BudgetError(ValueError):
    """The streaming configuration cannot run within the memory budget."""


Limits = ExecutorLimits  # the shapes the plan reserves memory for


@dataclass
class MemoryPlan:
    """Where every byte goes. ``units``: the streaming schedule of one forward (groups, then head chunks)."""

    budget: int
    limits: Limits
    num_layers: int
    resident_layers: list[int]
    units: list[Unit]
    num_buffers: int
    buffer_bytes: int
    kv_bytes: int
    workspace_bytes: int
    small_bytes: int  # final norm, RoPE frequencies, the reader's conversion buffer
    resident_layer_bytes: int
    embed_resident: bool
    head_resident: bool
    embed_bytes: int  # resident embedding bytes (0 when streamed or shared with a resident tied head)
    head_bytes: int  # resident lm_head bytes (0 when streamed); packed: every module outside the layers
    layer_group_size: int = 1
    prefetch: bool = True
    head: bool = True  # False: no output head at all (`StreamingConfig.head`): activations only
    notes: list[str] = field(default_factory=list)

    @property
    def weight_bytes(self) -> int:
        """Weight bytes on the device: resident weights + buffers."""
        return (
            self.small_bytes
            + self.resident_layer_bytes
            + self.embed_bytes
            + self.head_bytes
            + self.num_buffers * self.buffer_bytes
        )

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.workspace_bytes

    @property
    def streamed_bytes_per_forward(self) -> int:
        return sum(u.nbytes for u in self.units)

    @property
    def layer_units(self) -> list[Unit]:
        return [u for u in self.units if u.group is not None]

    @property
    def head_unit_list(self) -> list[Unit]:
        return [u for u in self.units if u.group is None]

    def describe(self) -> str:
        """One line per component, for error messages and logs."""
        streamed = self.num_layers - len(self.resident_layers)
        parts = [
            f"resident layers: {len(self.resident_layers)} ({format_bytes(self.resident_layer_bytes)})",
            f"streamed layers: {streamed} in {len(self.layer_units)} group(s)",
            f"buffers: {self.num_buffers} x {format_bytes(self.buffer_bytes)} "
            f"(layer_group_size={self.layer_group_size}, prefetch={self.prefetch})",
            f"KV cache: {format_bytes(self.kv_bytes)} "
            f"({self.limits.max_batch_size} x {self.limits.max_context} tokens)",
            f"workspace: {format_bytes(self.workspace_bytes)} "
            f"({self.limits.max_prefill_tokens} tokens per forward)",
            f"embedding: {'resident' if self.embed_resident else 'rows read on demand'}"
            + (f" ({format_bytes(self.embed_bytes)})" if self.embed_bytes else "")
            + (f" ({format_bytes(self.head_bytes)})" if self.head_bytes and not self.head else ""),
            "lm_head: "
            + (
                "none (activations only)"
                if not self.head
                else "resident"
                if self.head_resident
                else f"streamed in {len(self.head_unit_list)} chunk(s)"
            )
            + (f" ({format_bytes(self.head_bytes)})" if self.head_bytes and self.head else ""),
            f"norms and buffers: {format_bytes(self.small_bytes)}",
            f"total: {format_bytes(self.total)} of {format_bytes(self.budget)}",
        ]
        return "; ".join(parts)


def workspace_bytes(
    config: ModelConfig, dtype: torch.dtype, batch: int, tokens: int, context: int, *, logits: bool = True
) -> int:
    """Peak activation memory of one forward of ``batch x tokens`` over ``context`` keys (an upper bound).

    Counts the residual stream and its float32 norm temporaries, the Q/K/V
    projections with their RoPE temporaries, materialized attention scores with a
    float32 softmax, the gated MLP's three intermediates, the masks, and (``logits``) the
    logits with their soft-capping temporaries.
    """
    e = torch.empty((), dtype=dtype).element_size()
    bt = batch * tokens
    d, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    hd, heads, kv = config.computed_head_dim, config.num_attention_heads, config.num_key_value_heads
    qkv = (heads + 2 * kv) * hd
    residual = bt * (6 * d * e + 3 * d * 4)  # x, normed x, attention/MLP outputs; float32 norm temporaries
    attention = bt * (4 * qkv * e + 2 * heads * hd * e)  # q/k/v, rotary temporaries, output + reshape
    scores = batch * heads * tokens * context * (3 * e + 2 * 4)  # scores, capped scores, float32 softmax
    ring = 2 * batch * kv * (context + tokens) * hd * e  # sliding-window layers concatenate old + new keys
    mlp = bt * 3 * inter * e
    masks = 4 * batch * tokens * context  # bool, per layer type, plus the GQA-repeated copy
    # logits, soft-capping temporaries, a float32 copy for sampling
    logits_bytes = bt * vocab * (3 * e + 4) if logits else 0
    rope = 2 * bt * hd * (2 * e + 3 * 4)
    return residual + attention + scores + ring + mlp + masks + logits_bytes + rope + WORKSPACE_SLACK


def default_context(config: ModelConfig) -> int:
    return min(config.max_position_embeddings, DEFAULT_MAX_CONTEXT)


@dataclass(frozen=True)
class PlanInputs:
    """What the plan needs to know about a model: its config and the bytes of every piece.

    ``layer_refs[i]``: layer ``i``'s tensors as streamed. ``embed`` / ``head``: the
    embedding and head when they may stream (float, read from the checkpoint), or None
    when they are always resident — their bytes then in ``fixed_nonlayer`` (packed or
    quantized modules) — or absent (no head: `StreamingConfig.head`). ``small_bytes``: everything
    else resident and small (the final norm, RoPE frequencies, the reader's conversion buffer,
    packed modules' workspace).
    """

    config: ModelConfig
    dtype: torch.dtype
    layer_refs: list[dict[str, TensorRef]]
    embed: TensorRef | None
    head: TensorRef | None
    small_bytes: int
    fixed_nonlayer: int | None = None
    description: str = "model"
    layer_indices: list[int] | None = None  # the model layers ``layer_refs`` are (a pipeline stage's)

    def layer(self, k: int) -> int:
        """The model's index of the ``k``-th planned layer."""
        return self.layer_indices[k] if self.layer_indices is not None else k


@dataclass(frozen=True)
class _Inputs:
    inputs: PlanInputs
    streaming: StreamingConfig


def _candidate(
    inp: _Inputs, limits: Limits, head_resident: bool, resident: int, group_size: int, prefetch: bool
) -> MemoryPlan:
    pi = inp.inputs
    n = len(pi.layer_refs)
    units: list[Unit] = []
    streamed = list(range(resident, n))
    for g, start in enumerate(range(0, len(streamed), group_size)):
        members = streamed[start : start + group_size]
        units.append(layer_unit(len(units), g, [(pi.layer(i), pi.layer_refs[i]) for i in members]))
    max_group = max((u.nbytes for u in units), default=0)
    has_head = inp.streaming.head
    if not head_resident:
        assert pi.head is not None
        row = pi.head.row_bytes()
        target = max_group if max_group else max(layer_bytes(r) for r in pi.layer_refs)
        rows = max(1, min(pi.head.shape[0], target // max(row, 1)))
        # Whole column tiles (`infer.host.rows.COLUMN_TILE`): a chunked head's logits are the resident head's.
        rows = min(pi.head.shape[0], max(COLUMN_TILE, rows // COLUMN_TILE * COLUMN_TILE))
        units.extend(head_units(len(units), pi.head, rows))
    buffer = max((u.nbytes for u in units), default=0)
    num_buffers = (2 if prefetch else 1) if units else 0
    # The engine's KV keeps every slot of sliding-window layers too (no rings: rows can roll back).
    kv = KVCache.bytes_needed(
        pi.config, limits.max_batch_size, limits.max_context, pi.dtype, layers=pi.layer_indices, rings=False
    )
    ws = workspace_bytes(
        pi.config,
        pi.dtype,
        limits.max_batch_size,
        limits.max_prefill_tokens,
        limits.max_context,
        logits=has_head,
    )
    # Embedding rows read on demand (or dequantized): the stored rows and their converted copy.
    row_bytes = pi.embed.row_bytes() if pi.embed is not None else pi.config.hidden_size * 4
    ws += 2 * limits.max_batch_size * limits.max_prefill_tokens * row_bytes
    fixed = pi.fixed_nonlayer
    if head_resident:
        head_bytes = fixed if fixed is not None else align_up(pi.head.nbytes) if pi.head is not None else 0
    else:
        head_bytes = 0
    return MemoryPlan(
        budget=inp.streaming.budget_bytes,
        limits=limits,
        num_layers=n,
        resident_layers=[pi.layer(i) for i in range(resident)],
        units=units,
        num_buffers=num_buffers,
        buffer_bytes=buffer,
        kv_bytes=kv,
        workspace_bytes=ws,
        small_bytes=pi.small_bytes,
        resident_layer_bytes=sum(layer_bytes(pi.layer_refs[i]) for i in range(resident)),
        embed_resident=fixed is not None or (head_resident and has_head and pi.config.tie_word_embeddings),
        head_resident=head_resident,
        embed_bytes=0,
        head_bytes=head_bytes,
        layer_group_size=group_size,
        prefetch=prefetch,
        head=has_head,
    )


def _best(inp: _Inputs, limits: Limits, group_size: int, prefetch: bool) -> MemoryPlan | None:
    """The feasible plan that streams the fewest bytes per forward, or None."""
    pi = inp.inputs
    n = len(pi.layer_refs)
    cap = n if inp.streaming.max_resident_layers is None else min(n, inp.streaming.max_resident_layers)
    head_options = [False] if inp.streaming.resident_embeddings is False else [True, False]
    if pi.fixed_nonlayer is not None or pi.head is None:  # nothing to stream
        head_options = [True]
    best: MemoryPlan | None = None
    for head_resident in head_options:
        if _candidate(inp, limits, head_resident, 0, group_size, prefetch).total > inp.streaming.budget_bytes:
            continue  # nothing fits with these settings: skip the scan
        for r in range(cap, -1, -1):
            plan = _candidate(inp, limits, head_resident, r, group_size, prefetch)
            if plan.total <= plan.budget:
                if best is None or plan.streamed_bytes_per_forward < best.streamed_bytes_per_forward:
                    best = plan
                break
    if best is None:
        return None
    if (
        pi.embed is not None
        and not pi.config.tie_word_embeddings
        and inp.streaming.resident_embeddings is not False
    ):
        with_embed = replace(best, embed_resident=True, embed_bytes=align_up(pi.embed.nbytes))
        if with_embed.total <= best.budget:
            best = with_embed
    return best


def _minimum(inp: _Inputs, limits: Limits, group_size: int, prefetch: bool) -> MemoryPlan:
    return _candidate(inp, limits, inp.inputs.fixed_nonlayer is not None, 0, group_size, prefetch)


def _largest_context(inp: _Inputs, limits: Limits, group_size: int, prefetch: bool) -> int:
    """The longest context (<= the requested one) with a feasible plan; 0 if none."""
    lo, hi = 0, limits.max_context
    while lo < hi:
        mid = (lo + hi + 1) // 2
        trial = Limits(mid, limits.max_batch_size, min(limits.max_prefill_tokens, mid))
        if _minimum(inp, trial, group_size, prefetch).total <= inp.streaming.budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _refusal(inp: _Inputs, limits: Limits, group_size: int, prefetch: bool) -> BudgetError:
    s = inp.streaming
    source = inp.inputs.description
    need = _minimum(inp, limits, group_size, prefetch)
    lines = [
        f"{source}: memory budget {format_bytes(s.budget_bytes)} is too small for layer_group_size="
        f"{group_size}, prefetch={prefetch}, max_context={limits.max_context}, "
        f"max_batch_size={limits.max_batch_size}, max_prefill_tokens={limits.max_prefill_tokens}.",
        f"Even streaming every layer it needs {format_bytes(need.total)}: {need.describe()}.",
        "What would fit:",
    ]
    options = []
    if group_size > 1:
        one = _minimum(inp, limits, 1, prefetch)
        verdict = "fits" if one.total <= s.budget_bytes else "still too big"
        options.append(f"layer_group_size=1 needs {format_bytes(one.total)} ({verdict})")
    if prefetch:
        sync = _minimum(inp, limits, group_size, False)
        verdict = "fits" if sync.total <= s.budget_bytes else "still too big"
        options.append(f"prefetch=False (one buffer) needs {format_bytes(sync.total)} ({verdict})")
    ctx = _largest_context(inp, limits, group_size, prefetch)
    if ctx > 0:
        options.append(f"max_context={ctx} with layer_group_size={group_size} fits")
    ctx1 = _largest_context(inp, limits, 1, prefetch)
    if ctx1 > 0 and group_size > 1:
        options.append(f"max_context={ctx1} with layer_group_size=1 fits")
    smallest = _minimum(inp, Limits(1, 1, 1), 1, False)
    options.append(
        f"a memory_budget of at least {format_bytes(need.total)} for this configuration "
        f"(the smallest possible configuration needs {format_bytes(smallest.total)})"
    )
    lines.extend(f"  - {o}" for o in options)
    return BudgetError("\n".join(lines))


def _halvings(start: int) -> list[int]:
    out = [start]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def plan_memory(
    inputs: PlanInputs, streaming: StreamingConfig, *, max_context: int | None = None
) -> MemoryPlan:
    """The plan for ``inputs`` under ``streaming``; settings left at None are chosen to fit.

    ``max_context`` overrides ``streaming.max_context``. Raises `BudgetError` (with what
    would fit) only when the settings the user gave cannot fit the budget.
    """
    inp = _Inputs(inputs, streaming)
    context = max_context if max_context is not None else streaming.max_context
    user_prefill = streaming.max_prefill_tokens
    if context is not None and user_prefill is not None and user_prefill > context:
        raise BudgetError(f"max_prefill_tokens ({user_prefill}) exceeds max_context ({context})")
    contexts = [context] if context is not None else _halvings(default_context(inputs.config))
    groups = (
        [streaming.layer_group_size] if streaming.layer_group_size is not None else list(AUTO_GROUP_SIZES)
    )
    prefetches = [streaming.prefetch] if streaming.prefetch is not None else [True, False]
    for ctx in contexts:
        default_prefill = min(ctx, DEFAULT_MAX_PREFILL)
        prefills = [user_prefill] if user_prefill is not None else _halvings(default_prefill)
        for prefill in prefills:
            limits = Limits(ctx, streaming.max_batch_size, prefill)
            feasible = [
                plan
                for prefetch in prefetches
                for group in groups
                if (plan := _best(inp, limits, group, prefetch))
            ]
            if feasible:
                plan = min(
                    feasible,
                    key=lambda p: (p.streamed_bytes_per_forward, not p.prefetch, -p.layer_group_size),
                )
                if ctx != contexts[0]:
                    plan.notes.append(
                        f"max_context {contexts[0]} does not fit the budget: planned for {ctx} tokens"
                    )
                if prefill != prefills[0]:
                    plan.notes.append(f"prefill is fed in chunks of {prefill} tokens to fit the budget")
                return plan
    limits = Limits(
        contexts[0], streaming.max_batch_size, user_prefill or min(contexts[0], DEFAULT_MAX_PREFILL)
    )
    raise _refusal(inp, limits, groups[0], prefetches[0])
