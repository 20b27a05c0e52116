"""TransformerLens' hook-point names on infer's models, and where each is reached.

A `Point` is one name (``blocks.3.attn.hook_z``) and the place of infer's model it reads:
the input (first argument) or output of one module, optionally a column range of it (a fused
q/k/v or gate/up product) and split into heads (``[..., H * hd] -> [..., H, hd]``). Points
marked ``internal`` (rotated queries / keys, attention scores and pattern) are no module
boundary: `infer.lens.run` computes them inside attention (`infer.models.attend`'s probe seam).

`points(model)` lists a model's points in the order a forward reaches them (TransformerLens'
order where several share a place: ``hook_embed`` before ``blocks.0.hook_resid_pre``,
``ln1_post.hook_normalized`` before ``hook_attn_out``). docs/notebooks.md has the table.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

Side = Literal["input", "output"]
NameFilter = str | Sequence[str] | Callable[[str], bool] | None

INTERNAL = ("hook_rot_q", "hook_rot_k", "hook_attn_scores", "hook_pattern")


@dataclass(frozen=True)
class Point:
    """One hook point: ``name`` (TransformerLens'), reached at ``module``'s ``side``.

    ``part``: columns ``[start, stop)`` of the last dimension; ``heads``: that many heads
    (the last dimension split into ``[heads, d_head]``). ``residual``: the block whose output
    must carry an edit of this point too (``hook_resid_mid`` is read at the second norm's input,
    which the block's residual add does not read). ``layer``: the block's index, None outside.
    """

    name: str
    module: str
    side: Side
    part: tuple[int, int] | None = None
    heads: int | None = None
    residual: str | None = None
    layer: int | None = None
    internal: bool = False


def _attention_points(i: int, block: nn.Module, b: str, n: str) -> list[Point]:
    """q, k, v, the q/k norms and the internal points of block ``i``'s attention."""
    gpt2 = hasattr(block, "attn")
    attn: Any = block.attn if gpt2 else block.self_attn
    a = f"{b}.{'attn' if gpt2 else 'self_attn'}"
    H = int(attn.num_heads)
    Hkv = int(getattr(attn, "num_kv_heads", H))
    hd = int(attn.head_dim)
    out: list[Point] = []
    fused = "c_attn" if gpt2 else "qkv_proj" if hasattr(attn, "qkv_proj") else None
    if fused is not None:  # one product: rows [q (H*hd) | k (Hkv*hd) | v (Hkv*hd)]
        q, kv = H * hd, Hkv * hd
        spans = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
        for x, heads in (("q", H), ("k", Hkv), ("v", Hkv)):
            out.append(Point(f"{n}.attn.hook_{x}", f"{a}.{fused}", "output", spans[x], heads, layer=i))
    else:
        for x, heads in (("q", H), ("k", Hkv), ("v", Hkv)):
            out.append(Point(f"{n}.attn.hook_{x}", f"{a}.{x}_proj", "output", None, heads, layer=i))
    if getattr(attn, "q_norm", None) is not None:  # applied to [B, T, H, hd]: already per head
        out.append(Point(f"{n}.attn.q_norm.hook_normalized", f"{a}.q_norm", "output", layer=i))
        out.append(Point(f"{n}.attn.k_norm.hook_normalized", f"{a}.k_norm", "output", layer=i))
    internal = INTERNAL if not gpt2 else INTERNAL[2:]  # GPT-2: no rotary
    out += [Point(f"{n}.attn.{x}", a, "output", layer=i, internal=True) for x in internal]
    o_proj = str(getattr(attn, "output_projection", "o_proj"))
    out.append(Point(f"{n}.attn.hook_z", f"{a}.{o_proj}", "input", None, H, layer=i))
    return out


def _mlp_points(i: int, block: nn.Module, b: str, n: str) -> list[Point]:
    mlp = block.mlp
    if hasattr(mlp, "gate_proj"):
        pre = [
            Point(f"{n}.mlp.hook_pre", f"{b}.mlp.gate_proj", "output", layer=i),
            Point(f"{n}.mlp.hook_pre_linear", f"{b}.mlp.up_proj", "output", layer=i),
        ]
        down = "down_proj"
    elif hasattr(mlp, "gate_up_proj"):  # rows [gate (I) | up (I)]
        width = int(mlp.gate_up_proj.out_features) // 2
        pre = [
            Point(f"{n}.mlp.hook_pre", f"{b}.mlp.gate_up_proj", "output", (0, width), layer=i),
            Point(f"{n}.mlp.hook_pre_linear", f"{b}.mlp.gate_up_proj", "output", (width, 2 * width), layer=i),
        ]
        down = "down_proj"
    else:  # GPT-2
        pre = [Point(f"{n}.mlp.hook_pre", f"{b}.mlp.c_fc", "output", layer=i)]
        down = "c_proj"
    return [*pre, Point(f"{n}.mlp.hook_post", f"{b}.mlp.{down}", "input", layer=i)]


def block_points(i: int, block: nn.Module) -> list[Point]:
    """Block ``i``'s points in forward order (see the module's docstring)."""
    b, n = f"layers.{i}", f"blocks.{i}"
    gpt2 = hasattr(block, "ln_1")
    sandwich = hasattr(block, "pre_feedforward_layernorm")  # Gemma 3: four norms a block
    ln1 = "ln_1" if gpt2 else "input_layernorm"
    ln2 = "ln_2" if gpt2 else "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
    attn = "attn" if gpt2 else "self_attn"
    out = [
        Point(f"{n}.hook_resid_pre", b, "input", layer=i),
        Point(f"{n}.ln1.hook_normalized", f"{b}.{ln1}", "output", layer=i),
        *_attention_points(i, block, b, n),
    ]
    if sandwich:
        out.append(Point(f"{n}.ln1_post.hook_normalized", f"{b}.post_attention_layernorm", "output", layer=i))
        out.append(Point(f"{n}.hook_attn_out", f"{b}.post_attention_layernorm", "output", layer=i))
    else:
        out.append(Point(f"{n}.hook_attn_out", f"{b}.{attn}", "output", layer=i))
    out.append(Point(f"{n}.hook_resid_mid", f"{b}.{ln2}", "input", residual=b, layer=i))
    out.append(Point(f"{n}.ln2.hook_normalized", f"{b}.{ln2}", "output", layer=i))
    out += _mlp_points(i, block, b, n)
    if sandwich:
        out.append(
            Point(f"{n}.ln2_post.hook_normalized", f"{b}.post_feedforward_layernorm", "output", layer=i)
        )
        out.append(Point(f"{n}.hook_mlp_out", f"{b}.post_feedforward_layernorm", "output", layer=i))
    else:
        out.append(Point(f"{n}.hook_mlp_out", f"{b}.mlp", "output", layer=i))
    out.append(Point(f"{n}.hook_resid_post", b, "output", layer=i))
    return out


def points(model: nn.Module) -> list[Point]:
    """Every hook point of ``model`` (an `infer.models.base.DecoderLM`), in forward order."""
    layers = model.layers
    assert isinstance(layers, nn.ModuleList)
    out: list[Point] = []
    if hasattr(model, "embed_positions"):  # GPT-2: token and position embeddings, then their sum
        out += [
            Point("hook_embed", "embed_tokens", "output"),
            Point("hook_pos_embed", "embed_positions", "output"),
        ]
    else:  # the embedding as the first block reads it (Gemma 3: scaled by sqrt(hidden_size))
        out.append(Point("hook_embed", "layers.0", "input"))
    for i, block in enumerate(layers):
        out += block_points(i, block)
    out += [
        Point("ln_final.hook_normalized", "norm", "output"),
        Point("unembed.hook_in", "lm_head", "input"),
        Point("unembed.hook_out", "lm_head", "output"),
    ]
    return out


def unknown_name(name: str, names: Sequence[str]) -> ValueError:
    """The error for a name that is no hook point of this model, with the nearest valid ones."""
    near = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    hint = f"; nearest: {', '.join(near)}" if near else ""
    return ValueError(f"unknown hook point {name!r} for this model{hint} (all: infer.lens.hook_names(llm))")


def select(names: Sequence[str], which: NameFilter, what: str = "names_filter") -> list[str]:
    """The names ``which`` picks (None: all; a name; a list of names; a predicate), in order.

    `ValueError` for an unknown name (with the nearest valid ones) or a filter picking none.
    """
    if which is None:
        return list(names)
    if isinstance(which, bool | bytes | bytearray) or not (
        isinstance(which, str) or callable(which) or isinstance(which, Iterable)
    ):
        raise TypeError(
            f"{what}: expected None (every point), a hook point name, a list of names or a predicate "
            f"on names, got {which!r:.80} ({type(which).__name__})"
        )
    if isinstance(which, str):
        if which not in names:
            raise unknown_name(which, names)
        return [which]
    if callable(which):
        picked = [n for n in names if which(n)]
        if not picked:
            raise ValueError(f"{what}: the predicate {which!r} matches no hook point of this model")
        return picked
    wanted = list(which)
    for n in wanted:
        if not isinstance(n, str):
            raise TypeError(f"{what}: expected hook point names (str), got {n!r:.80} ({type(n).__name__})")
        if n not in names:
            raise unknown_name(n, names)
    if not wanted:
        raise ValueError(f"{what}: an empty list matches no hook point")
    return [n for n in names if n in set(wanted)]


__all__ = ["INTERNAL", "NameFilter", "Point", "block_points", "points", "select", "unknown_name"]
