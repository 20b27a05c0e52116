"""The generation engine: one loop owns a loaded model and steps every running request together.

`Engine` owns the model, its KV slots (`KVSlots`) and every request; one thread at a time runs
its loop (the **driver**). A caller that waits for its tokens in plain Python (iterating a
`RequestHandle`: `LLM.generate`, `stream`, `chat`, the CLI) drives the loop itself while
nobody else does, so the model runs on the caller's thread: torch's OpenMP workers spin
between the regions of the thread that last used them, and a step issued from another thread
paid ~2x per small op at 2 threads (docs/performance.md). Callers that cannot block
(`Engine.submit`, asyncio's `RequestHandle.aiter`: the server) get a background thread
(started on demand, gone after `IDLE_EXIT_S` idle) that drives whenever no caller does.
Each iteration:

1. requests cancelled since the last step leave (their rows are free at once);
2. waiting requests join, each on a free row — preferably the one whose kept tokens share
   the longest prefix with its prompt (**prefix caching**: a finished request's KV stays in
   its row until the row is needed, as llama.cpp keeps a slot's prompt, so a repeated system
   prompt or the earlier turns of a chat are not computed again);
3. one **decode step** feeds the last sampled token of every decoding row: one batched
   forward over the contiguous rows ``[lo, hi)`` that hold them (each weight read once per
   step for the whole batch), rows without a token this step pass ``n_new = 0``;
4. **chunked prefill**: prompts still being read get at most `Engine.prefill_chunk` tokens per
   iteration (contiguous prefilling rows in one forward), so running streams never wait for
   a whole long prompt;
5. each row's logits are sampled with its own parameters and generator (`infer.step.sample`),
   stop conditions are checked, and one `Delta` per request goes to its `RequestHandle`.

`KVSlots` is also the low-level API for speculative decoding: `KVSlots.verify` feeds several
proposed tokens of a row in one step and returns the logits of each, and `KVSlots.rollback`
truncates a row back to an earlier length (a row's keys are addressed by slot; what lies past
its length is masked and overwritten by what is fed next).

Numerics: in the deterministic mode (``infer.load(..., deterministic=True)``) a row's
tokens and logits do not depend on the other rows of a step, on how its prompt was chunked
or on which row it runs in, so a request's output is bitwise the same alone or among other
requests (docs/numerics.md); in the default mode it is within float32 rounding.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from infer.cache import KEY_CHUNK, KVCache, LayerKV, SharedPrefix, round_up
from infer.generate import (
    NonFiniteLogitsError,
    TextStream,
    check_float,
    check_int,
    cut_at_stop,
    row_generator,
    row_noise,
)
from infer.generate import (
    SamplingParams as _Values,
)
from infer.models.base import DecoderLM
from infer.pages import release_freed_memory
from infer.speculative import MAX_TOKENS as MAX_SPECULATIVE
from infer.speculative import NoiseQueue, RowState, Speculative, Speculator, common_prefix
from infer.step import (
    MIN_PREFILL,
    Sampling,
    SamplingValues,
    StepFeed,
    StepOutput,
    Stepper,
    sample,
    sampling_inputs,
)
from infer.structured import PENALTY_MAX, Constraint, Grammars, RowProcessor, check_logit_bias, narrow
from infer.threads import release_openmp_workers

if TYPE_CHECKING:
    from infer.loader.tokenizer import Tokenizer
    from infer.prefix import Segment


class LLM(Protocol):
    """What the engine needs of a loaded model (`infer.api.LLM`, which makes the engine, has it;
    the engine sits below the API and does not import it)."""

    model: DecoderLM
    stepper: Stepper
    tokenizer: Tokenizer
    speculative: Speculative | None  # speculative decoding (`infer.speculative`), None: off

    def _eos_ids(self) -> Sequence[int]: ...

    def _encode(self, prompt: str | list[int], what: str) -> list[int]: ...


MIN_SLOTS = 64  # the KV capacity grows from here (up to the context)
MIN_SHARED = 32  # prompt tokens a running request must share with a new one to be stored once for both
IDLE_EXIT_S = 2.0  # the loop thread ends after this long without work (the next submit starts one)
HANDOVER_S = 0.005  # a caller waiting for another thread's iteration checks this often whether to drive
MAX_LOGPROBS = 20  # top alternatives per token at most (OpenAI's limit)
RESCORED = 64  # a greedy processed row's best allowed tokens re-scored exactly (`Engine._process`)
# Greedy processed rows in a step up to which they re-score their candidates; with more, the step
# computes the exact head (one product for every row costs less than many rows' re-scoring).
RESCORED_ROWS = 2
# Slots a row gets beyond its request's prompt + max_tokens (`KVSlots.bound`): a speculative
# verify pass writes its whole draft before the rejected tokens are rolled back.
BOUND_MARGIN = MAX_SPECULATIVE


_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _stop_loops() -> None:
    """At interpreter exit: end every engine's loop thread (cancelling what runs) and wait for it,
    so no thread is inside torch while the interpreter finalizes."""
    for engine in list(_ENGINES):
        engine.close(drain=False, timeout=30.0)


@dataclass(frozen=True)
class SamplingParams:
    """One request's generation settings, checked on construction (errors name the field)."""

    max_tokens: int = 256  # new tokens at most
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings (text is cut before them)
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS ids
    logprobs: int | None = None  # None: none; 0: the chosen token's; k>0: also the top k alternatives
    ignore_eos: bool = False
    constraint: Constraint | None = None  # the text must match it (`infer.structured`)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a dict is taken too
    presence_penalty: float = 0.0  # in [-2, 2], OpenAI's
    frequency_penalty: float = 0.0  # in [-2, 2], OpenAI's
    repetition_penalty: float = 1.0  # > 0, 1 = off (vLLM's and transformers')
    speculative: int | None = None  # tokens proposed per pass at most (None: the model's setting; 0: off)

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_tokens", check_int("max_tokens", self.max_tokens, 1))
        values = _Values(self.temperature, self.top_k, self.top_p, self.seed)  # checks and normalizes
        object.__setattr__(self, "temperature", values.temperature)
        object.__setattr__(self, "top_k", values.top_k)
        object.__setattr__(self, "top_p", values.top_p)
        object.__setattr__(self, "seed", values.seed)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, list | tuple):
            raise TypeError(f"stop_token_ids must be a list of ints, got {type(ids).__name__}")
        object.__setattr__(self, "stop_token_ids", tuple(check_int("stop_token_ids", i, 0) for i in ids))
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise TypeError(f"constraint must be an infer.structured.Constraint, got {self.constraint!r}")
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            value = check_float(name, getattr(self, name))
            if not -PENALTY_MAX <= value <= PENALTY_MAX:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            object.__setattr__(self, name, value)
        repetition = check_float("repetition_penalty", self.repetition_penalty)
        if repetition <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 is off), got {repetition}")
        object.__setattr__(self, "repetition_penalty", repetition)
        if self.speculative is not None:
            check_int("speculative", self.speculative, 0, MAX_SPECULATIVE)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processed(self) -> bool:
        """Whether the row's logits are processed (a constraint, a bias or a penalty): see `RowProcessor`."""
        return (
            self.constraint is not None
            or bool(self.logit_bias)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass
class _RowValues:
    """One row's sampling values for a host-side draw (`Engine._process`)."""

    temperature: float
    top_k: int
    top_p: float


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first; empty unless logprobs > 0


@dataclass
class Delta:
    """One event of a request's stream."""

    token_ids: list[int]  # new tokens in this event (may be empty on the final event)
    text: str  # new text (stop-string hold-back applied: see docs/reliability.md)
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # None while running; then "stop", "length", "error", "cancelled"
    error: str | None = None  # set when finish_reason == "error"


class EngineFull(Exception):
    """`Engine.submit` when the waiting queue is at its bound (retry later)."""


class EngineClosed(RuntimeError):
    """`Engine.submit` after `Engine.close`."""


class RequestHandle:
    """A submitted request: iterate it for its `Delta` events; `cancel` ends it within one step.

    After the final event: ``token_ids`` (every generated token), ``finish_detail`` ("eos" when an
    EOS id ended it, else the finish reason), ``prefill_seconds`` / ``decode_seconds`` (admission
    to first token, first token to end), ``prefilled`` (prompt tokens computed) and ``cached``
    (prompt tokens whose KV was reused from an earlier request: the prefix cache).
    """

    def __init__(self, request_id: str, prompt_tokens: int, engine: Engine) -> None:
        self.id = request_id
        self.prompt_tokens = prompt_tokens
        self._engine = engine
        self._events: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue[Delta]] | None = None
        self._cancelled = False
        self.done = False
        self.token_ids: list[int] = []
        self.finish_detail: str | None = None
        self.exception: BaseException | None = None
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.prefilled = 0
        self.cached = 0

    def __iter__(self) -> Iterator[Delta]:
        """The events in order. While nobody else runs the engine's loop, the iterating thread
        runs it (every running request advances, not only this one)."""
        while not self.done:
            delta = self._engine._next_event(self)
            if delta.finish_reason is not None:
                self.done = True
            yield delta

    async def aiter(self) -> AsyncIterator[Delta]:
        """The events for asyncio code: ``async for delta in handle.aiter()`` (no thread per request:
        the engine's thread hands each event to this event loop)."""
        events: asyncio.Queue[Delta] = asyncio.Queue()
        with self._lock:
            while True:
                try:
                    events.put_nowait(self._events.get_nowait())
                except queue.Empty:
                    break
            self._async = (asyncio.get_running_loop(), events)
        with self._engine._cond:
            self._engine._start_locked()  # never run the model on the event loop's thread
        # The engine's thread runs the steps: this thread's OpenMP workers (left from loading the
        # model here, say) would halve their speed (`infer.threads`).
        release_openmp_workers()
        try:
            while not self.done:
                delta = await events.get()
                if delta.finish_reason is not None:
                    self.done = True
                yield delta
        finally:
            if not self.done:
                self.cancel()

    def _put(self, delta: Delta) -> None:
        with self._lock:
            if self._async is None:
                self._events.put(delta)
                return
            loop, events = self._async
        try:
            loop.call_soon_threadsafe(events.put_nowait, delta)
        except RuntimeError:  # the event loop is closed: nobody reads this request any more
            self.cancel()

    def cancel(self) -> None:
        """End the request: its row is freed at the next step; the stream ends with "cancelled"."""
        if not self._cancelled:
            self._cancelled = True
            self._engine._wake()


@dataclass
class _Request:
    handle: RequestHandle
    prompt: list[int]
    params: SamplingParams
    max_new: int  # max_tokens, less when the context ends first
    eos: frozenset[int]
    text: bool  # text deltas (with stop hold-back) while running
    generator: torch.Generator | None
    submitted: float
    row: int = -1
    pending: list[int] = field(default_factory=list)  # tokens to feed next
    generated: list[int] = field(default_factory=list)
    stream: TextStream | None = None  # the text sent so far (with `text`)
    started: float = 0.0  # admitted
    first: float = 0.0  # first token
    ended: bool = False  # its final event is sent
    # (row, n): the first n prompt tokens are being computed by the request in that row; this one
    # waits for them and then shares them (`Engine._resolve_waits`) instead of computing them too.
    waits: tuple[int, int] | None = None
    processor: RowProcessor | None = None  # constraint, bias, penalties (`infer.structured`)
    # With speculation on: a sampled request's noise, token by token, drawn from ``generator``
    # (a verify pass reads ahead and gives back the rows of rejected positions).
    noise: NoiseQueue | None = None
    spec: RowState | None = None  # its speculation state (`infer.speculative`), made on first use

    @property
    def decoding(self) -> bool:
        return bool(self.generated)


class KVSlots:
    """The engine's KV memory: up to ``max_rows`` rows of ``context`` slots each, allocated on
    demand, and the prefixes rows share (`infer.prefix.PrefixStore`).

    One `KVCache` of rows (every slot of every layer in slot order, no rings, so a row can be
    rolled back) grows as rows and lengths are needed: capacities a quarter above what the
    longest row needs, in whole key chunks (powers of two under ``compile=True``), from
    `MIN_SLOTS` up to ``context``, rows up to ``max_rows``; growing copies what is kept.
    A row holds the tokens of one sequence: the first ``n`` tokens of a shared segment
    (``prefix[r] = (segment, n)``, read from the store) and then its own, ``held[r]``, in its
    slots from slot 0 (its positions continue at ``n``: ``pad[r] = -n``). `tokens` is the whole
    sequence. Memory: ``rows x capacity x`` `bytes_per_token` plus the store's segments.
    """

    def __init__(
        self,
        model: DecoderLM,
        max_rows: int,
        context: int,
        stepper: Stepper | None = None,
        share: bool | None = None,
    ) -> None:
        from infer.prefix import PrefixStore, shares_prefixes

        self.model = model
        self.max_rows = max_rows
        self.context = context
        self.stepper = stepper if stepper is not None else Stepper(model)
        self.cache: KVCache | None = None
        self.held: list[list[int]] = []
        self.prefix: list[tuple[Segment, int] | None] = []
        # Per row, the most tokens it may hold while its request runs (0: no request; it holds
        # ``held``): the engine sets it at admission (prompt + max_tokens), so capacity stops there.
        self.bounds: list[int] = []
        # Prefixes shared between rows are stored once (`infer.prefix`); where attention cannot
        # read a shared prefix (the deterministic mode, ...), a prefix is copied into the row.
        self.share = shares_prefixes(model) if share is None else share
        self.store = PrefixStore(model)
        self._views: dict[tuple[int, int], KVCache] = {}

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
            if self.stepper.bucketed:  # powers of two: few graphs for `compile=True`
                capacity = 1 << (want - 1).bit_length()
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
        """The most tokens any row may hold, when the engine set `bounds` (None: unknown, as for
        the slots a caller steps itself): a running request's bound, or what an idle row holds,
        and a speculative draft's tokens on top."""
        if not any(self.bounds):
            return None
        rows = range(len(self.held))
        return max(self.bounds[r] or len(self.held[r]) for r in rows) + BOUND_MARGIN

    def _replace(self, rows: int, capacity: int, keep: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Swap the cache for one of ``rows x capacity`` slots, ``keep(old, new)`` copying each
        buffer of what is held. Layer by layer, each old layer freed once copied: the peak is the
        new cache plus one old layer, not both caches (docs/engine.md, *KV memory*)."""
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
        """Give back slots no row needs: when every row's own tokens fit in a quarter of the
        capacity (a long prompt whose start went to a shared segment), halve it until they fit in
        half (powers of two, at least `MIN_SLOTS`), copying what the rows hold."""
        if self.cache is None:
            return
        need = max((len(h) for h in self.held), default=0)
        capacity = self.capacity
        if capacity <= MIN_SLOTS or 4 * need > capacity:
            return
        while capacity > MIN_SLOTS and 2 * need <= capacity // 2:
            capacity //= 2
        if not self.stepper.bucketed:
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

    def rollback(self, row: int, length: int) -> None:
        """Truncate ``row`` to the first ``length`` tokens of its sequence: later steps continue
        from there as if nothing past them had been fed (a shared prefix may be cut too: the row
        then uses fewer of its tokens)."""
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

    def share_prefix(self, src: int, count: int, dst: int) -> None:
        """Row ``dst`` (empty) continues the first ``count`` tokens of row ``src``'s sequence,
        without computing them: stored once and read by both rows (sharing), else copied.

        Sharing: a segment of those tokens is made unless ``src`` already reads one that long;
        ``src`` then reads its start from the segment too and its own slots shift down (so the
        tokens are held once)."""
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

    def _fit(self, lo: int, hi: int, T: int, feeds: dict[int, list[int]]) -> None:
        """Make every row of ``[lo, hi)`` able to take a ``T``-token step (padding included):
        grow the capacity, or cut an idle row's kept tokens that would pass the context."""
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

    def _bind(self, lo: int, hi: int) -> KVCache:
        """The view of rows ``[lo, hi)`` ready for a step: lengths and the shared prefix set."""
        view = self.view(lo, hi)
        view.length = max(len(self.held[r]) for r in range(lo, hi))
        view.first = min(len(self.held[r]) for r in range(lo, hi))
        view.shared = self._shared(lo, hi)
        return view

    def step(
        self,
        lo: int,
        hi: int,
        feeds: dict[int, list[int]],
        mode: Sampling,
        values: SamplingValues | None,
        noise: torch.Tensor | None,
        pad_to: int = 0,
    ) -> StepOutput:
        """One forward over rows ``[lo, hi)``: row ``r`` in ``feeds`` is fed ``feeds[r]``, the
        others nothing; each row's last fed token goes through the head and sampling."""
        T = max(len(t) for t in feeds.values())
        if pad_to > T and all(self.length(r) + pad_to <= self.context for r in range(lo, hi)):
            T = pad_to
        self._fit(lo, hi, T, feeds)
        B = hi - lo
        rows = [feeds.get(r, []) for r in range(lo, hi)]
        device = self.model.device
        if T == 1:
            ids = torch.tensor([t or [0] for t in rows], dtype=torch.long).to(device)
        else:
            ids = torch.tensor([t + [0] * (T - len(t)) for t in rows], dtype=torch.long).to(device)
        counts = [len(t) for t in rows]
        n_new = torch.tensor(counts, dtype=torch.long).to(device)
        last = (n_new - 1).clamp_min(0)
        feed = StepFeed(ids, n_new, last, mode, values, noise)
        view = self._bind(lo, hi)
        assert view.batch_size == B
        try:
            out = self.stepper(view, feed)
        except BaseException:
            # A step that failed after the cache advanced (in the head, say) must not leave the
            # rows' slots past what `held` lists: put them back.
            lengths = [len(self.held[r]) for r in range(lo, hi)]
            view.slot.copy_(torch.tensor(lengths, dtype=torch.long, device=view.slot.device))
            raise
        finally:
            view.shared = None
        for r, t in feeds.items():
            self.held[r].extend(t)
        return out

    def verify(self, row: int, tokens: Sequence[int]) -> torch.Tensor:
        """Feed ``tokens`` (k >= 1) to ``row`` in one step; the logits after each: ``[k, V]`` float32.

        Logit ``i`` predicts the token after ``tokens[i]``. Roll back with `rollback`.
        """
        if len(tokens) < 1:
            raise ValueError("verify: tokens must hold at least one token")
        return self.verify_rows(row, row + 1, {row: list(tokens)})[row]

    @torch.inference_mode()
    def verify_rows(
        self, lo: int, hi: int, feeds: dict[int, list[int]], greedy: bool = False
    ) -> dict[int, torch.Tensor]:
        """One forward over rows ``[lo, hi)``: row ``r`` in ``feeds`` is fed ``feeds[r]`` (>= 1
        token), the others nothing; the logits after every fed token, ``{r: [len(feeds[r]), V]}``
        float32 (logit ``i`` predicts the token after ``feeds[r][i]``). ``greedy``: only each
        row's argmax must be exact (a packed head then scans less). Eager, like a prefill chunk
        (rows read their shared prefixes as a step does): in the deterministic mode each row's
        logits are bitwise its one-token steps'."""
        T = max(len(t) for t in feeds.values())
        self._fit(lo, hi, T, feeds)
        rows = [feeds.get(r, []) for r in range(lo, hi)]
        device = self.model.device
        ids = torch.tensor([t + [0] * (T - len(t)) for t in rows], dtype=torch.long).to(device)
        n_new = torch.tensor([len(t) for t in rows], dtype=torch.long).to(device)
        fed = torch.tensor([b * T + j for b, t in enumerate(rows) for j in range(len(t))], dtype=torch.long)
        view = self._bind(lo, hi)
        try:
            h = self.model.hidden(ids, view, None, n_new)  # [B, T, D]
            h = h.reshape(-1, h.shape[-1])[fed.to(device)][None]  # [1, N, D]: the fed tokens only
            logits = self.model.head(h, greedy=greedy)[0].float()  # [N, V]
        except BaseException:
            lengths = [len(self.held[r]) for r in range(lo, hi)]
            view.slot.copy_(torch.tensor(lengths, dtype=torch.long, device=view.slot.device))
            raise
        finally:
            view.shared = None
        out: dict[int, torch.Tensor] = {}
        start = 0
        for r in range(lo, hi):
            t = feeds.get(r)
            if t:
                self.held[r].extend(t)
                out[r] = logits[start : start + len(t)]
                start += len(t)
        return out


class Engine:
    """Continuous batching over one loaded model (see the module's docstring).

    ``max_batch`` rows run at once (KV memory at most ``max_batch x context x`` bytes per token:
    `KVSlots`); at most ``max_waiting`` requests wait for a row (`EngineFull` past that);
    ``context`` (default the model's) bounds prompt + generated tokens of a request;
    ``prefill_chunk`` bounds the prompt tokens read per iteration while other requests decode
    (their next token waits for that forward), ``idle_prefill_chunk`` while none does.
    """

    def __init__(
        self,
        llm: LLM,
        *,
        max_batch: int = 16,
        max_waiting: int = 64,
        context: int | None = None,
        prefill_chunk: int = 256,
        idle_prefill_chunk: int = 2048,
    ) -> None:
        model = llm.model
        check_int("max_batch", max_batch, 1)
        check_int("max_waiting", max_waiting, 0)
        check_int("prefill_chunk", prefill_chunk, 1)
        check_int("idle_prefill_chunk", idle_prefill_chunk, 1)
        limit = model.config.max_position_embeddings
        if context is not None:
            limit = min(limit, check_int("context", context, 2))
        per_forward = None
        limits = getattr(model.executor, "limits", None)
        if limits is not None:  # a streamed model planned its memory for these
            max_batch = min(max_batch, limits.max_batch_size)
            limit = min(limit, limits.max_context)
            per_forward = limits.max_batch_size * limits.max_prefill_tokens
            prefill_chunk = min(prefill_chunk, per_forward)
            idle_prefill_chunk = min(idle_prefill_chunk, per_forward)
        self.llm = llm
        self.model = model
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.context = limit
        self.prefill_chunk = prefill_chunk
        self.idle_prefill_chunk = idle_prefill_chunk
        self._per_forward = per_forward
        self.slots = KVSlots(model, max_batch, limit, llm.stepper)
        self._spec: Speculator | None = None
        if llm.speculative is not None:
            draft, draft_slots = llm.speculative.draft, None
            if draft is not None:  # the draft model's KV: one row per row here (never shared)
                room = min(limit, draft.model.config.max_position_embeddings)
                draft_slots = KVSlots(draft.model, max_batch, room, draft.stepper, share=False)
            self._spec = Speculator(llm.speculative, self.slots, limit, per_forward, draft_slots)
        self._eos = frozenset(llm._eos_ids())
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._running: dict[int, _Request] = {}
        self._thread: threading.Thread | None = None
        self._driver: threading.Thread | None = None  # the thread running an iteration now
        self._closed = False
        self._abort = False  # close(drain=False): end everything
        self._parked = False  # the loop thread waits for work, holding no reference to the engine
        self._ids = itertools.count()
        self._used: dict[int, float] = {}  # row -> when it was last used (least recently used is evicted)
        self._greedy = _Values()
        self._grammars: Grammars | None = None  # built on the first constrained request
        _ENGINES.add(self)
        self._stats: dict[str, float] = {
            "requests": 0, "finished": 0, "prompt_tokens": 0, "prefill_tokens": 0, "cached_tokens": 0,
            "generated_tokens": 0, "steps": 0, "batch_size": 0,
        }  # fmt: skip

    # ---- callers' side (any thread) ------------------------------------------------------

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None) -> RequestHandle:
        """Queue a request (thread-safe). `ValueError` for a bad prompt or one too long for the
        context, `EngineFull` when the waiting queue is full, `EngineClosed` after `close`."""
        return self._submit([prompt], [params or SamplingParams()], text=True, wait=False, drive=False)[0]

    def _submit(
        self,
        prompts: Sequence[str | list[int]],
        params: Sequence[SamplingParams],
        *,
        text: bool,
        wait: bool,
        drive: bool = False,
    ) -> list[RequestHandle]:
        """Queue ``prompts`` in order; those that fit join the same step. ``wait``: block for room
        instead of raising `EngineFull`. ``drive``: the caller will iterate the handles (and so
        run the loop itself), so no background thread is started for them."""
        if params and not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("params must be infer.engine.SamplingParams")
        ids = [
            self.llm._encode(p, "prompt" if len(prompts) == 1 else f"prompt {i}")
            for i, p in enumerate(prompts)
        ]
        requests = []
        for i, (toks, p) in enumerate(zip(ids, params, strict=True)):
            if len(toks) + 1 > self.context:
                where = "prompt" if len(prompts) == 1 else f"prompt {i}"
                raise ValueError(
                    f"{where} has {len(toks)} tokens; the model's context is {self.context} tokens"
                )
            processor = self._processor(toks, p) if p.processed else None
            handle = RequestHandle(f"req-{next(self._ids)}", len(toks), self)
            generator = None if p.greedy else row_generator(p.seed, self.model.device)
            eos = frozenset(p.stop_token_ids) if p.ignore_eos else self._eos | set(p.stop_token_ids)
            requests.append(
                _Request(handle, toks, p, min(p.max_tokens, self.context - len(toks)), eos, text, generator,
                         time.perf_counter(), stream=TextStream(self.llm.tokenizer) if text else None,
                         processor=processor)
            )  # fmt: skip
            if self._spec is not None and generator is not None:
                requests[-1].noise = NoiseQueue(generator, self.model.vocab_size, self.model.device)
        for r in requests:
            while wait and drive and self._full(max(1, self.max_waiting)):
                self._drive_once()  # make room by running the loop (or wait while another does)
            with self._cond:
                while not self._closed and self._full_locked(max(1, self.max_waiting)) and wait:
                    if drive:
                        break  # filled since the check above by another caller: one more waits
                    self._start_locked()
                    self._cond.wait(0.5)
                if self._closed:
                    raise EngineClosed("the engine is closed")
                if self._full_locked(self.max_waiting) and not wait:
                    raise EngineFull(
                        f"{len(self._waiting)} requests are waiting (max_waiting={self.max_waiting})"
                    )
                self._waiting.append(r)
                self._stats["requests"] += 1
                self._stats["prompt_tokens"] += len(r.prompt)
                if not drive:
                    self._start_locked()
                self._cond.notify_all()
        return [r.handle for r in requests]

    @property
    def grammars(self) -> Grammars:
        """The compiled constraints of this model's tokenizer (`infer.structured.Grammars`)."""
        with self._cond:
            if self._grammars is None:
                self._grammars = Grammars(self.llm.tokenizer, self.model.vocab_size, sorted(self._eos))
            return self._grammars

    def _processor(self, prompt: list[int], p: SamplingParams) -> RowProcessor:
        """The request's `RowProcessor`; `ValueError` naming the argument for a constraint that does
        not compile or a biased token id past the vocabulary."""
        check_logit_bias(p.logit_bias, self.model.vocab_size)
        matcher = None if p.constraint is None else self.grammars.matcher(p.constraint)
        return RowProcessor(
            self.model.vocab_size, prompt, matcher=matcher, logit_bias=p.logit_bias,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
        )  # fmt: skip

    def _full(self, bound: int) -> bool:
        with self._cond:
            return not self._closed and self._full_locked(bound)

    def _full_locked(self, bound: int) -> bool:
        """Whether the queue is at ``bound`` waiting requests (those free rows will take at the
        next step do not count as waiting)."""
        free = self.max_batch - len(self._running)
        return len(self._waiting) >= bound + free

    def _start_locked(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            args = (weakref.ref(self), self._cond)
            self._thread = threading.Thread(target=_loop, args=args, name="infer-engine", daemon=True)
            self._thread.start()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def stats(self) -> dict[str, float | int]:
        """Counters for monitoring: running, waiting, rows and KV bytes held, tokens, steps."""
        with self._cond:
            out: dict[str, float | int] = {k: int(v) for k, v in self._stats.items()}
            out.update(
                running=len(self._running), waiting=len(self._waiting), max_batch=self.max_batch,
                max_waiting=self.max_waiting, context=self.context, kv_rows=self.slots.rows,
                kv_capacity=self.slots.capacity, kv_bytes=self.slots.nbytes,
            )  # fmt: skip
            if self._spec is not None:
                out.update(self._spec.stats())
        return out

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting; finish (``drain``) or cancel the running and waiting requests; end the loop."""
        with self._cond:
            self._closed = True
            if not drain:
                self._abort = True  # also ends requests being admitted right now (in no list)
                for r in [*self._waiting, *self._running.values()]:
                    r.handle._cancelled = True
            if self._waiting or self._running:
                self._start_locked()  # ends them even if no caller is iterating them
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # ---- the loop (its own thread) ---------------------------------------------------------

    def _poll_locked(self) -> list[_Request] | None:
        """Requests to admit now ([] when only running ones need a step); None when idle."""
        admitted = self._take_waiting_locked()
        if admitted or self._running:
            self._parked = False
            return admitted
        return None

    def _settle(self, timeout: float = 5.0) -> None:
        """When nothing else is queued: wait until the loop thread has let go of the engine (so a
        caller that drops its `LLM` right after frees the model at once)."""
        self._reap()
        deadline = time.monotonic() + timeout
        with self._cond:
            while (
                not self._parked
                and not self._waiting
                and not self._running
                and self._thread is not None
                and time.monotonic() < deadline
            ):
                self._cond.wait(0.01)

    def _next_event(self, handle: RequestHandle) -> Delta:
        """``handle``'s next event, running the loop on this thread while nobody else does."""
        while True:
            try:
                return handle._events.get_nowait()
            except queue.Empty:
                pass
            if not self._drive_once():
                try:  # another thread is running the loop: it hands this request's events over
                    return handle._events.get(timeout=HANDOVER_S)
                except queue.Empty:
                    continue

    def _drive_once(self) -> bool:
        """One iteration on this thread, when no other thread is running one and there is work;
        whether it ran. An interrupt (Ctrl-C) ends the requests of the step it broke and is raised."""
        with self._cond:
            if self._driver is not None:
                self._cond.wait(HANDOVER_S)  # until that iteration ends
                return False
            admitted = self._poll_locked()
            if admitted is None:
                return False
            self._driver = threading.current_thread()
        try:
            with torch.inference_mode():
                self._work(admitted, interruptible=True)
        finally:
            with self._cond:
                self._driver = None
                self._cond.notify_all()
        return True

    def _reap(self) -> None:
        """End cancelled requests now when no thread is running the loop, so a caller that stopped
        iterating early does not leave its row held until somebody runs the next step."""
        with self._cond:
            if self._driver is not None or (self._thread is not None and self._thread.is_alive()):
                return  # the running loop ends them at its next iteration
            for r in [r for r in self._waiting if r.handle._cancelled]:
                self._waiting.remove(r)
                self._emit(r, [], None, "cancelled")
            for r in [r for r in self._running.values() if r.handle._cancelled]:
                self._finish(r, "cancelled")

    def _exit_locked(self) -> bool:
        """Whether the loop should end now (closed or idle, nothing waiting or running)."""
        if self._waiting or self._running:
            return False
        self._thread = None
        return True

    def _work(self, admitted: list[_Request], interruptible: bool = False) -> None:
        try:
            for r in admitted:
                try:
                    self._admit(r)
                except Exception as e:
                    self._finish(r, "error", e)
            self._iteration()
        except BaseException as e:  # a bug or a failing model: end what ran, keep serving
            for r in [*admitted, *self._running.values()]:
                if not r.ended:
                    self._finish(r, "error", e)
            if interruptible and not isinstance(e, Exception):
                raise  # Ctrl-C in a caller driving the loop is the caller's

    def _take_waiting_locked(self) -> list[_Request]:
        out: list[_Request] = []
        while self._waiting and len(self._running) + len(out) < self.max_batch:
            r = self._waiting.popleft()
            if r.handle._cancelled or self._abort:
                self._emit(r, [], None, "cancelled")
                continue
            out.append(r)
        if out:
            self._cond.notify_all()  # room in the waiting queue
        return out

    def _admit(self, r: _Request) -> None:
        """Give ``r`` a row and reuse what the engine holds of its prompt.

        The longest prefix of the prompt held anywhere wins: a free row's kept tokens (the
        prefix cache: ``r`` takes that row), or a running request's tokens, computed or still to
        be computed (``r`` shares them: `KVSlots.share_prefix`, stored once; or, while they are
        being computed, waits for them: `_resolve_waits`), if at least `MIN_SHARED` tokens.
        Otherwise an empty row, else the least recently used, else (every row busy) a new one.

        Rows are added only when every row is busy, so the KV memory follows the number of
        requests that ran at once, not the number of different prompts seen: sequential calls
        with unrelated 4,096-token prompts kept 16 rows (2.4 GB for Gemma 3 270M) when a new row
        was preferred to a kept prefix."""
        slots = self.slots
        busy = {q.row for q in self._running.values()}
        free = [i for i in range(slots.rows) if i not in busy]
        best, best_n = -1, 0
        limit = len(r.prompt) - 1  # the last prompt token is always fed (its logits pick the first token)
        for i in free:
            n = min(common_prefix(slots.tokens(i), r.prompt), limit)
            if n > best_n:
                best, best_n = i, n
        lead, lead_n = -1, 0
        for i, q in self._running.items():
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
                best = min(free, key=lambda i: self._used.get(i, 0.0))
            else:  # every row busy (`_take_waiting_locked` admits at most max_batch)
                best = slots.rows
                slots.reserve(best + 1, 1)  # a row; its slots grow as its prompt is read
        slots.rollback(best, best_n)
        r.row = best
        r.pending = r.prompt[best_n:]
        slots.bounds[best] = len(slots.held[best]) + len(r.pending) + r.max_new
        r.started = time.perf_counter()
        r.handle.cached = best_n
        self._stats["cached_tokens"] += best_n
        self._running[best] = r
        if lead >= 0:
            r.waits = (lead, lead_n)
            self._resolve_waits()

    def _resolve_waits(self) -> None:
        """Requests waiting for a prefix another request computes take it once it is computed
        (shared: `KVSlots.share_prefix`); if that request went away first, they compute it."""
        slots = self.slots
        shared = False
        for r in self._running.values():
            if r.waits is None:
                continue
            lead, n = r.waits
            held = slots.tokens(lead)
            if len(held) >= n and held[:n] == r.prompt[:n]:
                slots.share_prefix(lead, n, r.row)
                r.pending = r.prompt[n:]
                r.handle.cached = n
                self._stats["cached_tokens"] += n
                shared = True
            else:
                leader = self._running.get(lead)
                if leader is not None and leader is not r and (held + leader.pending)[:n] == r.prompt[:n]:
                    continue  # still being computed
            r.waits = None
        if shared:
            slots.shrink()  # the leader's long prompt moved to the store: its slots may go

    def _iteration(self) -> None:
        for r in list(self._running.values()):
            if r.handle._cancelled or self._abort:
                self._finish(r, "cancelled")
        if not self._running:
            return
        decoding = sorted(row for row, r in self._running.items() if r.decoding)
        if decoding:
            self._decode(decoding)
        self._prefill()

    def _sampling(
        self, requests: list[_Request | None]
    ) -> tuple[Sampling, SamplingValues | None, torch.Tensor | None]:
        params = [self._greedy if r is None else r.params for r in requests]
        # Logprobs and sampled processed rows need every logit exact (a greedy head is exact at the
        # argmax only); a few greedy processed rows re-score their best allowed candidates instead
        # (`_process`), more of them make the step compute the exact head.
        live = [r for r in requests if r is not None]
        greedy_processed = sum(1 for r in live if r.processor is not None and r.params.greedy)
        exact = greedy_processed > RESCORED_ROWS or any(
            r.params.logprobs is not None or (r.processor is not None and not r.params.greedy) for r in live
        )
        mode, values = sampling_inputs(params, self.model.device, exact_head=exact)
        noise = None
        if not mode.greedy and self._spec is not None:  # the rows a verify pass read ahead come first
            zeros = torch.zeros(1, self.model.vocab_size, dtype=torch.float32, device=self.model.device)
            noise = torch.cat([zeros if r is None or r.noise is None else r.noise.take() for r in requests])
        elif not mode.greedy:
            noise = row_noise([None if r is None else r.generator for r in requests], self.model.vocab_size,
                              self.model.device)  # fmt: skip
        return mode, values, noise

    def _decode(self, rows: list[int]) -> None:
        spec = self._spec
        if spec is not None:
            span = range(rows[0], rows[-1] + 1)  # a verify pass feeds these rows (and pads the idle)
            room = min(self.context - self.slots.length(i) for i in span if i in self._running)
            if spec.decode([self._running[i] for i in rows], self._token, room):
                self._stats["steps"] += 1
                self._stats["batch_size"] = len(rows)
                return  # the step ran as a verify pass of proposed tokens (`infer.speculative`)
            t0 = time.perf_counter()
        lo, hi = rows[0], rows[-1] + 1
        stepper = self.slots.stepper
        if stepper.bucketed:
            # A power-of-two window of rows around the decoding ones (few graphs, one per size),
            # not every allocated row: one stream among 16 idle rows computes 1 row, not 16.
            width = min(self.slots.rows, 1 << (hi - lo - 1).bit_length())
            lo = min(lo, self.slots.rows - width)
            hi = lo + width
        requests = [self._running.get(i) if i in rows else None for i in range(lo, hi)]
        feeds = {i: self._running[i].pending for i in rows}
        ran = self._step(lo, hi, feeds, requests)
        if ran is None:
            return
        out, tokens, bad = ran
        self._stats["batch_size"] = len(rows)
        for i in rows:
            self._token(self._running[i], tokens[i - lo], bad[i - lo], out.logits, i - lo)
        if spec is not None:
            spec.observe_decode(len(rows), time.perf_counter() - t0)

    def _step(
        self, lo: int, hi: int, feeds: dict[int, list[int]], requests: list[_Request | None], pad_to: int = 0
    ) -> tuple[StepOutput, list[int], list[bool]] | None:
        """One step of rows ``[lo, hi)`` fed ``feeds``, sampled as ``requests`` ask, and its host
        read: ``(out, tokens, nonfinite)``; None when it failed (its fed rows finish with the error)."""
        mode, values, noise = self._sampling(requests)
        try:
            out = self.slots.step(lo, hi, feeds, mode, values, noise, pad_to)
            tokens: list[int] = out.tokens.tolist()  # the step's host read
            bad: list[bool] = out.nonfinite.tolist()
            self._process(out, lo, feeds, requests, noise, tokens, exact=mode.exact_head)
        except Exception as e:
            for i in feeds:
                self._finish(self._running[i], "error", e)
            return None
        self._stats["steps"] += 1
        return out, tokens, bad

    def _process(
        self,
        out: StepOutput,
        lo: int,
        feeds: dict[int, list[int]],
        requests: list[_Request | None],
        noise: torch.Tensor | None,
        tokens: list[int],
        exact: bool = True,
    ) -> None:
        """Resample in ``tokens`` the rows that take a token this step and have a `RowProcessor`: their
        exact logits, processed (penalties, bias), sampled among the tokens the constraint allows
        with `sample`, the row's own values and the noise the step drew for it (so a seeded row
        draws as it would alone).

        A greedy step's logits (``exact`` false) are exact at each row's own argmax only (a packed
        head scans fewer bytes: `infer.quant.linear.QuantizedLinear.greedy`), so a greedy processed
        row takes its `RESCORED` best allowed tokens by those logits, computes their logits
        exactly from the step's hidden state (`DecoderLM.exact_logits`), processes them again, and
        picks the best: exact arithmetic's choice whenever it is among those candidates (the head's
        own greedy scan ranks the exact winner within its first 51 on real text), at the cost of
        64 rows of the head instead of every one (Gemma 3: 262,144). With more than
        `RESCORED_ROWS` such rows the step's head is exact instead (`_sampling`)."""
        picked = [
            (j, r, r.processor) for j, r in enumerate(requests)
            if r is not None and r.processor is not None and len(feeds.get(lo + j, ())) == len(r.pending)
        ]  # fmt: skip
        if not picked:
            return
        index = torch.tensor([j for j, _, _ in picked], dtype=torch.long, device=out.logits.device)
        logits = out.logits.index_select(0, index)  # [k, V], a copy: logprobs read the raw logits
        for k, (j, r, processor) in enumerate(picked):
            allowed = processor.apply(logits[k])
            if processor.error is not None:
                continue  # `_token` ends the request
            if r.params.greedy and not exact and out.hidden is not None:
                pool = logits[k] if allowed is None else logits[k, allowed]
                best = pool.topk(min(RESCORED, pool.shape[0])).indices
                ids = best if allowed is None else allowed[best]  # [K] candidates
                scores = processor.adjust(ids, self.model.exact_logits(out.hidden[j], ids))
                tokens[j] = int(ids[int(scores.argmax())])
                continue
            row = logits[k] if allowed is None else logits[k, allowed]  # [n]: the tokens it may pick
            p = r.params
            drawn = None
            if not p.greedy and noise is not None:
                drawn = noise[j] if allowed is None else noise[j, allowed]
            values = _RowValues(p.temperature, p.top_k, p.top_p)
            narrowed = None if p.greedy else narrow(row, p.temperature, p.top_k, p.top_p)
            if narrowed is not None:  # a top-k / top-p draw: sort its candidates, not the vocabulary
                positions, values.top_p = narrowed
                row = row[positions]
                drawn = None if drawn is None else drawn[positions]
                allowed = positions if allowed is None else allowed[positions]
            mode, sampled = sampling_inputs([values], row.device)
            pick = int(sample(row[None], mode, sampled, None if drawn is None else drawn[None])[0])
            tokens[j] = pick if allowed is None else int(allowed[pick])

    def _prefill(self) -> None:
        """Up to `prefill_chunk` prompt tokens: runs of contiguous prefilling rows, one forward each."""
        self._resolve_waits()
        reading = sorted(row for row, r in self._running.items() if not r.decoding and r.waits is None)
        # Running streams wait for this forward: a short chunk. Nobody waits: a long one, which
        # dequantizes each packed weight once for more tokens (Gemma 3, a 4,096-token prompt:
        # 818 tok/s in chunks of 256, 1,161 in chunks of 2,048; AMD EPYC, 2 threads).
        idle = not any(r.decoding for r in self._running.values())
        budget = self.idle_prefill_chunk if idle else self.prefill_chunk
        groups: list[list[int]] = []
        for i in reading:
            if groups and groups[-1][-1] == i - 1:
                groups[-1].append(i)
            else:
                groups.append([i])
        for group in groups:
            if budget <= 0:
                break
            # The chunk bounds the tokens of the forward, not of each row: a burst of new prompts
            # shares it, so the running streams never wait for more than one chunk's forward.
            T = min(max(1, budget // len(group)), max(len(self._running[i].pending) for i in group))
            if self._per_forward is not None:
                T = max(1, min(T, self._per_forward // len(group)))
            feeds = {i: self._running[i].pending[:T] for i in group}
            requests: list[_Request | None] = [self._running[i] for i in group]
            pad_to = 0
            if self.slots.stepper.compiled:
                pad_to = max(MIN_PREFILL, 1 << (T - 1).bit_length()) if T > 1 else 1
            ran = self._step(group[0], group[-1] + 1, feeds, requests, pad_to)
            if ran is None:
                continue
            out, tokens, bad = ran
            budget -= sum(len(t) for t in feeds.values())
            for j, i in enumerate(group):
                r = self._running[i]
                fed = len(feeds[i])
                r.handle.prefilled += fed
                self._stats["prefill_tokens"] += fed
                del r.pending[:fed]
                if not r.pending:  # the prompt is read: this step's logits pick the first token
                    self._token(r, tokens[j], bad[j], out.logits, j)

    def _token(self, r: _Request, token: int, nonfinite: bool, logits: torch.Tensor, index: int) -> bool:
        """Take one sampled token of ``r`` (drawn from ``logits[index]``); whether ``r`` goes on
        (a stop, the length or an error ends it)."""
        now = time.perf_counter()
        n = len(r.generated) + 1
        if nonfinite:
            where = "prefill" if n == 1 else f"decode step {n - 1}"
            error = NonFiniteLogitsError(f"non-finite logits (NaN or inf) at {where} (generated token {n})")
            self._finish(r, "error", error)
            return False
        processor = r.processor
        if processor is not None and processor.error is not None:
            self._finish(r, "error", ValueError(f"{processor.error} (generated token {n})"))
            return False
        if n == 1:
            r.first = now
        r.generated.append(token)
        self._used[r.row] = now
        self._stats["generated_tokens"] += 1
        logprobs = None
        if r.params.logprobs is not None:
            lp = torch.log_softmax(logits[index].float(), dim=-1)
            top: list[tuple[int, float]] = []
            if r.params.logprobs > 0:
                values, ids = lp.topk(min(r.params.logprobs, lp.shape[-1]))
                top = list(zip(ids.tolist(), values.tolist(), strict=True))
            logprobs = [TokenLogprob(token, float(lp[token]), top)]
        reason = detail = None
        stops = r.params.stop
        complete = processor is not None and processor.accept(token)  # nothing but EOS may follow
        if processor is not None and processor.error is not None:
            refused = ValueError(f"{processor.error} (generated token {n})")
            self._finish(r, "error", refused, [token], logprobs)
            return False
        if token in r.eos:
            reason, detail = "stop", ("stop" if token in r.params.stop_token_ids else "eos")
        elif complete or (stops and cut_at_stop(self.llm.tokenizer.decode(r.generated), stops)[1]):
            reason = detail = "stop"
        elif n >= r.max_new:
            reason = detail = "length"
        if reason is None:
            r.pending = [token]
            text = ""
            if r.stream is not None:
                text = r.stream.push(r.generated, r.params.stop)
            self._emit(r, [token], logprobs, None, text=text)
            return True
        self._finish(r, reason, None, [token], logprobs, detail)
        return False

    def _finish(
        self,
        r: _Request,
        reason: str,
        error: BaseException | None = None,
        tokens: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
        detail: str | None = None,
    ) -> None:
        now = time.perf_counter()
        if self._running.get(r.row) is r:
            del self._running[r.row]
            self._used[r.row] = now
            if r.row < len(self.slots.bounds):
                self.slots.bounds[r.row] = 0
        h = r.handle
        h.finish_detail = detail or reason
        h.exception = error
        start = r.started or now
        h.prefill_seconds = (r.first or now) - start
        h.decode_seconds = now - r.first if r.first else 0.0
        final = cut_at_stop(self.llm.tokenizer.decode(r.generated), r.params.stop)[0]
        emitted = r.stream.emitted if r.stream is not None else ""
        text = final[len(emitted) :] if final.startswith(emitted) else ""
        self._stats["finished"] += 1
        self._emit(r, tokens or [], logprobs, reason, text=text, error=None if error is None else str(error))

    def _emit(
        self,
        r: _Request,
        tokens: list[int],
        logprobs: list[TokenLogprob] | None,
        reason: str | None,
        text: str = "",
        error: str | None = None,
    ) -> None:
        if reason is not None:
            r.ended = True
            r.handle.token_ids = list(r.generated)
            if r.handle.finish_detail is None:
                r.handle.finish_detail = reason
        r.handle._put(Delta(tokens, text, logprobs, reason, error))


def _loop(ref: weakref.ref[Engine], cond: threading.Condition) -> None:
    """The engine's thread. It holds its engine only while working, so an idle engine (and the
    model it owns) can be garbage collected; the thread then ends at its next wake-up."""
    with torch.inference_mode():
        while True:
            engine = ref()
            if engine is None:
                return
            with cond:
                driven = engine._driver is not None  # by a caller (`Engine._drive_once`)
                admitted = None if driven else engine._poll_locked()
                if admitted is None:
                    if not driven and engine._closed and engine._exit_locked():
                        return
                    engine._parked = True
                    cond.notify_all()  # `Engine._settle` waits for this
                    del engine  # wait without holding the engine
                    woke = cond.wait(IDLE_EXIT_S)
                    engine = ref()
                    if engine is None or (not woke and engine._driver is None and engine._exit_locked()):
                        return
                    continue
                engine._driver = threading.current_thread()
            try:
                engine._work(admitted)
            finally:
                with cond:
                    engine._driver = None
                    cond.notify_all()
            del engine


def collect(handle: RequestHandle) -> tuple[list[int], str]:
    """Wait for ``handle``'s end: ``(generated tokens, text)``."""
    text = []
    for delta in handle:
        text.append(delta.text)
    return handle.token_ids, "".join(text)


__all__ = [
    "Delta",
    "Engine",
    "EngineClosed",
    "EngineFull",
    "KVSlots",
    "RequestHandle",
    "SamplingParams",
    "TokenLogprob",
    "collect",
]
