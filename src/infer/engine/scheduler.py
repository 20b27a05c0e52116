"""Which requests run, in which rows, and what each iteration does: the plan.

`Scheduler` holds the waiting queue, the running requests (by row) and the counters; `schedule`
admits requests (the longest prefix of the prompt the engine holds wins), ends the cancelled ones
and makes the `infer.engine.plan.Plan`; `update` applies the output stage's result. The policy is
here and only here; KV slots change only through typed operations (`KVSlots.apply`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from infer.engine import chunks
from infer.engine.plan import Forward, Kind, Plan, Update
from infer.engine.request import Delta, Ending, Request, TokenLogprob
from infer.engine.sampling import exact_head
from infer.execution import MIN_PREFILL
from infer.kv.cache import KVModel, bucket
from infer.kv.ops import Reserve, Rollback, SetBound, SharePrefix, Shrink
from infer.kv.prefix import common_prefix
from infer.kv.slots import KVSlots
from infer.speculative import Proposal, Speculator

MIN_SHARED = 32  # prompt tokens a running request must share with a new one to be stored once for both
COUNTERS = ("requests", "finished", "prompt_tokens", "prefill_tokens", "cached_tokens", "generated_tokens",
            "steps", "batch_size")  # fmt: skip
SPEC_COUNTERS = ("spec_passes", "spec_proposed", "spec_accepted", "spec_tokens", "spec_steps")


@dataclass(frozen=True)
class Policy:
    """What the scheduler plans with: ``max_batch`` rows run at once; ``context`` bounds a row's
    tokens; an iteration reads ``chunk`` prompt tokens while requests decode (they wait for the
    forward), ``idle_chunk`` while none does (None: measured, `Scheduler`'s ``prompt_chunk``);
    ``per_forward``: tokens one forward may take at most
    (a streamed model's plan), None for any; ``bucketed``: the shapes of steps in powers of two
    (`compile=True`: a graph per shape), a decode step's window of rows and a prompt chunk's padding;
    ``exact_allowed``: a processed row may re-score its candidates exactly (not in a parallel run)."""

    max_batch: int
    context: int
    chunk: int
    idle_chunk: int | None
    per_forward: int | None = None
    bucketed: bool = False
    exact_allowed: bool = True


class Scheduler:
    """The waiting queue, the running requests and the counters of one engine (see the module's
    docstring), planning by ``policy``; ``speculator``: proposals for verify passes, None when
    speculation is off."""

    def __init__(
        self,
        slots: KVSlots[KVModel],
        policy: Policy,
        speculator: Speculator | None = None,
        prompt_chunk: Callable[[], int] | None = None,
    ) -> None:
        self.slots = slots
        self.policy = policy
        self.speculator = speculator
        self.prompt_chunk = (
            prompt_chunk  # ``idle_chunk`` when the policy leaves it None (the runner measures it)
        )
        self._measured: int | None = None
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.used: dict[int, float] = {}  # row -> when it was last used (least recently used is evicted)
        self.aborted = False  # `abort`: every request ends, those being admitted too
        names = COUNTERS + (SPEC_COUNTERS if speculator is not None else ())
        self.counters: dict[str, int] = dict.fromkeys(names, 0)

    # ---- the queue (the driver calls these with its lock held) ------------------------------------

    def enqueue(self, r: Request) -> None:
        self.waiting.append(r)
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(r.prompt)

    def full(self, bound: int) -> bool:
        """Whether the queue is at ``bound`` waiting requests (those free rows will take at the
        next step do not count as waiting)."""
        free = self.policy.max_batch - len(self.running)
        return len(self.waiting) >= bound + free

    def take_waiting(self) -> list[Request]:
        """The waiting requests the free rows take now, in order; those cancelled while they waited
        end here instead."""
        out: list[Request] = []
        while self.waiting and len(self.running) + len(out) < self.policy.max_batch:
            r = self.waiting.popleft()
            if r.handle.cancelled or self.aborted:
                self.end(r, "cancelled", ran=False)
            else:
                out.append(r)
        return out

    def abort(self) -> None:
        """End every request: those waiting and running are cancelled, those being admitted too."""
        self.aborted = True
        for r in [*self.waiting, *self.running.values()]:
            r.handle.cancelled = True

    def reap(self) -> None:
        """End cancelled requests now (no iteration runs: a caller stopped iterating early)."""
        for r in [r for r in self.waiting if r.handle.cancelled]:
            self.waiting.remove(r)
            self.end(r, "cancelled", ran=False)
        for r in [r for r in self.running.values() if r.handle.cancelled]:
            self.end(r, "cancelled")

    def fail(self, requests: Iterable[Request], error: BaseException) -> None:
        """An iteration failed (a bug, an interrupt): ``requests`` and every running request end."""
        for r in [*requests, *self.running.values()]:
            if not r.ended:
                self.end(r, "error", error)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def waiting_count(self) -> int:
        return len(self.waiting)

    def running_count(self) -> int:
        return len(self.running)

    # ---- schedule ---------------------------------------------------------------------------------

    def schedule(self, admitted: Sequence[Request] = ()) -> Plan:
        """This iteration's plan: ``admitted`` (from the waiting queue) take rows, cancelled requests
        end, then the decode step (or verify pass) of the decoding rows and the prompt chunks."""
        for r in admitted:
            try:
                self.admit(r)
            except Exception as e:
                self.end(r, "error", e)
        for r in list(self.running.values()):
            if r.handle.cancelled or self.aborted:
                self.end(r, "cancelled")
        self.resolve_waits()
        decoding = sorted(row for row, r in self.running.items() if r.decoding)
        forwards = self._decode(decoding) if decoding else []
        forwards += self._prefill(idle=not decoding)
        return Plan(self.slots.take_ops(), forwards)

    def admit(self, r: Request) -> None:
        """Give ``r`` a row and reuse what the engine holds of its prompt.

        The longest prefix of the prompt held anywhere wins: a free row's kept tokens (the
        prefix cache: ``r`` takes that row), or a running request's tokens, computed or still to
        be computed (``r`` shares them: `KVSlots.share_prefix`, stored once; or, while they are
        being computed, waits for them: `resolve_waits`), if at least `MIN_SHARED` tokens.
        Otherwise an empty row, else the least recently used, else (every row busy) a new one: KV
        memory follows the requests that ran at once, not the prompts seen (docs/engine.md).
        A request with hooks (`Request.hooks`) reuses nothing and its row is never reused."""
        slots = self.slots
        slots.check_hooks()  # K/V computed under other forward hooks are not reused
        busy = {q.row for q in self.running.values()}
        free = [i for i in range(slots.rows) if i not in busy]
        private = r.hooks is not None
        best, best_n = -1, 0
        limit = len(r.prompt) - 1  # the last prompt token is always fed (its logits pick the first token)
        for i in free:
            if private or not slots.reusable(i):
                continue
            n = min(common_prefix(slots.tokens(i), r.prompt), limit)
            if n > best_n:
                best, best_n = i, n
        lead, lead_n = -1, 0
        for i, q in self.running.items():
            if private or not slots.reusable(i):
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
                slots.apply(Reserve(best + 1, 1))  # a row; its slots grow as its prompt is read
        slots.apply(Rollback(best, best_n))
        if private:
            slots.stale.add(best)  # K/V computed under its hooks (`KVSlots.reusable`)
        r.row = best
        r.pending = r.prompt[best_n:]
        slots.apply(SetBound(best, len(slots.held[best]) + len(r.pending) + r.max_new))
        r.started = time.perf_counter()
        r.cached = best_n
        self.counters["cached_tokens"] += best_n
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
                slots.apply(SharePrefix(lead, n, r.row))
                r.pending = r.prompt[n:]
                r.cached = n
                self.counters["cached_tokens"] += n
                shared = True
            else:
                leader = self.running.get(lead)
                if leader is not None and leader is not r and (held + leader.pending)[:n] == r.prompt[:n]:
                    continue  # still being computed
            r.waits = None
        if shared:
            slots.apply(Shrink())  # the leader's long prompt moved to the store: its slots may go

    def _forward(
        self,
        kind: Kind,
        lo: int,
        hi: int,
        feeds: dict[int, list[int]],
        *,
        pad_to: int = 0,
        proposals: dict[int, Proposal] | None = None,
        drafting: dict[int, tuple[int, float]] | None = None,
        draft_reads: list[Request] | None = None,
        hooks: object = None,
    ) -> Forward:
        """A forward of ``kind`` over rows ``[lo, hi)`` feeding ``feeds`` to their running requests,
        with their lengths before it and the head they need (`exact_head`)."""
        requests = {i: self.running[i] for i in feeds}
        exact = exact_head(list(requests.values()), self.policy.exact_allowed, verify=kind == "verify")
        base = {i: self.slots.length(i) for i in feeds}
        return Forward(kind, lo, hi, feeds, exact, requests, base, pad_to, proposals or {}, drafting or {},
                       draft_reads or [], hooks)  # fmt: skip

    def _decode(self, rows: list[int]) -> list[Forward]:
        """The decode step of ``rows`` (ascending): each one's last sampled token; a verify pass of
        their proposals instead when the speculator finds one that pays. A request with hooks takes
        a step of its own first (its row alone, never a verify pass)."""
        running, slots = self.running, self.slots
        out = [self._forward("decode", i, i + 1, {i: running[i].pending}, hooks=running[i].hooks)
               for i in rows if running[i].hooks is not None]  # fmt: skip
        rows = [i for i in rows if running[i].hooks is None]
        if not rows:
            return out
        lo, hi = rows[0], rows[-1] + 1
        if self.speculator is not None:
            # A verify pass feeds every row of its span its width (the idle ones padding): the running
            # row nearest the end of the context bounds everyone's.
            room = min(self.policy.context - slots.length(i) for i in range(lo, hi) if i in running)
            lengths = {i: slots.length(i) for i in rows}
            proposed = self.speculator.propose([running[i] for i in rows], lengths, room)
            if proposed is not None:
                lookup = proposed.proposals
                feeds = {i: running[i].pending + (lookup[i].tokens if i in lookup else []) for i in rows}
                verify = self._forward("verify", lo, hi, feeds, proposals=lookup, drafting=proposed.drafting)
                return [*out, verify]
        if self.policy.bucketed:
            # A power-of-two window of rows around the decoding ones (few graphs, one per size),
            # not every allocated row: one stream among 16 idle rows computes 1 row, not 16.
            width = min(slots.rows, bucket(hi - lo))
            lo = min(lo, slots.rows - width)
            hi = lo + width
        return [*out, self._forward("decode", lo, hi, {i: running[i].pending for i in rows})]

    def _prefill(self, idle: bool) -> list[Forward]:
        """Chunks of the prompts being read: runs of contiguous rows, one forward each, up to the
        budget's tokens in all: a short chunk while streams decode (they wait for it), a long one
        when nobody waits (``idle``: each packed weight dequantized once for more tokens). A request
        with hooks reads its prompt in forwards of its own (its row alone, unpadded)."""
        running, b = self.running, self.policy
        reading = sorted(row for row, r in running.items() if not r.decoding and r.waits is None)
        groups: list[list[int]] = []
        for i in reading:
            plain = running[i].hooks is None
            if groups and groups[-1][-1] == i - 1 and plain and running[groups[-1][0]].hooks is None:
                groups[-1].append(i)
            else:
                groups.append([i])
        left = self._idle_chunk(sum(len(running[i].pending) for i in reading)) if idle else b.chunk
        forwards = []
        for group in groups:
            if left <= 0:
                break
            # The chunk bounds the tokens of the forward, not of each row: a burst of new prompts
            # shares it, so the running streams never wait for more than one chunk's forward.
            T = min(max(1, left // len(group)), max(len(running[i].pending) for i in group))
            if b.per_forward is not None:
                T = max(1, min(T, b.per_forward // len(group)))
            feeds = {i: running[i].pending[:T] for i in group}
            hooks = running[group[0]].hooks
            reads: list[Request] = []
            if self.speculator is not None and hooks is None:  # a draft reads the prompts that end here
                ending = [running[i] for i in group if len(running[i].pending) <= T]
                reads = self.speculator.draft_reads(ending)
            pad_to = 0
            if b.bucketed and hooks is None:
                pad_to = bucket(T, MIN_PREFILL) if T > 1 else 1
            forwards.append(self._forward("prefill", group[0], group[-1] + 1, feeds, pad_to=pad_to,
                                          draft_reads=reads, hooks=hooks))  # fmt: skip
            left -= sum(len(t) for t in feeds.values())
        return forwards

    def _idle_chunk(self, pending: int) -> int:
        """The policy's ``idle_chunk``, else the measured one (`infer.engine.chunks`), measured the
        first time the prompts being read are longer than the shortest chunk measured."""
        if self.policy.idle_chunk is not None:
            return self.policy.idle_chunk
        if self._measured is None:
            if pending <= chunks.CANDIDATES[0] or self.prompt_chunk is None:
                return max(pending, chunks.CANDIDATES[0]) if self.prompt_chunk else chunks.DEFAULT
            self._measured = self.prompt_chunk()
        return self._measured

    # ---- update -----------------------------------------------------------------------------------

    def update(self, update: Update) -> None:
        """Apply what the output stage made of the plan: rows rolled back to what their requests took,
        the ended requests' rows freed and their final events sent, the counters counted, the cost of
        the decode step (or verify pass) noted for the speculator."""
        for row, length in update.keep.items():
            if length < self.slots.length(row):
                self.slots.apply(Rollback(row, length))
        for e in update.ended:
            self.end(e.request, e.reason, e.error, e.tokens, e.logprobs, e.detail)
        c = self.counters
        c["generated_tokens"] += update.generated
        c["prefill_tokens"] += update.prefilled
        c["steps"] += update.steps
        if update.batch is not None:
            c["batch_size"] = update.batch
        if self.speculator is not None:
            for rows, width, seconds, given in update.costs:
                self.speculator.observe(rows, width, seconds, given)
            c["spec_steps"] += update.verified
            for p in update.passes:
                c["spec_passes"] += 1
                c["spec_proposed"] += p.proposed
                c["spec_accepted"] += p.kept
                c["spec_tokens"] += p.taken

    def end(
        self,
        r: Request,
        reason: str,
        error: BaseException | None = None,
        tokens: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
        detail: str | None = None,
        ran: bool = True,
    ) -> None:
        """End ``r`` with ``reason`` ("stop", "length", "error", "cancelled"): its row is free (its
        tokens stay for the prefix cache), then its final event goes to its handle. ``ran``: it was
        taken from the queue (not cancelled while it waited): a finished request, with its timings."""
        now = time.perf_counter()
        if self.running.get(r.row) is r:
            del self.running[r.row]
            self.used[r.row] = now
            if r.row < len(self.slots.bounds):
                self.slots.apply(SetBound(r.row, 0))
        ending = None
        if ran:
            start, first = r.started or now, r.first or now
            ending = Ending(detail or reason, error, first - start, now - first)
            self.counters["finished"] += 1
        r.end(Delta(tokens or [], "", logprobs, reason, None if error is None else str(error)), ending)

    def stats(self) -> dict[str, float | int]:
        """The counters, and with speculation the rates they give."""
        out: dict[str, float | int] = dict(self.counters)
        out.update(running=len(self.running), waiting=len(self.waiting))
        if self.speculator is not None:
            c = self.counters
            out["spec_acceptance"] = c["spec_accepted"] / c["spec_proposed"] if c["spec_proposed"] else 0.0
            out["spec_tokens_per_pass"] = c["spec_tokens"] / c["spec_passes"] if c["spec_passes"] else 0.0
        return out


__all__ = ["MIN_SHARED", "Policy", "Scheduler"]
