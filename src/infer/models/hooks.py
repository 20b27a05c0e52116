"""Which of a model's modules carry torch forward hooks, and what a forward needs so that they run.

A hook registered with ``register_forward_hook`` / ``register_forward_pre_hook`` (or torch's
global ``register_module_forward_hook``) runs only when its module is *called*. Three paths of
infer would skip one silently, so they ask this module first:

* an ahead-of-time compiled package or a ``torch.compile`` graph of a step runs no Python at
  all (`infer.execution.Execution` runs a step eagerly while any hook is present: `HookWatch.active`);
* fused sibling projections (q/k/v, gate/up: `infer.models.projections.Fusable`) call one
  product instead of their parts (`HookWatch.honour` runs a hooked part's block unfused);
* a packed head's greedy scan and exact re-scoring read the head's weights directly
  (`calls_hooks`: a hooked head is called as a module).

Generation never calls the model's own ``forward`` (it walks the blocks and the head), so a hook
on the model itself is refused there (`HookWatch.check_generation`), naming it.

The check is one pass over a list of the modules' hook dicts (its cost: docs/notebooks.md), made
once per model: a module swapped into the model afterwards is not seen (its hooks are not either,
nor would a package run its code).

*Scoped* hooks (`scoped`: `infer.lens`' sessions) act only on some forwards: those of one thread,
or the engine's forwards of one request (`engine_forward`, which the runner enters around each
forward with the request's scope). They count as present only where they act, so the engine
runs every other request's steps as it would without them, and they never make K/V stale: a
request with scoped hooks computes its whole prompt and its row is never reused
(`infer.engine.scheduler`). A scope is captured at submission (`submitting`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module

from infer.models.projections import Fusable


def _global_hooks() -> list[dict[int, Any]]:
    return [torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks]


OUTSIDE = object()  # `forward_scope` outside an engine forward
_forward = threading.local()
_submitting: contextvars.ContextVar[Any] = contextvars.ContextVar("infer_hook_scope", default=None)


def scoped(hook: Callable[..., Any], acting: Callable[[], bool]) -> Callable[..., Any]:
    """Mark ``hook`` (before registering it) as acting only where ``acting()`` says."""
    hook.infer_acting = acting  # type: ignore[attr-defined]
    return hook


def _acts(hook: Any) -> bool:
    acting = getattr(hook, "infer_acting", None)
    return acting is None or bool(acting())


@contextlib.contextmanager
def engine_forward(scope: Any) -> Iterator[None]:
    """An engine forward on this thread, of requests submitted in ``scope`` (None: without one)."""
    before = getattr(_forward, "scope", OUTSIDE)
    _forward.scope = scope
    try:
        yield
    finally:
        _forward.scope = before


def forward_scope() -> Any:
    """The scope of the engine forward running on this thread (None: requests without one), or
    `OUTSIDE` (a forward of the caller's own)."""
    return getattr(_forward, "scope", OUTSIDE)


@contextlib.contextmanager
def submitting(scope: Any) -> Iterator[None]:
    """Requests submitted in this context (thread, task) carry ``scope`` (`Engine.submit`)."""
    token = _submitting.set(scope)
    try:
        yield
    finally:
        _submitting.reset(token)


def submission_scope() -> Any:
    """The scope `submitting` set in this context, None outside one."""
    return _submitting.get()


def calls_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs a forward hook or pre-hook (its own or a global one)."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
    )


class HookWatch:
    """The forward hooks of one model's modules (see the module's docstring).

    Holds the modules' names and hook dicts, not the model (no reference cycle through it).
    """

    def __init__(self, model: nn.Module) -> None:
        self.root = (model._forward_hooks, model._forward_pre_hooks)
        named = list(model.named_modules())
        self.names = [name or type(model).__name__ for name, _ in named]
        self.dicts: list[dict[int, Any]] = []
        for _, m in named:
            self.dicts += [m._forward_hooks, m._forward_pre_hooks]
        self.dicts += _global_hooks()
        self.fusables = [m for _, m in named if isinstance(m, Fusable)]

    def active(self) -> bool:
        """Whether a forward hook on the model's modules, or a global one, acts on a forward run
        now on this thread (every hook but a `scoped` one that does not)."""
        if next(filter(None, self.dicts), None) is None:
            return False
        return any(_acts(h) for d in filter(None, self.dicts) for h in d.values())

    def signature(self) -> tuple[int, ...]:
        """The ids of every hook present but the `scoped` ones (torch numbers hook handles from one
        counter): equal signatures mean the same hooks, so a KV computed under one is valid under
        the other."""
        dicts = filter(None, self.dicts)
        present = (k for d in dicts for k, h in d.items() if not hasattr(h, "infer_acting"))
        return tuple(sorted(present))

    def hooked(self) -> list[str]:
        """The modules carrying hooks, by name (``"torch's global module hooks"`` for those)."""
        out = [
            self.names[i // 2] for i in range(0, len(self.dicts) - 2, 2) if self.dicts[i] or self.dicts[i + 1]
        ]
        if any(_global_hooks()):
            out.append("torch's global module hooks")
        return list(dict.fromkeys(out))

    def honour(self) -> None:
        """Unfuse every fused product one of whose parts carries a hook (all of them under a
        global hook), so the hooks run; the block stays unfused (its parts' own products:
        the same values within rounding, a little slower)."""
        for m in self.fusables:
            if m.fused and any(calls_hooks(p) for p in m.fusable()):
                m.unfuse()

    def check_generation(self) -> None:
        """`RuntimeError` naming a hook on the model itself: generation walks its blocks and head
        and never calls its ``forward``, so such a hook would not run."""
        if self.root[0] or self.root[1]:
            raise RuntimeError(
                f"a forward hook is registered on the model itself ({self.names[0]}): generation "
                "does not call the model's forward (it runs its blocks and head step by step), so "
                "the hook would not run; register it on model.layers[i], model.norm or model.lm_head"
            )


__all__ = [
    "OUTSIDE",
    "HookWatch",
    "calls_hooks",
    "engine_forward",
    "forward_scope",
    "scoped",
    "submission_scope",
    "submitting",
]
