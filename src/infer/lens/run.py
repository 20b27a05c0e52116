"""TransformerLens' calls on an `infer.LLM`: `run_with_cache`, `run_with_hooks`, `hooks`.

A run installs torch forward hooks (pre-hooks for a module's input) on the modules whose
boundaries hold the points it uses (`infer.lens.points`), one per module and side, and takes
them off after. Hook functions are TransformerLens' ``fn(tensor, hook)``: ``hook.name`` is the
point's name; a returned tensor (same shape and dtype) replaces the activation, None keeps it.

* Nothing else is hooked: the other blocks keep their fused products and default attention.
  The installed hooks are `infer.models.hooks.scoped`: they act on the forwards of the calling
  thread, and on the engine's forwards of the requests submitted inside `hooks` (each its own
  `RequestSession`, a forward of its row alone, run eagerly); every other forward, a generation
  of another caller batched with them included, runs as if they were not there.
* The points inside attention (``hook_rot_q``, ``hook_rot_k``, ``hook_attn_scores``,
  ``hook_pattern``) run the layers that use them through the eager attention
  `infer.models.attend` offers inspection (its probe seam, this thread only), as transformers'
  eager attention computes it: float32 scores and pattern, the model's own rotated q/k and mask.
  Whole-sequence runs only: `hooks` (which generation honours) refuses them.
* ``hook_resid_mid`` is read at the second norm's input; an edit of it is also added to the
  block's output (the residual add reads the unedited sum): equal within one rounding.
* Backward hooks are tensor hooks (``register_hook``) on the points' activations: they run
  whenever a backward passes through them, also after the call returned. Packed (quantized)
  weights have no backward: refused up front; so is ``hooks(bwd_hooks=...)`` (no gradients).
* A point a run never reaches (past ``stop_at_layer``, the head with ``return_type=None``) is an
  error before the forward where it was named (`Session.reach`); a filter keeps those it reaches.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, Protocol, overload

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from infer.host.pages import reusing_blocks
from infer.lens.points import NameFilter, Point, points, select, unknown_name
from infer.models.attend import attend, recording_attention, repeat_kv
from infer.models.hooks import OUTSIDE, forward_scope, scoped, submitting
from infer.streaming.executor import NO_HEAD


class LLM(Protocol):
    """What `infer.lens` needs of an `infer.LLM` (a Protocol: `infer.llm` builds on this package)."""

    model: Any  # infer.models.base.DecoderLM
    parallel: Any

    def encode(self, prompt: Any, what: str = "prompt") -> list[int]: ...


Input = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]] | torch.Tensor


class HookPoint:
    """What a hook function gets as ``hook``: the point's ``name``, its ``layer()`` and a ``ctx``
    dict kept for the run (TransformerLens' `HookPoint` attributes)."""

    def __init__(self, name: str, layer: int | None) -> None:
        self.name = name
        self._layer = layer
        self.ctx: dict[Any, Any] = {}

    def layer(self) -> int:
        if self._layer is None:
            raise ValueError(f"{self.name} is not inside a block")
        return self._layer

    def __repr__(self) -> str:
        return f"HookPoint({self.name!r})"


HookFn = Callable[[torch.Tensor, HookPoint], "torch.Tensor | None"]
Hooks = Sequence[tuple[NameFilter, HookFn]]


class ActivationCache(dict[str, torch.Tensor]):
    """``cache[name]``: the activation a run kept at that point (detached). A missing name says
    which were kept."""

    def __missing__(self, name: str) -> torch.Tensor:
        raise KeyError(f"{name!r} was not cached; this cache holds: {', '.join(self) or 'nothing'}")


class Splice:
    """Something run at a point after its hooks, replacing the activation (an SAE:
    `infer.lens.sae.SAE`). ``names``: the sub-points it offers, ``f"{point}.{name}"``."""

    names: tuple[str, ...] = ()

    def run(self, x: torch.Tensor, apply: Callable[[str, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


def _fn_name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or repr(fn))


def _check_result(result: Any, value: torch.Tensor, name: str, fn: Any, kind: str) -> torch.Tensor:
    if not isinstance(result, torch.Tensor):
        raise TypeError(
            f"{kind} hook {_fn_name(fn)} on {name} returned {type(result).__name__}; "
            "expected a tensor or None"
        )
    if result.shape != value.shape or result.dtype != value.dtype or result.device != value.device:
        moved = result.device != value.device  # the devices named when they differ
        got, want = (f" on {result.device}", f" on {value.device}") if moved else ("", "")
        raise ValueError(
            f"{kind} hook {_fn_name(fn)} on {name} returned shape {tuple(result.shape)} {result.dtype}{got}; "
            f"expected shape {tuple(value.shape)} {value.dtype}{want} (the activation's)"
        )
    return result


class Session:
    """The hooks, cache and splices of one run (or one `hooks` context)."""

    def __init__(
        self,
        model: nn.Module,
        fwd: Hooks = (),
        bwd: Hooks = (),
        cache: NameFilter | bool = False,
        splices: dict[str, Splice] | None = None,
    ) -> None:
        self.model = model
        self.points = points(model)
        self.splices = dict(splices or {})
        by_name = {p.name: p for p in self.points}
        for name in self.splices:
            if name not in by_name:
                raise unknown_name(name, list(by_name))
        self.sub = {f"{n}.{s}": by_name[n] for n, sp in self.splices.items() for s in sp.names}
        self.names = [*by_name, *self.sub]
        self.fwd: dict[str, list[HookFn]] = {}
        self.bwd: dict[str, list[HookFn]] = {}
        # What each argument asked for: (argument, the names it picks, named explicitly), for
        # `Session.reach` (a point a run never reaches is an error where it was named)
        self.asked: list[tuple[str, list[str], bool]] = [(f"splices[{n!r}]", [n], True) for n in self.splices]
        for table, given, what in ((self.fwd, fwd, "fwd_hooks"), (self.bwd, bwd, "bwd_hooks")):
            if isinstance(given, str | bytes) or not isinstance(given, Sequence):
                raise TypeError(f"{what}: expected a list of (name or filter, fn) pairs, got {given!r:.80}")
            for i, entry in enumerate(given):
                if not (isinstance(entry, tuple | list) and len(entry) == 2 and callable(entry[1])):
                    raise TypeError(f"{what}[{i}]: expected a (name or filter, fn) pair, got {entry!r:.80}")
                picked = select(self.names, entry[0], f"{what}[{i}]")
                self.asked.append((f"{what}[{i}]", picked, not callable(entry[0])))
                for name in picked:
                    table.setdefault(name, []).append(entry[1])
        self.cached: set[str] = set()
        if cache is not False:
            which = None if cache is True else cache
            self.cached = set(select(self.names, which, "names_filter"))
            picked = [n for n in self.names if n in self.cached]
            self.asked.append(("names_filter", picked, which is not None and not callable(which)))
        self.cache = ActivationCache()
        self.used = set(self.fwd) | set(self.bwd) | self.cached | set(self.splices)
        self.hook_points = {n: HookPoint(n, (by_name.get(n) or self.sub[n]).layer) for n in self.names}
        self.pending: dict[str, torch.Tensor] = {}  # block -> an edit of its hook_resid_mid
        # The hooks act on forwards of this thread (outside the engine's forwards) and on the
        # engine's forwards of this session's requests (`RequestSession`).
        self.thread = threading.get_ident()
        self.requests: list[RequestSession] = []
        self.cache_bytes = 0  # what a request may keep (`hooks(cache=...)`)
        self.closed = False  # the `hooks` block ended: its hooks act no more

    # ---- what the installed hooks call ---------------------------------------------------

    def apply(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The point's forward hooks, the cache, backward hooks and a splice on ``value``."""
        if name not in self.used:
            return value
        hook = self.hook_points[name]
        for fn in self.fwd.get(name, ()):
            result = fn(value, hook)
            if result is not None:
                value = _check_result(result, value, name, fn, "forward")
        if name in self.cached:
            self.keep(name, value.detach())
        if name in self.bwd and torch.is_grad_enabled():
            if not value.requires_grad:  # nothing before it needs a gradient: start the graph here
                value = value.detach().requires_grad_(True)
            value.register_hook(self._backward(name, value))  # type: ignore[no-untyped-call]
        splice = self.splices.get(name)
        if splice is not None:
            value = splice.run(value, lambda sub, x: self.apply(f"{name}.{sub}", x))
        return value

    def keep(self, name: str, value: torch.Tensor) -> None:
        self.cache[name] = value

    def _backward(self, name: str, value: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        hook = self.hook_points[name]

        def run(grad: torch.Tensor) -> torch.Tensor:
            for fn in self.bwd[name]:
                result = fn(grad, hook)
                if result is not None:
                    grad = _check_result(result, grad, name, fn, "backward")
            return grad

        return run

    def at(self, group: list[Point], x: torch.Tensor) -> torch.Tensor:
        """The points of one module boundary, in order, on its tensor ``x``."""
        for p in group:
            v = x if p.part is None else x[..., p.part[0] : p.part[1]]
            if p.heads is not None:
                v = v.reshape(*v.shape[:-1], p.heads, -1)  # [..., H * hd] -> [..., H, hd]
            new = self.apply(p.name, v)
            if new is v and (p.name not in self.bwd or v is x):  # (a gradient hook needs its view used)
                continue
            if p.residual is not None:
                self.pending[p.residual] = self.pending.get(p.residual, 0) + (new - v)
            flat = new.flatten(-2) if p.heads is not None else new
            x = (
                flat
                if p.part is None
                else torch.cat([x[..., : p.part[0]], flat, x[..., p.part[1] :]], dim=-1)
            )
        return x

    # ---- installing ----------------------------------------------------------------------

    def reach(self, stop: int | None, logits: bool, stop_at_layer: int | None) -> None:
        """Keep to the points a forward that stops before block ``stop`` (None: runs every block)
        and runs the head only with ``logits`` reaches: a point named explicitly that it never
        reaches is a `ValueError` naming it and what excludes it (its hook would never be called,
        its cache entry never filled); a filter (None, a predicate) keeps the points it reaches,
        and is an error if it reaches none."""
        why: dict[str, str] = {}
        for p in self.points:
            if p.name == f"blocks.{stop}.hook_resid_pre":  # what the run returns: reached (`install`)
                continue
            if stop is not None and p.layer is not None and p.layer >= stop:
                why[p.name] = f"stop_at_layer={stop_at_layer} runs blocks 0..{stop - 1} only"
            elif stop is not None and p.layer is None and p.module in ("norm", "lm_head"):
                why[p.name] = f"stop_at_layer={stop_at_layer} returns before the final norm and the head"
            elif not logits and p.module == "lm_head":
                why[p.name] = "return_type=None never runs the head (lm_head)"
        if stop == 0:
            why = {
                k: v if "head" in v else f"stop_at_layer={stop_at_layer} runs no block"
                for k, v in why.items()
            }
        for name, point in self.sub.items():  # an SAE's points: where the SAE is
            if point.name in why:
                why[name] = why[point.name]
        if not why:
            return
        for what, picked, explicit in self.asked:
            missed = [x for x in picked if x in why]
            if explicit and missed:
                raise ValueError(
                    f"{what}: {missed[0]} is never reached in this run: {why[missed[0]]} "
                    "(a hook there would never be called, nothing would be cached)"
                )
            if missed and len(missed) == len(picked):
                raise ValueError(
                    f"{what}: the points it picks are never reached in this run: {why[missed[0]]} "
                    f"(first: {missed[0]})"
                )
        for table in (self.fwd, self.bwd, self.splices):
            for x in [x for x in table if x in why]:
                del table[x]
        self.cached -= set(why)
        self.used -= set(why)

    @property
    def internal(self) -> list[str]:
        """The used points computed inside attention."""
        return [p.name for p in self.points if p.internal and p.name in self.used]

    def install(self, stop_at_layer: int | None = None) -> list[RemovableHandle]:
        """The torch hooks this session needs on the model (see the module's docstring)."""
        groups: dict[tuple[str, str], list[Point]] = {}
        for p in self.points:
            if p.internal:
                continue
            if p.name in self.used or any(s.startswith(p.name + ".") for s in self.used):
                groups.setdefault((p.module, p.side), []).append(p)
                if p.residual is not None:  # where an edit of hook_resid_mid joins the residual
                    groups.setdefault((p.residual, "output"), [])
        handles: list[RemovableHandle] = []
        if stop_at_layer is not None:
            layers = self.model.layers
            assert isinstance(layers, nn.ModuleList)

            # TransformerLens' stop_at_layer=0 still runs hook_embed (here the first block's input);
            # the block's hook_resid_pre is what the run returns: it runs too (TransformerLens' does not)
            first = [
                p
                for p in self.points
                if p.module == f"layers.{stop_at_layer}"
                and p.side == "input"
                and p.layer in (None, stop_at_layer)
            ]

            def stop(module: nn.Module, args: tuple[Any, ...]) -> None:
                if self.acting() is self:
                    raise _Stop(self.at(first, args[0]))

            ours = lambda: self.acting() is self  # noqa: E731
            handles.append(layers[stop_at_layer].register_forward_pre_hook(scoped(stop, ours), prepend=True))
        try:
            for (module_name, side), group in groups.items():
                module = self.model.get_submodule(module_name)
                if side == "input":
                    handles.append(module.register_forward_pre_hook(self._pre(group)))
                else:
                    handles.append(module.register_forward_hook(self._post(module_name, group)))
        except BaseException:
            for h in handles:
                h.remove()
            raise
        return handles

    def acting(self) -> Session | None:
        """The session whose hooks act on the forward running now: this one on its thread outside
        the engine's forwards, one of its requests' in the engine's forward of that request."""
        scope = forward_scope()
        if scope is OUTSIDE:
            return self if self.thread == threading.get_ident() else None
        if isinstance(scope, RequestSession) and scope.parent is self:
            return scope
        return None

    def _acts(self) -> bool:
        return self.acting() is not None

    def _pre(self, group: list[Point]) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
            s = self.acting()
            if s is None:
                return None
            x = s.at(group, args[0])
            return None if x is args[0] else (x, *args[1:])

        return scoped(hook, self._acts)

    def _post(self, module_name: str, group: list[Point]) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> Any:
            s = self.acting()
            if s is None:
                return None
            x = out
            delta = s.pending.pop(module_name, None)
            if delta is not None:
                x = x + delta
            x = s.at(group, x)
            return None if x is out else x

        return scoped(hook, self._acts)

    def for_request(self, positions: int) -> RequestSession:
        """The session of one request submitted inside `hooks` (`infer.engine`), which feeds at
        most ``positions`` tokens."""
        child = RequestSession(self, positions)
        self.requests.append(child)
        return child


class RequestSession(Session):
    """One generation's share of a `hooks` session: the same hooks, its own edits in flight, and
    the activations it keeps, position after position (prompt and generated tokens as they are fed),
    in buffers sized once for every position it may feed (bounded by ``cache_bytes``)."""

    def __init__(self, parent: Session, positions: int) -> None:
        self.__dict__.update(parent.__dict__)
        self.parent = parent
        self.positions = positions
        self.pending = {}
        self.cache = ActivationCache()
        self.buffers: dict[str, torch.Tensor] = {}
        self.written: dict[str, int] = {}

    @property
    def kept(self) -> ActivationCache | None:
        """``kept[name]``: ``[positions fed, ...]``, None when the session keeps nothing."""
        return self.cache if self.cached else None

    def keep(self, name: str, value: torch.Tensor) -> None:
        # value: [1, T, ...], this forward's new positions of the request's one row
        buffer = self.buffers.get(name)
        if buffer is None:
            buffer = self._buffer(name, value)
        at, T = self.written.get(name, 0), value.shape[1]
        buffer[at : at + T] = value[0]
        self.written[name] = at + T
        self.cache[name] = buffer[: at + T]

    def _buffer(self, name: str, value: torch.Tensor) -> torch.Tensor:
        shape = (self.positions, *value.shape[2:])
        need = sum(b.nbytes for b in self.buffers.values()) + value[0, :1].nbytes * self.positions
        if need > self.cache_bytes:
            raise ValueError(
                f"hooks(cache=...): keeping {name} with {', '.join(self.buffers) or 'nothing else'} for "
                f"{self.positions} positions (the prompt and max_new_tokens) takes {need:,} bytes; "
                f"cache_bytes is {self.cache_bytes:,}: keep fewer points, generate fewer "
                "tokens or give a larger cache_bytes"
            )
        buffer = value.new_empty(shape)
        self.buffers[name] = buffer
        return buffer


class _Stop(Exception):
    """Raised by the pre-hook of ``stop_at_layer``'s block: carries the residual stream."""

    def __init__(self, residual: torch.Tensor) -> None:
        super().__init__("stop_at_layer")
        self.residual = residual


class _LensProbe:
    """Attention of the blocks in ``layers`` with the internal points (run by the probe of
    `infer.models.attend.recording_attention`); other blocks' attention runs `attend` as usual."""

    def __init__(self, session: Session, layers: set[int]) -> None:
        self.session = session
        self.layers = layers
        self.layer: int | None = None

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        i = self.layer
        if i is None or i not in self.layers:
            return attend(q, k, v, mask, scale, softcap)
        s, n = self.session, f"blocks.{i}.attn"
        q = s.apply(f"{n}.hook_rot_q", q.transpose(1, 2)).transpose(1, 2)  # as [B, T, H, hd]
        k = s.apply(f"{n}.hook_rot_k", k.transpose(1, 2)).transpose(1, 2)  # as [B, S, Hkv, hd]
        k, v = repeat_kv(q.shape[1], k, v)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H, T, S]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            visible = mask if mask.dtype == torch.bool else mask == 0
            scores = scores.masked_fill(~visible, float("-inf"))
        scores = s.apply(f"{n}.hook_attn_scores", scores)
        pattern = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees no key: zeros
        pattern = s.apply(f"{n}.hook_pattern", pattern)
        return torch.matmul(pattern, v.float()).to(q.dtype)  # [B, H, T, hd]


@contextlib.contextmanager
def _probing(session: Session) -> Iterator[list[RemovableHandle]]:
    """The internal points' probe on this thread, and hooks telling it which block runs."""
    layers = {p.layer for p in session.points if p.internal and p.name in session.used}
    handles: list[RemovableHandle] = []
    if not layers:
        yield handles
        return
    probe = _LensProbe(session, {i for i in layers if i is not None})
    blocks = session.model.layers
    assert isinstance(blocks, nn.ModuleList)
    for i in probe.layers:
        attn: Any = blocks[i].attn if hasattr(blocks[i], "attn") else blocks[i].self_attn

        def enter(module: nn.Module, args: tuple[Any, ...], i: int = i) -> None:
            if session.acting() is session:
                probe.layer = i

        def leave(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if session.acting() is session:
                probe.layer = None

        ours = lambda: session.acting() is session  # noqa: E731
        handles += [
            attn.register_forward_pre_hook(scoped(enter, ours)),
            attn.register_forward_hook(scoped(leave, ours)),
        ]
    with recording_attention() as recorder:  # attention on this thread calls recorder.attend
        setattr(recorder, "attend", probe.attend)  # noqa: B010
        yield handles


# ---- inputs --------------------------------------------------------------------------------------


def _model(llm: LLM) -> nn.Module:
    if getattr(llm, "parallel", None) is not None:
        raise ValueError(
            "infer.lens: this LLM runs tensor / pipeline parallel (each rank holds a slice of the "
            "model); hook points need the whole model in one process"
        )
    model: nn.Module = llm.model
    return model


def token_ids(llm: LLM, input: Input) -> torch.Tensor:
    """``input`` as token ids ``[B, T]`` on the model's device: a text, a list of ids, a list of
    texts or of id lists (all of one length: nothing is padded), or a ``[T]`` / ``[B, T]`` tensor."""
    if isinstance(input, torch.Tensor):
        ids = input[None] if input.ndim == 1 else input
        if ids.ndim != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(
                f"input: expected token ids [T] or [B, T] of an integer dtype, got "
                f"shape {tuple(input.shape)} {input.dtype}"
            )
        return ids.to(device=llm.model.device, dtype=torch.long)
    if isinstance(input, str) or (isinstance(input, Sequence) and input and isinstance(input[0], int)):
        rows = [llm.encode(input, "input")]
    elif isinstance(input, Sequence) and input:
        rows = [llm.encode(p, f"input[{i}]") for i, p in enumerate(input)]
    else:
        raise TypeError(f"input: expected text, token ids or a tensor, got {input!r:.80}")
    lengths = sorted({len(r) for r in rows})
    if len(lengths) > 1:
        raise ValueError(f"input: the rows have different lengths {lengths}; give rows of one length")
    return torch.tensor(rows, dtype=torch.long, device=llm.model.device)


def _check_differentiable(model: nn.Module) -> None:
    """`ValueError` before any work when ``model`` holds packed (quantized) weights: their kernels
    (``aten._weight_int4pack_mm_for_cpu``, int8's) have no backward."""
    from infer.quant import QuantizedLinear

    packed = [name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    if packed:
        raise ValueError(
            f"bwd_hooks: this model's weights are packed (quantized: {len(packed)} layers, e.g. "
            f"{packed[0]}), and packed matrix products have no backward. Gradients need float weights: "
            "load a float checkpoint (safetensors, or a GGUF of F32 / F16 / BF16 tensors) without quantize="
        )


def _stop_index(model: nn.Module, stop_at_layer: int | None) -> int | None:
    if stop_at_layer is None:
        return None
    n = len(model.layers)  # type: ignore[arg-type]
    if not isinstance(stop_at_layer, int) or isinstance(stop_at_layer, bool) or not -n <= stop_at_layer <= n:
        raise ValueError(f"stop_at_layer: expected an int in [-{n}, {n}] (the model has {n} blocks)")
    return stop_at_layer % n if stop_at_layer != n else n


def _forward(
    llm: LLM, session: Session, input: Input, stop_at_layer: int | None, logits: bool = True
) -> torch.Tensor | None:
    """One whole-sequence forward with the session's hooks: logits ``[B, T, V]``, or the residual
    stream ``[B, T, D]`` before block ``stop_at_layer`` (TransformerLens: exclusive). Without
    ``logits`` (``return_type=None``) the head is not run: None, after the final norm where a used
    point needs it."""
    model = session.model
    ids = token_ids(llm, input)
    stop = _stop_index(model, stop_at_layer)
    n = len(model.layers)  # type: ignore[arg-type]
    head = model.get_submodule("lm_head")
    if logits and stop is None and all(t.is_meta for t in head.state_dict().values()):
        raise ValueError(f"logits: {NO_HEAD}; or return_type=None")  # before any work
    session.reach(stop, logits, stop_at_layer)  # before any work: a point never reached is an error
    handles = session.install(stop if stop is not None and stop < n else None)
    try:
        with _probing(session) as probe_handles, reusing_blocks(ids.numel()):
            handles += probe_handles
            try:
                h = model.forward_hidden(ids)  # type: ignore[operator]
            except _Stop as stopped:
                return stopped.residual
            if stop == n:
                return h  # type: ignore[no-any-return]
            if not logits:
                if any(p.module == "norm" and p.name in session.used for p in session.points):
                    model.norm(h)  # type: ignore[operator]
                return None
            out: torch.Tensor = model.head(h)  # type: ignore[operator]
            return out
    finally:
        for handle in handles:
            handle.remove()
        session.pending.clear()


# ---- the calls -----------------------------------------------------------------------------------


def hook_names(llm: LLM) -> list[str]:
    """Every hook point name of ``llm``'s model, in the order a forward reaches them."""
    return [p.name for p in points(_model(llm))]


@overload
def run_with_cache(
    llm: LLM,
    input: Input,
    names_filter: NameFilter = None,
    stop_at_layer: int | None = None,
    *,
    fwd_hooks: Hooks = (),
    splices: dict[str, Splice] | None = None,
    return_type: Literal["logits"] = "logits",
) -> tuple[torch.Tensor, ActivationCache]: ...


@overload
def run_with_cache(
    llm: LLM,
    input: Input,
    names_filter: NameFilter = None,
    stop_at_layer: int | None = None,
    *,
    fwd_hooks: Hooks = (),
    splices: dict[str, Splice] | None = None,
    return_type: None,
) -> tuple[None, ActivationCache]: ...


def run_with_cache(
    llm: LLM,
    input: Input,
    names_filter: NameFilter = None,
    stop_at_layer: int | None = None,
    *,
    fwd_hooks: Hooks = (),
    splices: dict[str, Splice] | None = None,
    return_type: Literal["logits"] | None = "logits",
) -> tuple[torch.Tensor | None, ActivationCache]:
    """``(logits, cache)`` of one forward of ``input`` (text, token ids, or a ``[B, T]`` tensor),
    as TransformerLens' ``run_with_cache``: ``cache[name]`` holds the activation at each point
    ``names_filter`` picks (None: all; a name, a list, or a predicate on names), nothing else is
    kept. ``stop_at_layer``: return the residual stream before that block instead of logits;
    ``return_type=None`` (TransformerLens' too): return None and never run the head.
    ``fwd_hooks`` run too (the cache holds what they return); ``splices``: SAEs by point
    (`infer.lens.sae`). Without gradients."""
    if return_type not in ("logits", None):
        raise ValueError(f"return_type: expected 'logits' or None, got {return_type!r}")
    if isinstance(names_filter, bool):  # (False would cache nothing, True is no filter)
        raise TypeError(
            "names_filter: expected None (every point), a name, a list of names or a predicate, "
            f"got {names_filter!r}"
        )
    model = _model(llm)
    session = Session(model, fwd_hooks, cache=True if names_filter is None else names_filter, splices=splices)
    with torch.no_grad():
        out = _forward(llm, session, input, stop_at_layer, logits=return_type == "logits")
    return out, session.cache


def run_with_hooks(
    llm: LLM,
    input: Input,
    fwd_hooks: Hooks = (),
    bwd_hooks: Hooks = (),
    stop_at_layer: int | None = None,
    *,
    splices: dict[str, Splice] | None = None,
) -> torch.Tensor:
    """Logits of one forward of ``input`` with ``fwd_hooks`` (pairs ``(name or filter, fn)``) run at
    their points, TransformerLens' ``run_with_hooks``. With ``bwd_hooks`` the forward records
    gradients (outside inference mode, whatever the caller's mode) and each ``fn(grad, hook)`` runs
    when a backward from the result passes its point (a returned tensor replaces the gradient);
    packed (quantized) weights have no backward: refused (`_check_differentiable`). Without, the
    caller's grad mode holds, as in TransformerLens: the weights need no gradient, so a graph is
    recorded only from a tensor a hook brings in that requires one (a steering vector trained)."""
    model = _model(llm)
    session = Session(model, fwd_hooks, bwd_hooks, splices=splices)
    with contextlib.ExitStack() as modes:
        if session.bwd:
            _check_differentiable(model)
            modes.enter_context(torch.inference_mode(False))
            modes.enter_context(torch.enable_grad())
        out = _forward(llm, session, input, stop_at_layer)
    assert out is not None  # (logits or the residual: `_forward` returns None only without logits)
    return out


_HOOKS_LOCK = threading.Lock()


class Hooked:
    """What ``with hooks(...) as run:`` gives: ``run.activations``, the activations each request
    submitted inside kept (`ActivationCache` ``[positions, ...]``, in submission order; with
    ``cache=``), and ``run.cache``, those of the last forward the calling thread ran itself."""

    def __init__(self, session: Session) -> None:
        self._session = session

    @property
    def activations(self) -> list[ActivationCache]:
        return [r.cache for r in self._session.requests]

    @property
    def cache(self) -> ActivationCache:
        return self._session.cache


@contextlib.contextmanager
def hooks(
    llm: LLM,
    fwd_hooks: Hooks = (),
    bwd_hooks: Hooks = (),
    *,
    cache: NameFilter | bool = False,
    cache_bytes: int = 2**30,
    splices: dict[str, Splice] | None = None,
) -> Iterator[Hooked]:
    """``with hooks(llm, fwd_hooks=[...]) as run:`` keeps the hooks on until the block ends, for
    the forwards of the calling thread (``llm.model(ids)``, `run_with_cache`, scores) and the
    generations it submits (``generate`` / ``stream`` / ``chat``): each request then runs in a
    forward of its own, eagerly, and its hooks see its rows only, at every step its new positions
    (prompt chunks, then one token); it reuses no K/V, nor does any other request reuse its.
    Other callers' requests batched meanwhile run as without hooks. ``cache``: the points each
    request keeps for every position it feeds (`Hooked.activations`, `GenerationResult.activations`;
    True: all), at most ``cache_bytes`` a request (checked at its first forward). The points inside
    attention are refused (they need a whole-sequence forward: `run_with_hooks`), and so are
    ``bwd_hooks`` (generation records no gradients: they would never be called)."""
    model = _model(llm)
    if bwd_hooks:  # generation records no gradients: they would never be called
        raise ValueError(
            "hooks(): bwd_hooks are never called: generation runs without gradients; "
            "use run_with_hooks(..., bwd_hooks=...) and a backward from its result"
        )
    if cache is True:  # every point generation reaches
        cache = [p.name for p in points(model) if not p.internal]
    session = Session(model, fwd_hooks, bwd_hooks, cache=cache, splices=splices)
    if session.internal:
        raise ValueError(
            f"hooks(): {', '.join(session.internal)} are computed inside attention and can be hooked "
            "only in a whole-sequence forward on this thread: use run_with_hooks / run_with_cache"
        )
    if not isinstance(cache_bytes, int) or isinstance(cache_bytes, bool) or cache_bytes <= 0:
        raise ValueError(f"hooks(): cache_bytes must be a positive int, got {cache_bytes!r}")
    session.cache_bytes = cache_bytes
    with _HOOKS_LOCK:
        handles = session.install()
    try:
        with submitting(session):
            yield Hooked(session)
    finally:
        session.closed = True  # a stream made inside but first read after: refused (`LLM.stream`)
        for handle in handles:
            handle.remove()
        session.pending.clear()


__all__ = [
    "ActivationCache",
    "HookFn",
    "HookPoint",
    "Hooked",
    "Input",
    "RequestSession",
    "Session",
    "Splice",
    "hook_names",
    "hooks",
    "run_with_cache",
    "run_with_hooks",
    "token_ids",
]
