"""The feed-forward block: activations by config name and `GatedMLP` (SwiGLU, GeGLU)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from infer.loader.config import ModelConfig
from infer.models.projections import Fusable, Linear


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh-GELU, written out as OpenAI (and transformers' ``gelu_new``) compute it.

    Mathematically `F.gelu(approximate="tanh")`; the fused kernel rounds differently
    (logits differ by ~1e-5 on a tiny GPT-2), so the checkpoint's own formula is used.
    """
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": gelu_new,
    "gelu": F.gelu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}") from None


class GatedMLP(Fusable):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: SwiGLU (silu) or GeGLU (gelu_pytorch_tanh)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = activation(act)

    def fusable(self) -> list[nn.Module]:
        return [self.gate_proj, self.up_proj]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused:
            gate, up = self._fused[0](x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        out: torch.Tensor = self.down_proj(self.act_fn(gate) * up)
        return out


def mlp_from_config(config: ModelConfig) -> GatedMLP:
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
