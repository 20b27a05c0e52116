"""Which requests run, in which rows, and what each step feeds them.

`Scheduler` holds the waiting queue and the running requests (by row). Each iteration it admits
waiting requests into rows (`admit`: the longest prefix of the prompt the engine already holds
wins: a free row's kept tokens, the prefix cache; or a running request's, shared), lets requests
that waited for another's prompt take it (`resolve_waits`), and plans the step: the decoding rows
(`decoding`) and the prompt chunks (`prefill_groups`: runs of contiguous rows, a token budget per
iteration). It asks `KVSlots` for rows and prefixes; it never runs the model.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from infer.engine.request import Request
from infer.engine.slots import KVSlots
from infer.speculative.state import common_prefix

MIN_SHARED = 32  # prompt tokens a running request must share with a new one to be stored once for both


class Scheduler:
    """The waiting queue and the running requests of one engine (see the module's docstring).

    ``max_batch`` rows run at once; ``stats`` is the engine's counters (``cached_tokens`` here).
    """

    def __init__(self, slots: KVSlots, max_batch: int, max_waiting: int, stats: dict[str, float]) -> None:
        self.slots = slots
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.stats = stats
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.used: dict[int, float] = {}  # row -> when it was last used (least recently used is evicted)

    def full(self, bound: int) -> bool:
        """Whether the queue is at ``bound`` waiting requests (those free rows will take at the
        next step do not count as waiting)."""
        free = self.max_batch - len(self.running)
        return len(self.waiting) >= bound + free

    def take_waiting(self, dropped: Callable[[Request], bool]) -> list[Request]:
        """The waiting requests the free rows take now, in order (``dropped(r)``: ``r`` was cancelled
        while it waited and is not taken; that function ends it)."""
        out: list[Request] = []
        while self.waiting and len(self.running) + len(out) < self.max_batch:
            r = self.waiting.popleft()
            if not dropped(r):
                out.append(r)
        return out

    def release(self, r: Request) -> None:
        """``r`` ended: its row is free (its tokens stay for the prefix cache)."""
        if self.running.get(r.row) is r:
            del self.running[r.row]
            self.used[r.row] = time.perf_counter()
            if r.row < len(self.slots.bounds):
                self.slots.set_bound(r.row, 0)

    def admit(self, r: Request) -> None:
        """Give ``r`` a row and reuse what the engine holds of its prompt.

        The longest prefix of the prompt held anywhere wins: a free row's kept tokens (the
        prefix cache: ``r`` takes that row), or a running request's tokens, computed or still to
        be computed (``r`` shares them: `KVSlots.share_prefix`, stored once; or, while they are
        being computed, waits for them: `resolve_waits`), if at least `MIN_SHARED` tokens.
        Otherwise an empty row, else the least recently used, else (every row busy) a new one.

        Rows are added only when every row is busy, so the KV memory follows the number of
        requests that ran at once, not the number of different prompts seen: sequential calls
        with unrelated 4,096-token prompts kept 16 rows (2.4 GB for Gemma 3 270M) when a new row
        was preferred to a kept prefix."""
        slots = self.slots
        slots.check_hooks()  # K/V computed under other forward hooks are not reused
        busy = {q.row for q in self.running.values()}
        free = [i for i in range(slots.rows) if i not in busy]
        best, best_n = -1, 0
        limit = len(r.prompt) - 1  # the last prompt token is always fed (its logits pick the first token)
        for i in free:
            if not slots.reusable(i):
                continue
            n = min(common_prefix(slots.tokens(i), r.prompt), limit)
            if n > best_n:
                best, best_n = i, n
        lead, lead_n = -1, 0
        for i, q in self.running.items():
            if not slots.reusable(i):
                continue
            n = min(common_prefix(slots.tokens(i) + q.pending, r.prompt), limit)
            stored = slots.offset(i)
            if stored and n < stored + MIN_SHARED:
                n = min(n, stored)  # the row's own segment: no second copy for a few more tokens
            if n > lead_n:
                lead, lead_n = i, n
        if lead_n >= MIN_SHARED and lead_n > best_n:
            best, best_n = -1, 0  # shared with the running request instead of a kept row
        else:
            lead = -1
        if best < 0:
            empty = [i for i in free if not slots.held[i] and slots.prefix[i] is None]
            if empty:
                best = empty[0]
            elif free:
                best = min(free, key=lambda i: self.used.get(i, 0.0))
            else:  # every row busy (`take_waiting` admits at most max_batch)
                best = slots.rows
                slots.reserve(best + 1, 1)  # a row; its slots grow as its prompt is read
        slots.rollback(best, best_n)
        r.row = best
        r.pending = r.prompt[best_n:]
        slots.set_bound(best, len(slots.held[best]) + len(r.pending) + r.max_new)
        r.started = time.perf_counter()
        r.handle.admitted = r.started
        r.handle.cached = best_n
        self.stats["cached_tokens"] += best_n
        self.running[best] = r
        if lead >= 0:
            r.waits = (lead, lead_n)
            self.resolve_waits()

    def resolve_waits(self) -> None:
        """Requests waiting for a prefix another request computes take it once it is computed
        (shared: `KVSlots.share_prefix`); if that request went away first, they compute it."""
        slots = self.slots
        shared = False
        for r in self.running.values():
            if r.waits is None:
                continue
            lead, n = r.waits
            held = slots.tokens(lead)
            if len(held) >= n and held[:n] == r.prompt[:n]:
                slots.share_prefix(lead, n, r.row)
                r.pending = r.prompt[n:]
                r.handle.cached = n
                self.stats["cached_tokens"] += n
                shared = True
            else:
                leader = self.running.get(lead)
                if leader is not None and leader is not r and (held + leader.pending)[:n] == r.prompt[:n]:
                    continue  # still being computed
            r.waits = None
        if shared:
            slots.shrink()  # the leader's long prompt moved to the store: its slots may go

    def decoding(self) -> list[int]:
        """The rows that take their next token this step, ascending."""
        return sorted(row for row, r in self.running.items() if r.decoding)

    def prefill_groups(self) -> list[list[int]]:
        """The rows still reading their prompts, as runs of contiguous rows (one forward each)."""
        self.resolve_waits()
        reading = sorted(row for row, r in self.running.items() if not r.decoding and r.waits is None)
        groups: list[list[int]] = []
        for i in reading:
            if groups and groups[-1][-1] == i - 1:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups


__all__ = ["MIN_SHARED", "Scheduler"]
