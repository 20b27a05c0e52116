"""The engine's KV memory: rows of slots, grown and shrunk on demand, and the prefixes rows share.

`KVSlots` never runs the model; the scheduler changes it only through `KVSlots.apply` (typed
`infer.kv.ops.KVOp`s, recorded so other ranks replay them). See docs/engine.md, "KV memory".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

import torch

from infer.host.pages import release_freed_memory
from infer.kv.cache import KEY_CHUNK, KVCache, KVModel, LayerKV, SharedPrefix, bucket, round_up
from infer.kv.ops import Done, KVOp, Reserve, Rollback, SetBound, SharePrefix, Shrink
from infer.kv.prefix import PrefixStore, Segment
from infer.params import MAX_SPECULATIVE

MIN_SLOTS = 64  # the KV capacity grows from here (up to the context)
# Slots a row gets beyond its request's prompt + max_tokens (`KVSlots.bound`): a speculative
# verify pass writes its whole draft before the rejected tokens are rolled back.
BOUND_MARGIN = MAX_SPECULATIVE

M = TypeVar("M", bound=KVModel, covariant=True)  # the model the slots hold K/V for


class KVSlots(Generic[M]):
    """Up to ``max_rows`` rows of ``context`` slots each, allocated on demand, and their shared
    prefixes (`infer.kv.prefix.PrefixStore`).

    Row ``r`` holds one sequence: the first ``n`` tokens of a shared segment (``prefix[r] =
    (segment, n)``), then its own tokens ``held[r]`` from slot 0 (``pad[r] = -n``). Slots stay in
    slot order (no rings) so any row can be rolled back.
    """

    def __init__(
        self,
        model: M,
        max_rows: int,
        context: int,
        bucketed: bool = False,
        share: bool | None = None,
        record: bool = False,
    ) -> None:
        self.model = model
        self.max_rows = max_rows
        self.context = context
        self.bucketed = bucketed  # capacities in powers of two (a compiled step's few shapes)
        self.cache: KVCache | None = None
        self.held: list[list[int]] = []
        self.prefix: list[tuple[Segment, int] | None] = []
        # Per row, the most tokens it may hold while its request runs (0: no request; it holds
        # ``held``): the engine sets it at admission (prompt + max_tokens), so capacity stops there.
        self.bounds: list[int] = []
        # Prefixes shared between rows are stored once (`infer.kv.prefix`); where attention cannot
        # read a shared prefix (the deterministic mode, ...), a prefix is copied into the row.
        self.share = model.shares_prefixes if share is None else share
        self.store = PrefixStore(model)
        self._views: dict[tuple[int, int], KVCache] = {}
        # The model's forward hooks when the held K/V were computed (`infer.models.hooks`); rows
        # holding K/V computed under other hooks (`stale`) are never reused (`check_hooks`).
        self.hook_state: tuple[int, ...] = ()
        self.stale: set[int] = set()
        self.record = record  # `apply` keeps each operation for the next plan (`take_ops`)
        self.done: list[Done] = []

    def apply(self, op: KVOp) -> None:
        """Make ``op``; when ``record``, keep it with its outcome (what it raised is re-raised)."""
        try:
            match op:
                case Reserve(rows, capacity):
                    self.reserve(rows, capacity)
                case Rollback(row, length):
                    self.rollback(row, length)
                case SharePrefix(src, count, dst):
                    self.share_prefix(src, count, dst)
                case Shrink():
                    self.shrink()
                case SetBound(row, bound):
                    self.set_bound(row, bound)
        except Exception as e:
            if self.record:
                self.done.append(Done(op, f"{type(e).__name__}: {e}"))
            raise
        if self.record:
            self.done.append(Done(op))

    def take_ops(self) -> list[Done]:
        """The operations made since the last call, in order."""
        done, self.done = self.done, []
        return done

    @property
    def rows(self) -> int:
        return 0 if self.cache is None else self.cache.batch_size

    @property
    def capacity(self) -> int:
        return 0 if self.cache is None else self.cache.max_len

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes one token of one row takes (every layer this process keeps)."""
        m = self.model
        return KVCache.bytes_needed(m.config, 1, 64, m.cache_dtype, m.kv_layers, rings=False) // 64

    @property
    def nbytes(self) -> int:
        """Bytes of K/V held: the rows' buffers and the shared prefixes'."""
        return (0 if self.cache is None else self.cache.nbytes) + self.store.nbytes

    def offset(self, row: int) -> int:
        """Tokens of the shared prefix row ``row`` continues (0: none)."""
        prefix = self.prefix[row]
        return 0 if prefix is None else prefix[1]

    def length(self, row: int) -> int:
        """Tokens in row ``row``'s sequence (its shared prefix and its own)."""
        return self.offset(row) + len(self.held[row])

    def tokens(self, row: int) -> list[int]:
        """Row ``row``'s sequence: its shared prefix's tokens, then its own."""
        prefix = self.prefix[row]
        head = [] if prefix is None else list(prefix[0].tokens[: prefix[1]])
        return head + self.held[row]

    def reserve(self, rows: int, capacity: int) -> None:
        """Grow to at least ``rows`` rows of ``capacity`` slots (what is held is kept)."""
        if rows > self.max_rows or capacity > self.context:
            raise ValueError(
                f"KV slots: {rows} rows x {capacity} slots asked, at most {self.max_rows} x {self.context}"
            )
        old = self.cache
        if old is not None and rows <= old.batch_size and capacity <= old.max_len:
            return
        if rows > self.rows:
            rows = min(self.max_rows, max(rows, 2 * self.rows))  # rows double: few regrowths
        rows = max(rows, self.rows)
        if old is None or capacity > old.max_len:
            want = max(capacity, self.capacity, MIN_SLOTS)
            if self.bucketed:  # powers of two: few graphs for `compile=True`
                capacity = bucket(want)
            else:  # a quarter more than asked, in whole key chunks: memory follows the longest row
                capacity = round_up(want + want // 4, KEY_CHUNK)  # and a growing row copies rarely
                bound = self.bound()  # ... but no further than any row may ever hold
                if bound is not None:
                    capacity = max(round_up(want, KEY_CHUNK), min(capacity, round_up(bound, KEY_CHUNK)))
            capacity = min(self.context, capacity)
        else:
            capacity = old.max_len

        def keep(src: torch.Tensor, dst: torch.Tensor) -> None:
            dst[: src.shape[0], :, : src.shape[2]].copy_(src)

        self._replace(rows, capacity, keep)
        self.held += [[] for _ in range(rows - len(self.held))]
        self.prefix += [None] * (rows - len(self.prefix))
        self.bounds += [0] * (rows - len(self.bounds))

    def bound(self) -> int | None:
        """The most tokens any row may hold, draft margin included (None: the engine set no `bounds`)."""
        if not any(self.bounds):
            return None
        rows = range(len(self.held))
        return max(self.bounds[r] or len(self.held[r]) for r in rows) + BOUND_MARGIN

    def _replace(self, rows: int, capacity: int, keep: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Swap the cache for one of ``rows x capacity`` slots, ``keep(old, new)`` copying each buffer,
        layer by layer, so the peak is the new cache plus one old layer (docs/engine.md, *KV memory*)."""
        old, model = self.cache, self.model
        self._views.clear()  # views of the old buffers would keep them alive
        # Every layer an empty placeholder at first, filled below.
        new = KVCache(model.config, rows, capacity, dtype=model.cache_dtype, device=model.device,
                      layers=[], rings=False)  # fmt: skip
        held = range(model.config.num_hidden_layers) if model.kv_layers is None else model.kv_layers
        shape = (rows, model.config.num_key_value_heads, model.config.computed_head_dim)
        for i in held:
            after = LayerKV(new, new.capacity, False, shape, model.cache_dtype, new.device)
            if old is not None:
                before = old.layers[i]
                for src, dst in zip(before.tensors(), after.tensors(), strict=True):
                    keep(src, dst)
                before.release()
                release_freed_memory()  # the old layer's pages, before the next new one is written
            new.layers[i] = after
        if old is not None:
            r = min(rows, old.batch_size)
            new.slot[:r].copy_(old.slot[:r])
            new.pad[:r].copy_(old.pad[:r])
        self.cache = new

    def shrink(self) -> None:
        """When every row's own tokens fit in a quarter of the capacity, halve it until they fit in
        half (at least `MIN_SLOTS`), copying what the rows hold."""
        if self.cache is None:
            return
        need = max((len(h) for h in self.held), default=0)
        capacity = self.capacity
        if capacity <= MIN_SLOTS or 4 * need > capacity:
            return
        while capacity > MIN_SLOTS and 2 * need <= capacity // 2:
            capacity //= 2
        if not self.bucketed:
            capacity = max(MIN_SLOTS, round_up(2 * need, KEY_CHUNK))

        def keep(src: torch.Tensor, dst: torch.Tensor) -> None:
            dst.copy_(src[:, :, : dst.shape[2]])

        self._replace(self.cache.batch_size, capacity, keep)

    def view(self, lo: int, hi: int) -> KVCache:
        """Rows ``[lo, hi)`` of the cache (the cache itself when that is every row)."""
        assert self.cache is not None
        if lo == 0 and hi == self.cache.batch_size:
            return self.cache
        view = self._views.get((lo, hi))
        if view is None:
            view = self._views[(lo, hi)] = self.cache.rows(lo, hi)
        return view

    def _set_prefix(self, row: int, prefix: tuple[Segment, int] | None) -> None:
        """Make row ``row`` continue ``prefix`` (its positions start after it)."""
        old = self.prefix[row]
        if prefix is not None:
            self.store.acquire(prefix[0])
        if old is not None:
            self.store.release(old[0])
        self.prefix[row] = prefix
        assert self.cache is not None
        self.cache.pad[row] = -(0 if prefix is None else prefix[1])

    def check_hooks(self) -> None:
        """If the model's forward hooks changed, mark every row holding tokens `stale` (never reused)."""
        state = self.model.hooks.signature()
        if state != self.hook_state:
            self.hook_state = state
            self.stale = {r for r in range(len(self.held)) if self.length(r)}

    def reusable(self, row: int) -> bool:
        """Whether row ``row``'s tokens may be continued or shared (`check_hooks`)."""
        return row not in self.stale

    def rollback(self, row: int, length: int) -> None:
        """Truncate ``row`` to the first ``length`` tokens of its sequence (its shared prefix too)."""
        held = self.held[row]
        n = self.offset(row)
        if not 0 <= length <= n + len(held):
            raise ValueError(f"rollback: length must be in [0, {n + len(held)}] for row {row}, got {length}")
        assert self.cache is not None
        if length < n or (length == 0 and self.prefix[row] is not None):
            prefix = self.prefix[row]
            assert prefix is not None
            self._set_prefix(row, (prefix[0], length) if length else None)
            held.clear()
            self.cache.slot[row] = 0
        elif length - n < len(held):
            del held[length - n :]
            self.cache.slot[row] = length - n
        if length == 0:
            self.stale.discard(row)

    def share_prefix(self, src: int, count: int, dst: int) -> None:
        """Row ``dst`` (empty) continues the first ``count`` tokens of row ``src``'s sequence: shared
        through a segment (``src``'s own slots then shift down), else copied."""
        assert self.cache is not None and not self.held[dst] and self.prefix[dst] is None
        n_src = self.offset(src)
        if not self.share:  # copy: ``src`` holds every token itself (nothing is shared here)
            assert n_src == 0
            for layer in self.cache.layers:
                for t in layer.tensors():
                    t[dst, :, :count].copy_(t[src, :, :count])
            self.held[dst] = self.held[src][:count]
            self.cache.slot[dst] = count
            return
        prefix = self.prefix[src]
        if prefix is not None and count <= n_src:
            self._set_prefix(dst, (prefix[0], count))
            return
        tokens = tuple(self.tokens(src)[:count])
        segment = self.store.allocate(tokens)  # may move the others (their data goes with them)
        if prefix is not None:
            assert self.store.cache is not None
            self.store.write(segment, self.store.cache, 0, prefix[0].start, n_src, 0)
        own = count - n_src
        self.store.write(segment, self.cache, src, 0, own, n_src)
        self._set_prefix(dst, (segment, count))
        # ``src`` reads those tokens from the segment now: its remaining slots move down.
        rest = len(self.held[src]) - own
        if rest:
            for layer in self.cache.layers:
                for t in layer.tensors():
                    t[src, :, :rest] = t[src, :, own : own + rest].clone()
        del self.held[src][:own]
        self.cache.slot[src] = rest
        self._set_prefix(src, (segment, count))

    def fit(self, lo: int, hi: int, T: int, feeds: Mapping[int, Sequence[int]]) -> None:
        """Make rows ``[lo, hi)`` able to take a ``T``-token step: grow, or cut idle rows past the context."""
        if hi > self.rows:
            self.reserve(hi, T)
        need = 0
        for r in range(lo, hi):
            n = self.length(r)
            if n + T > self.context:
                if r in feeds:
                    raise ValueError(f"row {r}: {n} + {T} tokens are past the context of {self.context}")
                self.rollback(r, self.context - T)  # an idle row: its padding must stay inside
            need = max(need, len(self.held[r]) + T)
        self.reserve(hi, need)

    def _shared(self, lo: int, hi: int) -> SharedPrefix | None:
        """The shared prefix rows ``[lo, hi)`` read in a step (None when none of them has one)."""
        prefixes = [self.prefix[r] for r in range(lo, hi)]
        used = [p for p in prefixes if p is not None]
        if not used or self.store.cache is None:
            return None
        start, stop = self.store.region([p[0] for p in used])
        layers = [layer.rows(self.store.cache, slice(0, 1)) for layer in self.store.cache.layers]
        for layer in layers:  # the region only: [1, Hkv, R, hd] views
            layer.k, layer.v = layer.k[:, :, start:stop], layer.v[:, :, start:stop]
            if layer.k_scale is not None and layer.v_scale is not None:
                layer.k_scale = layer.k_scale[:, :, start:stop]
                layer.v_scale = layer.v_scale[:, :, start:stop]
        device = self.model.device
        starts = [0 if p is None else p[0].start - start for p in prefixes]
        counts = [0 if p is None else p[1] for p in prefixes]
        return SharedPrefix(layers, torch.tensor(starts, device=device), torch.tensor(counts, device=device))

    def bind(self, lo: int, hi: int) -> KVCache:
        """The view of rows ``[lo, hi)`` ready for a step: lengths and the shared prefix set."""
        view = self.view(lo, hi)
        view.length = max(len(self.held[r]) for r in range(lo, hi))
        view.first = min(len(self.held[r]) for r in range(lo, hi))
        view.shared = self._shared(lo, hi)
        return view

    def set_bound(self, row: int, bound: int) -> None:
        """The most tokens row ``row`` may hold while its request runs (0: no request)."""
        self.bounds[row] = bound

    def advance(self, feeds: Mapping[int, Sequence[int]]) -> None:
        """A step wrote ``feeds[r]`` into row ``r``'s slots: they hold those tokens now."""
        for r, t in feeds.items():
            self.held[r].extend(t)

    def restore(self, view: KVCache, lo: int, hi: int) -> None:
        """After a failed step over rows ``[lo, hi)``: put their slots back to what `held` lists."""
        lengths = [len(self.held[r]) for r in range(lo, hi)]
        view.slot.copy_(torch.tensor(lengths, dtype=torch.long, device=view.slot.device))


__all__ = ["BOUND_MARGIN", "MIN_SLOTS", "KVSlots"]
