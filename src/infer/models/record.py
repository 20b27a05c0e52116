"""What a forward gives when asked for more than logits: `CausalLMOutput`, transformers' shape.

``model(ids, output_hidden_states=True, output_attentions=True)`` (`DecoderLM.forward`) runs
`record_forward`: the same walk as the plain forward, with

* forward hooks on the blocks (on the calling thread only: an engine stepping on another
  thread records nothing) keeping the first block's input and every block's output;
* attention on that thread through `infer.models.attend.recording_attention` (eager math with
  the probabilities kept), only when ``output_attentions`` is asked: the default path is untouched.

As transformers gives them: ``hidden_states`` is ``num_layers + 1`` tensors ``[B, T, D]`` (the
embeddings, i.e. the first block's input; then each block's output; the last one after the final
norm), ``attentions`` ``num_layers`` tensors ``[B, H, T, T]``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
from torch import nn

from infer.models.attend import recording_attention


@dataclass
class CausalLMOutput:
    """A forward's outputs: ``logits [B, T, V]``, and when asked ``hidden_states`` and
    ``attentions`` (tuples, None otherwise). Like transformers' ``CausalLMOutputWithPast``:
    attributes, ``out["logits"]``, and ``out[0]`` / ``tuple(out)`` over the fields that are set."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(v for v in (getattr(self, f.name) for f in fields(self)) if v is not None)

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key: str | int) -> Any:
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(key)
            return getattr(self, key)
        return self.to_tuple()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.to_tuple())


class Walkable(Protocol):
    """What `record_forward` needs of a `infer.models.base.DecoderLM`."""

    layers: nn.ModuleList
    norm: nn.Module

    def forward_hidden(
        self, input_ids: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def head(self, h: torch.Tensor, greedy: bool = False) -> torch.Tensor: ...


def record_forward(
    model: Walkable,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    hidden_states: bool,
    attentions: bool,
) -> CausalLMOutput:
    """One whole-sequence forward of ``input_ids [B, T]`` with what is asked recorded (see the
    module's docstring). Memory: ``(layers + 1) x B x T x D`` for the hidden states,
    ``layers x B x H x T x T`` for the attentions, each in the activations' dtype."""
    thread = threading.get_ident()
    states: list[torch.Tensor] = []

    def first_input(module: nn.Module, args: tuple[Any, ...]) -> None:
        if threading.get_ident() == thread:
            states.append(args[0])

    def output(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        if threading.get_ident() == thread:
            states.append(out)

    handles = []
    if hidden_states:
        handles.append(model.layers[0].register_forward_pre_hook(first_input))
        handles += [layer.register_forward_hook(output) for layer in model.layers]
    probe = None
    try:
        if attentions:
            with recording_attention() as probe:
                h = model.forward_hidden(input_ids, None, attention_mask)
        else:
            h = model.forward_hidden(input_ids, None, attention_mask)
    finally:
        for handle in handles:
            handle.remove()
    logits = model.head(h)
    out = CausalLMOutput(logits)
    if hidden_states:
        states[-1] = model.norm(states[-1])  # transformers' last hidden state is after the final norm
        out.hidden_states = tuple(states)
    if probe is not None:
        out.attentions = tuple(probe.probs)
    return out


__all__ = ["CausalLMOutput", "record_forward"]
