"""Random Llama checkpoints of any size, written tensor by tensor (for streaming tests and benchmarks).

`write_synthetic_checkpoint` writes ``config.json`` (readable by `infer` and by
transformers) and a single ``model.safetensors`` without ever holding more than
one tensor in memory, so a checkpoint of several GB can be made on a small machine.
Weights are uniform with the standard deviation ``1.5 / sqrt(fan_in)`` (embeddings unit scale,
norm weights near 1), so activations stay finite through many layers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.assembly.weight_map import llama_weight_map

_ST_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class SyntheticSpec:
    """The shape of a synthetic Llama model."""

    hidden_size: int = 512
    intermediate_size: int = 1536
    num_hidden_layers: int = 24
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    vocab_size: int = 8192
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        d, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        hd = d // self.num_attention_heads
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        per_layer = {
            "self_attn.q_proj.weight": (q, d),
            "self_attn.k_proj.weight": (kv, d),
            "self_attn.v_proj.weight": (kv, d),
            "self_attn.o_proj.weight": (d, q),
            "mlp.gate_proj.weight": (i, d),
            "mlp.up_proj.weight": (i, d),
            "mlp.down_proj.weight": (d, i),
            "input_layernorm.weight": (d,),
            "post_attention_layernorm.weight": (d,),
        }
        shapes: dict[str, tuple[int, ...]] = {}
        for hf in llama_weight_map(self.num_hidden_layers):
            if hf == "model.embed_tokens.weight":
                shapes[hf] = (v, d)
            elif hf == "model.norm.weight":
                shapes[hf] = (d,)
            elif hf == "lm_head.weight":
                if not self.tie_word_embeddings:
                    shapes[hf] = (v, d)
            else:
                shapes[hf] = per_layer[hf.split(".", 3)[3]]
        return shapes

    def nbytes(self, dtype: torch.dtype) -> int:
        size = dtype.itemsize
        return sum(math.prod(s) * size for s in self.tensor_shapes().values())


def spec_for_size(target_bytes: int, dtype: torch.dtype, *, hidden_size: int = 1024) -> SyntheticSpec:
    """A spec of about ``target_bytes`` (layers added at a fixed width)."""
    base = SyntheticSpec(hidden_size=hidden_size, intermediate_size=3 * hidden_size, num_hidden_layers=1)
    one = base.nbytes(dtype)
    two = SyntheticSpec(
        hidden_size=hidden_size, intermediate_size=3 * hidden_size, num_hidden_layers=2
    ).nbytes(dtype)
    per_layer = two - one
    layers = max(1, round((target_bytes - (one - per_layer)) / per_layer))
    return SyntheticSpec(hidden_size=hidden_size, intermediate_size=3 * hidden_size, num_hidden_layers=layers)


def _config_json(spec: SyntheticSpec, dtype: torch.dtype) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    # Uniform with the standard deviation of N(0, scale^2): much faster to draw than randn.
    x = torch.empty(shape).uniform_(-math.sqrt(3.0), math.sqrt(3.0), generator=gen)
    if len(shape) == 1:
        return 1.0 + 0.1 * x
    if "embed_tokens" in name:
        return x
    return x * (1.5 / math.sqrt(shape[-1]))


def write_synthetic_checkpoint(
    path: str | Path, spec: SyntheticSpec, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> Path:
    """Write ``spec`` as a safetensors checkpoint into directory ``path``; return ``path``."""
    if dtype not in _ST_NAMES:
        raise ValueError(f"synthetic checkpoints support {sorted(map(str, _ST_NAMES))}, not {dtype}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shapes = spec.tensor_shapes()
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    gen = torch.Generator().manual_seed(seed)
    tmp = path / "model.safetensors.partial"
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape in shapes.items():
            tensor = _random(name, shape, gen).to(dtype)
            f.write(tensor.view(torch.uint8).numpy().tobytes())  # bytes of any dtype, bf16 included
    tmp.rename(path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(_config_json(spec, dtype), indent=2))
    return path
