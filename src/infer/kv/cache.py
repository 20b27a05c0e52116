"""Static KV cache: preallocated buffers addressed by per-row position tensors.

A step's indices and masks are tensors computed once (`KVCache.make_plan`), so a step has no
host sync and a fixed shape per ``(batch, capacity, T)``. Layout, rings and padding:
docs/architecture.md, "The KV cache".
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from infer.loader.config import SLIDING_ATTENTION, ModelConfig

KEY_CHUNK = 64  # attention reduces over keys in chunks of this many (see models.attend.attend)


class HookState(Protocol):
    """What KV memory reads of a model's forward hooks (`infer.models.hooks.HookWatch`)."""

    def signature(self) -> tuple[int, ...]: ...


class KVModel(Protocol):
    """What KV memory (`KVSlots`, `PrefixStore`) needs of the model it holds K/V for
    (`infer.models.base.DecoderLM`); K/V computed under other hooks are not reused."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def cache_dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def kv_layers(self) -> Sequence[int] | None: ...

    @property
    def shares_prefixes(self) -> bool: ...

    @property
    def hooks(self) -> HookState: ...


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _ring_size(config: ModelConfig, capacity: int, rings: bool, dtype: torch.dtype) -> int | None:
    """Slots of each sliding-window layer's ring, or None where they keep slot order (``rings=False``,
    no window, or an int8 cache)."""
    if not rings or config.sliding_window is None or dtype == torch.int8:
        return None
    return min(config.sliding_window, capacity)


def bucket(n: int, least: int = 1) -> int:
    """The power of two at or above ``n`` and ``least``: the shapes of compiled steps (rows, slots,
    prompt tokens) come in these buckets, so that a few graphs serve every batch."""
    return max(least, 1 << (n - 1).bit_length())


@dataclass
class StepPlan:
    """Where a step's ``T`` tokens go and what they see (all tensors, computed once per step)."""

    slots: torch.Tensor  # [B, T] slot of every new token (query slots)
    n_new: torch.Tensor  # [B] real tokens per row in this step
    positions: torch.Tensor  # [B, T] positions (slot - pad, clamped at 0)
    ring_write: torch.Tensor | None  # [B] ring slot of a 1-token step
    ring_src: torch.Tensor | None  # [B, R] index into cat(new [T], ring [R]) of each new ring entry
    ring_before: torch.Tensor | None  # [B, R] slots the ring holds before the step
    ring_after: torch.Tensor | None  # [B, R] ... and after it
    one_token: bool  # T == 1: write first, then attend over the buffers

    def rows(self, rows: slice) -> StepPlan:
        """The plan of rows ``rows`` alone (every tensor is row-first)."""
        changes = {
            f.name: getattr(self, f.name)[rows]
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **changes)


KV_DTYPES = ("float32", "bfloat16", "float16", "int8")  # what a KV cache may hold (`kv_dtype`)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., hd]`` -> int8 values ``[..., hd]`` and a float32 scale per vector ``[...]``
    (symmetric: ``x ~ q * scale``, ``scale = max|x| / 127``; an all-zero vector gets scale 0)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0  # [...]
    q = torch.where(scale[..., None] > 0, xf / scale.clamp_min(1e-30)[..., None], 0.0)
    return q.round().clamp(-127, 127).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 ``q [..., hd]`` times ``scale [...]``, in ``dtype``."""
    return (q.to(torch.float32) * scale[..., None]).to(dtype)


class LayerKV:
    """K/V storage of one layer: ``[B, Hkv, capacity, hd]`` each (a ring for sliding-window layers).

    An int8 cache also holds ``k_scale``/``v_scale`` ``[B, Hkv, capacity]``, one float32 scale per
    token and head (`quantize_int8`; None otherwise); its values are read back in the activations'
    dtype.
    """

    def __init__(
        self,
        cache: KVCache,
        capacity: int,
        ring: bool,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        B, H, D = shape
        self.cache = cache
        self.capacity = capacity
        self.ring = ring
        self.k = torch.zeros(B, H, capacity, D, dtype=dtype, device=device)
        self.v = torch.zeros(B, H, capacity, D, dtype=dtype, device=device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if dtype == torch.int8:
            self.k_scale = torch.zeros(B, H, capacity, dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(B, H, capacity, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        scales = 0 if self.k_scale is None else self.k_scale.numel() * 4 * 2
        return int(self.k.numel() * self.k.element_size() * 2 + scales)

    def tensors(self) -> list[torch.Tensor]:
        """The layer's buffers: ``k, v`` (and their scales for an int8 cache)."""
        if self.k_scale is None or self.v_scale is None:
            return [self.k, self.v]
        return [self.k, self.v, self.k_scale, self.v_scale]

    def release(self) -> None:
        """Drop the buffers for empty ones of no slots (their memory goes once no view holds them)."""

        def empty(t: torch.Tensor) -> torch.Tensor:
            return t.new_empty((*t.shape[:2], 0, *t.shape[3:]))  # no view of the old storage

        self.k, self.v = empty(self.k), empty(self.v)
        if self.k_scale is not None and self.v_scale is not None:
            self.k_scale, self.v_scale = empty(self.k_scale), empty(self.v_scale)
        self.capacity = 0

    def rows(self, cache: KVCache, rows: slice) -> LayerKV:
        """Rows ``rows`` of this layer's buffers (views: writes land here), bound to ``cache``."""
        view = copy.copy(self)
        view.cache, view.k, view.v = cache, self.k[rows], self.v[rows]
        if self.k_scale is not None and self.v_scale is not None:
            view.k_scale, view.v_scale = self.k_scale[rows], self.v_scale[rows]
        return view


@dataclass
class StepKV:
    """One layer's buffers bound to a step's plan: what attention calls `update` on.

    Plain tensors and constants (no reference to the cache), the typed view of a step's K/V that
    crosses into a block: a pytree node (`torch.utils._pytree`), so a compiled block (a nested
    compile region, `infer.models.base`) takes it as one argument and its tensors as inputs.
    ``k_scale``/``v_scale``: an int8 cache's scales (else None). ``shared_*``: a shared prefix
    (`SharedPrefix`): its keys and values ``[1, Hkv, R, hd]`` and the mask ``[B, 1, T, R]`` of
    what each row's queries see of them. ``key_limit``: the slots in use before the step (host
    int, an upper bound for every row; None: unknown): a query ``t`` of the step sees no key at or
    past ``key_limit + t + 1``. ``key_start``: a sliding window's lower bound (host int; None: none
    or unknown): query ``t`` sees no key before slot ``key_start + t`` (every row's first query is
    at slot >= the cache's `KVCache.first`, and sees ``window`` slots back). Both None in a ring.
    """

    k: torch.Tensor
    v: torch.Tensor
    ring: bool
    slots: torch.Tensor  # [B, T]
    n_new: torch.Tensor  # [B]
    ring_write: torch.Tensor | None
    ring_src: torch.Tensor | None
    key_limit: int | None = None
    key_start: int | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    shared_k: torch.Tensor | None = None
    shared_v: torch.Tensor | None = None
    shared_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.ring:
            self.key_limit = self.key_start = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [B, Hkv, T, hd]``; return the keys/values to attend to ``[B, Hkv, S, hd]``.

        Key ``s`` of what is returned is the one `KVCache.key_slots` lists at ``s``. The new
        keys/values are stored in the cache's dtype (rounded: what later steps read), and what
        is returned is what the buffer holds (an int8 cache's values dequantized, up to the
        slots in use when ``key_limit`` says so).
        """
        B, H, T = k.shape[0], k.shape[1], k.shape[2]
        rows = torch.arange(B, device=k.device)[:, None, None]  # [B, 1, 1]
        heads = torch.arange(H, device=k.device)[None, :, None]  # [1, H, 1]
        if self.k_scale is not None and self.v_scale is not None:
            return self._update_int8(k, v, rows, heads)
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        if not self.ring:
            slots = self.slots[:, None, :]  # [B, 1, T]
            self.k[rows, heads, slots] = k  # index_put_: compiles to an in-place write
            self.v[rows, heads, slots] = v
            return self.k, self.v
        if T == 1:
            assert self.ring_write is not None
            slot = self.ring_write[:, None, None]  # [B, 1, 1]
            keep = (self.n_new == 0)[:, None, None, None]  # a row with no token this step keeps its entry
            self.k[rows, heads, slot] = torch.where(keep, self.k[rows, heads, slot], k)
            self.v[rows, heads, slot] = torch.where(keep, self.v[rows, heads, slot], v)
            return self.k, self.v
        assert self.ring_src is not None
        keys = torch.cat((k, self.k), dim=2)  # [B, Hkv, T + R, hd]: new first (starting at key 0)
        values = torch.cat((v, self.v), dim=2)
        src = self.ring_src[:, None, :]  # [B, 1, R]
        self.k.copy_(keys[rows, heads, src])
        self.v.copy_(values[rows, heads, src])
        return keys, values

    def _update_int8(
        self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, heads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` of an int8 cache (slot order only: int8 caches have no rings)."""
        assert self.k_scale is not None and self.v_scale is not None and not self.ring
        slots = self.slots[:, None, :]  # [B, 1, T]
        qk, sk = quantize_int8(k)
        qv, sv = quantize_int8(v)
        self.k[rows, heads, slots] = qk
        self.v[rows, heads, slots] = qv
        self.k_scale[rows, heads, slots] = sk
        self.v_scale[rows, heads, slots] = sv
        S = self.k.shape[2]
        if self.key_limit is not None:  # only the slots a query can see are read back
            S = min(S, self.key_limit + k.shape[2])
        # [B, Hkv, S, hd] in the activations' dtype (what attention computes in)
        keys = dequantize_int8(self.k[:, :, :S], self.k_scale[:, :, :S], k.dtype)
        values = dequantize_int8(self.v[:, :, :S], self.v_scale[:, :, :S], v.dtype)
        return keys, values


torch.export.register_dataclass(StepKV, serialized_type_name="infer.kv.cache.StepKV")


@dataclass
class SharedPrefix:
    """The prefix keys a step's rows share: a region of a `infer.kv.prefix.PrefixStore`.

    ``layers[i]``: layer ``i``'s region, ``[1, Hkv, R, hd]`` views (a `LayerKV` of one row);
    ``start [B]``: where row ``b``'s prefix begins in the region; ``length [B]``: how many of its
    tokens row ``b`` sees (0: none). Row ``b``'s own slots continue at position ``length[b]``
    (its ``pad`` is ``-length[b]``).
    """

    layers: list[LayerKV]
    start: torch.Tensor
    length: torch.Tensor

    def rows(self, rows: slice) -> SharedPrefix:
        return SharedPrefix(self.layers, self.start[rows], self.length[rows])

    def kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s shared keys and values ``[1, Hkv, R, hd]`` (an int8 store's dequantized)."""
        layer = self.layers[index]
        if layer.k_scale is None or layer.v_scale is None:
            return layer.k, layer.v
        return (dequantize_int8(layer.k, layer.k_scale, torch.float32),
                dequantize_int8(layer.v, layer.v_scale, torch.float32))  # fmt: skip


class KVCache:
    """The KV cache of a whole model for one batch.

    ``max_len`` slots per row (``capacity`` is that rounded up to `KEY_CHUNK`);
    ``pad[b]`` left-padding slots of row ``b`` (negative: the row continues a shared prefix of
    ``-pad[b]`` tokens, ``shared``, so its positions start there). ``slot [B]`` (tensor) is the
    next slot of every row; ``length`` (host int) bounds the slots used so far.
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pad: torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
        rings: bool = True,
    ) -> None:
        self.config = config
        self.max_len = max_len
        self.capacity = round_up(max_len, KEY_CHUNK)
        self.batch_size = batch_size
        self.length = 0
        # The lowest slot a row's first token of the next step goes to (host int, set by whoever
        # knows it, the engine; None: unknown): lets sliding-window attention skip older keys.
        self.first: int | None = None
        self.device = torch.device(device)
        if pad is None:
            pad = torch.zeros(batch_size, dtype=torch.long)
        self.pad = pad.to(device=self.device, dtype=torch.long)
        self.slot = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.window = config.sliding_window
        # ``rings=False`` (the deterministic mode): sliding-window layers keep every slot, in slot
        # order like the full-attention layers, and mask by the window; more memory, but a key's
        # place in the buffer no longer depends on how the prompt was fed.
        self.dtype = dtype
        self.ring_size = _ring_size(config, self.capacity, rings, dtype)
        shape = (batch_size, config.num_key_value_heads, config.computed_head_dim)
        self.layers: list[LayerKV] = []
        self.ring_slots: torch.Tensor | None = None
        held = set(range(config.num_hidden_layers) if layers is None else layers)
        for i in range(config.num_hidden_layers):
            ring = config.layer_type(i) == SLIDING_ATTENTION and self.ring_size is not None
            capacity = self.ring_size if ring and self.ring_size is not None else self.capacity
            if ring and self.ring_slots is None:  # the rings' slot bookkeeping, shared by every ring
                self.ring_slots = torch.full((batch_size, capacity), -1, dtype=torch.long, device=self.device)
            if i not in held:  # another process's layer (a pipeline stage): an empty placeholder
                capacity = 0
            self.layers.append(LayerKV(self, capacity, ring, shape, dtype, self.device))
        self.plan: StepPlan | None = None
        self.shared: SharedPrefix | None = None  # a prefix the rows share (set per step by the engine)

    def empty_like(self) -> KVCache:
        """A new empty cache of this one's shape (rows, slots, layers kept, rings), dtype and device."""
        held = [i for i, layer in enumerate(self.layers) if layer.capacity]
        return KVCache(self.config, self.batch_size, self.max_len, dtype=self.dtype, device=self.device,
                       layers=held, rings=self.ring_size is not None)  # fmt: skip

    @staticmethod
    def bytes_needed(
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype,
        layers: Sequence[int] | None = None,
        rings: bool = True,
    ) -> int:
        """Bytes the K/V buffers will take (of ``layers``; default all), without allocating them."""
        per_slot = 2 * batch_size * config.num_key_value_heads * config.computed_head_dim
        per_slot *= torch.empty((), dtype=dtype).element_size()
        if dtype == torch.int8:  # a float32 scale per token and head
            per_slot += 2 * batch_size * config.num_key_value_heads * 4
        capacity = round_up(max_len, KEY_CHUNK)
        ring = _ring_size(config, capacity, rings, dtype)
        total = 0
        for i in range(config.num_hidden_layers) if layers is None else layers:
            sliding = config.layer_type(i) == SLIDING_ATTENTION
            total += (ring if sliding and ring is not None else capacity) * per_slot
        return total

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a step reads or writes in place (for CUDA graphs: their addresses must not move)."""
        out = [self.slot, self.pad]
        if self.ring_slots is not None:
            out.append(self.ring_slots)
        for layer in self.layers:
            out += layer.tensors()
        return out

    def rows(self, start: int, stop: int) -> KVCache:
        """Rows ``[start, stop)`` during a step (a pipeline micro-batch): the same buffers, sliced,
        so writes through the view land in this cache, and this step's plan, sliced."""
        view = copy.copy(self)
        rows = slice(start, stop)
        view.batch_size = stop - start
        view.pad, view.slot = self.pad[rows], self.slot[rows]
        if self.ring_slots is not None:
            view.ring_slots = self.ring_slots[rows]
        view.layers = [layer.rows(view, rows) for layer in self.layers]
        view.plan = self.plan.rows(rows) if self.plan is not None else None
        view.shared = self.shared.rows(rows) if self.shared is not None else None
        return view

    def reset(self) -> None:
        """Empty the cache for a new batch of the same shape (the buffers are reused)."""
        self.slot.zero_()
        self.pad.zero_()
        if self.ring_slots is not None:
            self.ring_slots.fill_(-1)
        self.length = 0
        self.first = None
        self.plan = None

    # ---- host side: bounds ---------------------------------------------------

    def check(self, T: int) -> None:
        """Refuse a ``T``-token step that could write past ``max_len`` (host-side, no sync)."""
        if self.length + T > self.max_len:
            raise RuntimeError(f"KV cache overflow: {self.length + T} positions, capacity {self.max_len}")

    # ---- inside the step: tensors only -----------------------------------------

    def make_plan(self, T: int, n_new: torch.Tensor | None = None) -> StepPlan:
        """Indices of a ``T``-token step (``n_new [B]`` real tokens per row; default all ``T``)."""
        device = self.slot.device
        start = self.slot  # [B]
        if n_new is None:
            n_new = torch.full_like(start, T)
        slots = start[:, None] + torch.arange(T, device=device)  # [B, T]
        positions = (slots - self.pad[:, None]).clamp_min(0)
        plan = StepPlan(slots, n_new, positions, None, None, None, None, one_token=T == 1)
        if self.ring_slots is None or self.ring_size is None:
            return plan
        R = self.ring_size
        before = self.ring_slots
        plan.ring_before = before
        if T == 1:
            write = start % R  # [B]
            held = before.gather(1, write[:, None])  # [B, 1]
            new = torch.where(n_new[:, None] > 0, start[:, None], held)
            plan.ring_write = write
            plan.ring_after = before.scatter(1, write[:, None], new)
            return plan
        j = torch.arange(R, device=device)[None]  # [1, R]
        last = (start + n_new - 1)[:, None]  # [B, 1] newest real slot (start - 1 if none)
        newest = last - (last - j) % R  # [B, R] newest slot <= last that ring slot j would hold
        fresh = newest >= start[:, None]
        plan.ring_src = torch.where(fresh, newest - start[:, None], T + j)
        plan.ring_after = torch.where(fresh, newest, before)
        return plan

    def key_slots(self, layer_type: str, plan: StepPlan) -> torch.Tensor:
        """Slot of every key a ``layer_type`` layer attends to: ``[S]`` or ``[B, S]`` (-1: empty)."""
        ring = layer_type == SLIDING_ATTENTION and self.ring_slots is not None
        if not ring:
            # The buffers' own length (not the host int): a step exported with a dynamic capacity
            # (`infer.aot`) then sizes its masks from its inputs.
            held = next((layer.k for layer in self.layers if layer.capacity and not layer.ring), None)
            return torch.arange(self.capacity if held is None else held.shape[2], device=self.slot.device)
        assert plan.ring_after is not None and plan.ring_before is not None
        if plan.one_token:
            return plan.ring_after
        return torch.cat((plan.slots, plan.ring_before), dim=1)

    def mask(self, layer_type: str, plan: StepPlan) -> torch.Tensor:
        """Boolean mask ``[B, 1, T, S]`` (True = attend) of the step's queries over `key_slots`."""
        window = self.window if layer_type == SLIDING_ATTENTION else None
        return slot_mask(plan.slots, self.key_slots(layer_type, plan), self.pad, window)

    def shared_mask(self, layer_type: str, plan: StepPlan) -> torch.Tensor:
        """Mask ``[B, 1, T, R]`` (True = attend) of the step's queries over the shared region:
        row ``b`` sees ``[start[b], start[b] + length[b])``, within the sliding window if any."""
        assert self.shared is not None
        shared = self.shared
        R = next(layer.k.shape[2] for layer in shared.layers if layer.capacity)
        j = torch.arange(R, device=self.slot.device)[None, None, :]  # [1, 1, R]
        start = shared.start[:, None, None]  # [B, 1, 1]
        seen = (j >= start) & (j < start + shared.length[:, None, None])  # [B, 1, R]
        T = plan.slots.shape[1]
        seen = seen.expand(-1, T, -1)  # [B, T, R]
        if layer_type == SLIDING_ATTENTION and self.window is not None:
            key_pos = j - start  # [B, 1, R]
            seen = seen & (plan.positions[:, :, None] - key_pos < self.window)
        return seen[:, None]  # [B, 1, T, R]

    def advance(self, plan: StepPlan) -> None:
        """Move every row past its new tokens (in place: the step's last act)."""
        self.slot.add_(plan.n_new)
        if self.ring_slots is not None and plan.ring_after is not None:
            self.ring_slots.copy_(plan.ring_after)
        self.plan = None


def slot_mask(
    query_slots: torch.Tensor, key_slots: torch.Tensor, pad: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Mask ``[B, 1, T, S]`` for queries at ``query_slots [B, T]`` (or ``[T]``) over ``key_slots [B|., S]``.

    A query sees a key if the key is written (slot >= 0), causal, inside the sliding
    window (if any) and not left padding. A padding query sees itself, so no row is
    fully masked (a fully masked row would put NaN into the cache and poison later steps).
    """
    q = query_slots[..., :, None]  # [B|., T, 1]
    k = key_slots[..., None, :]  # [B|., 1, S]
    visible = (k <= q) & (k >= 0)
    if window is not None:
        visible &= (q - k) < window
    not_pad = k >= pad.view(-1, 1, 1)  # [B, 1|T, S]
    mask = visible & (not_pad | (k == q))  # [B, T, S]
    if mask.dim() == 2:
        mask = mask[None]
    return mask[:, None]  # [B, 1, T, S]


__all__ = [
    "KEY_CHUNK", "KV_DTYPES", "HookState", "KVCache", "KVModel", "LayerKV", "SharedPrefix", "StepKV",
    "StepPlan", "bucket", "dequantize_int8", "quantize_int8", "round_up", "slot_mask",
]  # fmt: skip
