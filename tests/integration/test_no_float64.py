"""docs/numerics.md: no operation of the per-token path has a float64 output.

Counted as the issue counted it: a `TorchDispatchMode` sees every aten op of a prefill and
the decode steps (embedding, layers, head, sampling) and records those with a float64
output. Every architecture; the default mode and the deterministic mode; greedy and seeded
sampling (temperature, top-k, top-p)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import infer
from infer.testing import ARCHITECTURES


class Float64Outputs(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts aten ops by name whose outputs include a float64 tensor; counts all ops too."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.float64: Counter[str] = Counter()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        leaves, _ = tree_flatten(out)
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in leaves):
            self.float64[str(func)] += 1
        return out


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_no_float64_in_the_per_token_path(
    tiny_ckpt_factory: Callable[..., Path], arch: str, deterministic: bool
) -> None:
    llm = infer.load(tiny_ckpt_factory(arch), deterministic=deterministic, compile=False)
    prompts = [[5, 9, 200, 31, 7, 12], [3, 4]]
    llm.generate(prompts[0], max_new_tokens=2)  # one-time work (plans, caches) outside the count
    counter = Float64Outputs()
    with counter:
        llm.generate(prompts, max_new_tokens=6)
        llm.generate(prompts[0], max_new_tokens=6, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    print(f"\n{arch} ({'deterministic' if deterministic else 'default'}): {counter.ops} ops, "
          f"float64 outputs: {dict(counter.float64) or 'none'}")  # fmt: skip
    assert counter.ops > 100  # the mode saw the model run
    assert not counter.float64


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_no_float64_in_the_real_models_packed_path(model: str) -> None:
    """The shipped GGUF models: packed int4 (Q4_1) and Q4_K / Q6_K products, the tied head."""
    from infer.realmodels import gemma3_270m_path, smollm2_path

    llm = infer.load(smollm2_path() if model == "smollm2" else gemma3_270m_path(), compile=False)
    llm.generate([1, 2, 3], max_new_tokens=2)
    counter = Float64Outputs()
    with counter:
        llm.generate([[400, 401, 402, 403], [500, 501]], max_new_tokens=4)
        llm.generate([400, 401], max_new_tokens=4, temperature=0.8, top_k=20, seed=3)
    print(f"\n{model}: {counter.ops} ops, float64 outputs: {dict(counter.float64) or 'none'}")
    assert counter.ops > 100
    assert not counter.float64
