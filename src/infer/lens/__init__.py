"""Interpretability in TransformerLens' vocabulary on infer's models (docs/notebooks.md, "Hook points").

`run_with_cache`, `run_with_hooks` and `hooks` take an `infer.LLM`; hook points have TransformerLens'
names (`hook_names`, `infer.lens.points`); `load_sae` reads a sparse autoencoder saved by SAELens and
splices it in at its point (`infer.lens.sae`); `save_activations` writes activations to disk in
shards (`infer.lens.save`).
"""

from infer.lens.points import Point, points
from infer.lens.run import (
    ActivationCache,
    Hooked,
    HookFn,
    HookPoint,
    hook_names,
    hooks,
    run_with_cache,
    run_with_hooks,
)
from infer.lens.save import Activations, save_activations

__all__ = [
    "ActivationCache",
    "Activations",
    "HookFn",
    "HookPoint",
    "Hooked",
    "Point",
    "hook_names",
    "hooks",
    "points",
    "run_with_cache",
    "run_with_hooks",
    "save_activations",
]
