"""Shared prompt prefixes: the K/V of a common prefix stored once for every request that has it.

Requests that run at the same time and begin with the same tokens (a system prompt, few-shot
examples, a document asked several questions) would otherwise each prefill and keep their own
copy. The engine (`infer.kv.KVSlots`) keeps such a prefix once, as a **segment** of a
`PrefixStore`, and each row that uses it holds only what follows (its private part). Attention
then reads the segment once for all the rows of a step (`infer.models.attend.attend_shared`:
every row's queries against the one copy, merged with each row's private keys by their
log-sum-exp), so a 2,000-token system prompt shared by 16 streams is read once per step, not
16 times.

* A segment holds the K/V of the first ``length`` tokens of some sequence (always from position
  0), every layer, in the store's buffers ``[1, Hkv, capacity, hd]`` at ``[start, start +
  length)``. A row uses the first ``n <= length`` tokens of one segment (its ``prefix``).
* Segments are reference-counted by the rows that use them (running requests, and finished
  ones whose row is kept for the prefix cache). When the last user lets go, the segment's slots
  are free at once for the next segment (`release`).
* Slots are allocated first-fit; when no gap is large enough the store is rebuilt with the live
  segments packed from slot 0 and room for the new one (`allocate`): what the store holds
  follows the segments alive, never the number of requests.

Not shared (each row keeps its own copy, as before): the deterministic mode (its bitwise
guarantees are stated for attention over one contiguous buffer), streamed, parallel and
GPT-2-style models (`infer.models.base.DecoderLM.shares_prefixes`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from infer.host.pages import release_freed_memory
from infer.kv.cache import KVCache, KVModel

GROWTH = 1.5  # the store grows to at least this many times what is live when it must grow


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(eq=False)
class Segment:
    """The K/V of ``tokens`` (from position 0), at store slots ``[start, start + len(tokens))``."""

    id: int
    tokens: tuple[int, ...]
    start: int
    users: int = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class PrefixStore:
    """The shared prefixes of one engine: K/V buffers ``[1, Hkv, capacity, hd]`` per layer (a
    `KVCache` of one row, no rings) and the segments in them."""

    model: KVModel
    cache: KVCache | None = None
    segments: list[Segment] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def capacity(self) -> int:
        return 0 if self.cache is None else self.cache.max_len

    @property
    def nbytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes

    @property
    def tokens_held(self) -> int:
        return sum(s.length for s in self.segments)

    def allocate(self, tokens: tuple[int, ...]) -> Segment:
        """A new segment for ``tokens`` (its K/V to be written by the caller: `write`)."""
        n = len(tokens)
        start = self._gap(n)
        if start is None:
            self._rebuild(n)
            start = self._gap(n)
            assert start is not None
        segment = Segment(next(self._ids), tokens, start)
        self.segments.append(segment)
        self.segments.sort(key=lambda s: s.start)
        return segment

    def write(
        self, segment: Segment, src: KVCache, row: int, src_start: int, count: int, dst_offset: int
    ) -> None:
        """Copy ``count`` slots of row ``row`` of ``src`` from ``src_start`` into ``segment`` at
        ``dst_offset`` (every layer: values, and scales for an int8 cache)."""
        assert self.cache is not None
        at = segment.start + dst_offset
        for mine, theirs in zip(self.cache.layers, src.layers, strict=True):
            for dst, s in zip(mine.tensors(), theirs.tensors(), strict=True):
                dst[0, :, at : at + count].copy_(s[row, :, src_start : src_start + count])

    def copy_out(self, segment: Segment, count: int, dst: KVCache, row: int) -> None:
        """Copy the first ``count`` tokens of ``segment`` into row ``row`` of ``dst`` at slot 0."""
        assert self.cache is not None
        for mine, theirs in zip(self.cache.layers, dst.layers, strict=True):
            for s, d in zip(mine.tensors(), theirs.tensors(), strict=True):
                d[row, :, :count].copy_(s[0, :, segment.start : segment.start + count])

    def acquire(self, segment: Segment) -> None:
        segment.users += 1

    def release(self, segment: Segment) -> None:
        """One user fewer; the last one gone frees the segment's slots."""
        segment.users -= 1
        assert segment.users >= 0
        if segment.users == 0:
            self.segments.remove(segment)
            if not self.segments:  # nothing live: give the memory back
                self.cache = None
                release_freed_memory()
            elif self.capacity > 4 * max(64, self.tokens_held):  # mostly empty: pack what lives
                self._rebuild(0)
                release_freed_memory()

    def _gap(self, n: int) -> int | None:
        """The first free run of ``n`` slots, or None."""
        if self.cache is None:
            return None
        at = 0
        for s in self.segments:  # sorted by start
            if s.start - at >= n:
                return at
            at = max(at, s.end)
        return at if self.capacity - at >= n else None

    def _rebuild(self, need: int) -> None:
        """New buffers holding the live segments packed from slot 0, with room for ``need`` more."""
        live = self.tokens_held
        # The first segment gets what it needs; a store that must grow gets room for more.
        capacity = max(live + need, 64) if not live else int((live + need) * GROWTH)
        capacity = -(-capacity // 64) * 64
        m = self.model
        new = KVCache(m.config, 1, capacity, dtype=m.cache_dtype, device=m.device, layers=m.kv_layers,
                      rings=False)  # fmt: skip
        at = 0
        old = self.cache
        for s in self.segments:
            if old is not None:
                for before, after in zip(old.layers, new.layers, strict=True):
                    for src, dst in zip(before.tensors(), after.tensors(), strict=True):
                        dst[0, :, at : at + s.length].copy_(src[0, :, s.start : s.end])
            s.start = at
            at += s.length
        self.cache = new

    def region(self, segments: list[Segment]) -> tuple[int, int]:
        """The store slots ``[lo, hi)`` covering ``segments`` (what a step's attention reads)."""
        return min(s.start for s in segments), max(s.end for s in segments)


__all__ = ["PrefixStore", "Segment", "common_prefix"]
