"""What `infer.LLM` offers a notebook beside generation: interventions, scores, the logit lens, and a
short description of itself (``repr``, and Jupyter's rich display).

`NotebookMethods` is a base class of `infer.LLM`; its methods are thin: the work is in
`infer.interventions`, `infer.scores`, `infer.lens` (TransformerLens' hook points: `run_with_cache`,
`run_with_hooks`, `hooks`) and `infer.models.record` (``llm.model(ids, output_hidden_states=True,
output_attentions=True)``). docs/notebooks.md says what each returns, costs and runs.
"""

from __future__ import annotations

import contextlib
import html
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from infer.combinations import check_intervention
from infer.interventions import Intervention, Interventions, Positions, intervene
from infer.lens import ActivationCache, Hooked, hooks, run_with_cache, run_with_hooks, save_activations
from infer.lens.points import NameFilter
from infer.lens.run import Hooks, Input
from infer.scores import LogitLens, TokenScores, logit_lens, score

if TYPE_CHECKING:
    from infer.engine import Engine
    from infer.loader.config import ModelConfig
    from infer.loader.tokenizer import Tokenizer
    from infer.models.base import DecoderLM


def _size(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def describe_model(model: DecoderLM) -> dict[str, str]:
    """``{"parameters", "quantization", "weights"}``: the logical parameter count (a packed matrix
    counts its values, not its bytes; tied embeddings once), how the weight matrices are held, and
    the bytes of the model's tensors (each storage once; a memory-mapped file's counted whole)."""
    from infer.quant.embedding import QuantizedEmbedding
    from infer.quant.linear import QuantizedLinear

    params = 0
    kinds: dict[str, int] = {}
    storages: dict[int, int] = {}
    tied = bool(model.config.tie_word_embeddings)
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            if not (tied and name == "lm_head"):
                params += m.in_features * m.out_features + (m.bias.numel() if m.bias is not None else 0)
            label = f"{m.source or m.fmt} ({m.fmt}, {str(m.compute_dtype).removeprefix('torch.')} products)"
            kinds[label] = kinds.get(label, 0) + 1
        elif isinstance(m, QuantizedEmbedding):
            params += m.num_embeddings * m.embedding_dim
        else:
            seen = set()
            for p in m.parameters(recurse=False):
                if not (tied and name == "lm_head") and p.data_ptr() not in seen:
                    params += p.numel()
                    seen.add(p.data_ptr())
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            if t.device.type != "meta" and t.numel():
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
    quant = (
        ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
        or f"none ({str(model.dtype).removeprefix('torch.')})"
    )
    return {"parameters": _count(params), "quantization": quant, "weights": _size(sum(storages.values()))}


class NotebookMethods:
    """`infer.LLM`'s notebook methods (see the module's docstring)."""

    config: ModelConfig
    tokenizer: Tokenizer
    model: DecoderLM
    source: Path
    parallel: Any
    _engine: Engine | None

    def encode(self, prompt: str | list[int], what: str = "prompt") -> list[int]:
        raise NotImplementedError  # `infer.LLM.encode`

    # ---- hook points (TransformerLens' names: infer.lens) ---------------------------------------

    @overload
    def run_with_cache(
        self, input: Input, names_filter: NameFilter = None, stop_at_layer: int | None = None, *,
        fwd_hooks: Hooks = (), return_type: Literal["logits"] = "logits",
    ) -> tuple[torch.Tensor, ActivationCache]: ...  # fmt: skip

    @overload
    def run_with_cache(
        self, input: Input, names_filter: NameFilter = None, stop_at_layer: int | None = None, *,
        fwd_hooks: Hooks = (), return_type: None,
    ) -> tuple[None, ActivationCache]: ...  # fmt: skip

    def run_with_cache(
        self, input: Input, names_filter: NameFilter = None, stop_at_layer: int | None = None, *,
        fwd_hooks: Hooks = (), return_type: Literal["logits"] | None = "logits",
    ) -> tuple[torch.Tensor | None, ActivationCache]:  # fmt: skip
        """``(logits, cache)`` of one forward, ``cache[name]`` at each hook point ``names_filter``
        picks (`infer.lens.run_with_cache`; ``return_type=None``: no head, None for the logits)."""
        return run_with_cache(
            self, input, names_filter, stop_at_layer, fwd_hooks=fwd_hooks, return_type=return_type
        )

    def run_with_hooks(
        self, input: Input, fwd_hooks: Hooks = (), bwd_hooks: Hooks = (), stop_at_layer: int | None = None
    ) -> torch.Tensor:
        """Logits of one forward with ``fwd_hooks`` (and ``bwd_hooks``) at their hook points
        (`infer.lens.run_with_hooks`)."""
        return run_with_hooks(self, input, fwd_hooks, bwd_hooks, stop_at_layer)

    def hooks(
        self, fwd_hooks: Hooks = (), bwd_hooks: Hooks = (), *, cache: NameFilter | bool = False,
        cache_bytes: int = 2**30,
    ) -> contextlib.AbstractContextManager[Hooked]:  # fmt: skip
        """``with llm.hooks(fwd_hooks=[...]) as run:`` the hooks stay on for this thread's forwards
        and the generations it runs meanwhile, each request's on its own rows; ``cache``: the points
        each generation keeps for every position it feeds (`infer.lens.hooks`)."""
        return hooks(self, fwd_hooks, bwd_hooks, cache=cache, cache_bytes=cache_bytes)

    def save_activations(
        self, inputs: Any, names: NameFilter, out_dir: str | os.PathLike[str], *, batch_size: int = 8,
        shard_bytes: int = 256 * 2**20, dtype: torch.dtype | None = None, progress: bool = True,
    ) -> Path:  # fmt: skip
        """The activations at hook points ``names`` of every sequence of ``inputs``, written to
        ``out_dir`` as shards of safetensors with an index (`infer.lens.save_activations`)."""
        return save_activations(self, inputs, names, out_dir, batch_size=batch_size, shard_bytes=shard_bytes,
                                dtype=dtype, progress=progress)  # fmt: skip

    # ---- interventions ---------------------------------------------------------------------

    def intervene(
        self,
        *interventions: Intervention,
        layer: int | None = None,
        add: torch.Tensor | None = None,
        replace: torch.Tensor | None = None,
        zero: bool = False,
        head: int | None = None,
        positions: Positions = None,
    ) -> Interventions:
        """Edit the model's activations until the result is removed (``with llm.intervene(...):``,
        or ``.remove()``): ``add`` a tensor to, ``replace`` by a tensor, or ``zero`` block
        ``layer``'s output, or attention head ``head``'s output in that block (`infer.interventions`).
        Several: pass `infer.interventions.Intervention` objects. Honoured by ``llm.model(...)`` and
        by ``generate`` / ``stream`` / ``chat``, which run eagerly meanwhile (no package or compiled
        step runs hooks) and never reuse K/V computed without them. ``positions``: whole-sequence
        forwards only."""
        if self.parallel is not None:
            check_intervention(self.parallel.tensor_parallel, self.parallel.pipeline_parallel)
        items = list(interventions)
        if layer is not None:
            items.append(
                Intervention(layer, add=add, replace=replace, zero=zero, head=head, positions=positions)
            )
        elif add is not None or replace is not None or zero or head is not None or positions is not None:
            raise TypeError("intervene: layer= is needed with add=, replace=, zero=, head= or positions=")
        if not items:
            raise TypeError(
                "intervene: give layer= (with add=, replace= or zero=True) or Intervention objects"
            )
        return intervene(self.model, items)

    # ---- scores --------------------------------------------------------------------------

    @overload
    def score(
        self, texts: str | list[int], *, top_k: int = ..., batch_size: int = ..., progress: bool = ...
    ) -> TokenScores: ...

    @overload
    def score(
        self,
        texts: list[str] | list[list[int]] | list[str | list[int]],
        *,
        top_k: int = ...,
        batch_size: int = ...,
        progress: bool = ...,
    ) -> list[TokenScores]: ...

    def score(
        self,
        texts: str | list[int] | list[str] | list[list[int]] | list[str | list[int]],
        *,
        top_k: int = 5,
        batch_size: int = 8,
        progress: bool = False,
    ) -> TokenScores | list[TokenScores]:
        """Each token's log-probability given the ones before it, with the ``top_k`` likeliest
        alternatives (`infer.scores.TokenScores`); a list of texts gives a list, ``batch_size`` of
        them a forward. ``progress``: a progress bar over the batches (``tqdm.auto``)."""
        bar = None
        if progress:
            from tqdm.auto import tqdm

            def bar(items: Sequence[Any]) -> Any:
                return tqdm(items, desc="scoring", unit="batch")

        return score(self, texts, top_k=top_k, batch_size=batch_size, progress=bar)

    def logit_lens(self, prompt: str | list[int], positions: int | Sequence[int] | None = None) -> LogitLens:
        """What each block's output would predict through the final norm and head, at ``positions``
        (default every position) of ``prompt`` (`infer.scores.LogitLens`)."""
        return logit_lens(self, prompt, positions)

    # ---- display ---------------------------------------------------------------------------

    def summary(self) -> dict[str, str]:
        """Architecture, parameters, quantization, memory held (weights and the engine's K/V), device."""
        c, m = self.config, self.model
        facts = describe_model(m)
        kv = 0 if self._engine is None else int(self._engine.slots.nbytes)
        arch = (
            f"{c.model_type}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads "
            f"{c.num_attention_heads} (kv {c.num_key_value_heads}), vocab {c.vocab_size}"
        )
        return {
            "model": self.source.name,
            "architecture": arch,
            "parameters": facts["parameters"],
            "quantization": facts["quantization"],
            "memory": f"{facts['weights']} weights + {_size(kv)} K/V",
            "device": f"{m.device} ({str(m.dtype).removeprefix('torch.')} activations)",
        }

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"LLM({s['model']}: {s['architecture']}; {s['parameters']} parameters; "
            + "; ".join(f"{k} {v}" for k, v in s.items() if k in ("quantization", "memory", "device"))
            + ")"
        )

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>"
            f"{html.escape(v)}</td></tr>"
            for k, v in self.summary().items()
        )
        return f"<table><caption style='text-align:left'><b>infer.LLM</b></caption>{rows}</table>"


__all__ = ["NotebookMethods", "describe_model"]
