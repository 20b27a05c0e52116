"""Shared components: RMSNorm, RoPE, attention (GQA folding), gated MLP, mask helpers.

References are written out here (explicit ``repeat_interleave`` + softmax attention,
the RMSNorm formula in float64) or taken from transformers (RoPE init functions,
rotary modules, RMSNorm classes, activations).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
import torch.nn.functional as F
from mask_helpers import causal_mask, sliding_window_causal_mask

from infer.loader.config import FULL_ATTENTION, SLIDING_ATTENTION, config_from_dict
from infer.models.attend import attend
from infer.models.common import (
    Attention,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    activation,
    apply_rotary,
    attention_from_config,
    make_rotary_embeddings,
    rope_inv_freq,
    rope_tables,
    rotate_half,
)

NEG_INF = float("-inf")

M = TypeVar("M", bound=torch.nn.Module)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randomize_(module: M, seed: int = 0) -> M:
    g = gen(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))
    return module


# --------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("unit_offset", [False, True])
def test_rmsnorm_formula(unit_offset: bool) -> None:
    norm = randomize_(RMSNorm(16, eps=1e-5, unit_offset=unit_offset))
    x = torch.randn(2, 5, 16, generator=gen(1)) * 3
    out = norm(x)
    x64, w64 = x.double(), norm.weight.detach().double()
    scale = (1 + w64) if unit_offset else w64
    expected = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * scale
    assert out.shape == x.shape and out.dtype == torch.float32
    err = (out.double() - expected).abs().max().item()
    print(f"RMSNorm(unit_offset={unit_offset}) fp32 vs float64 formula: max abs err {err:.2e}")
    assert err < 1e-5


def test_rmsnorm_default_weights_are_identity_scale() -> None:
    x = torch.randn(3, 8, generator=gen(2))
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(RMSNorm(8)(x), expected)
    torch.testing.assert_close(RMSNorm(8, unit_offset=True)(x), expected)  # (1 + 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rmsnorm_matches_transformers(dtype: torch.dtype, unit_offset: bool) -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ours = randomize_(RMSNorm(32, eps=1e-6, unit_offset=unit_offset)).to(dtype)
    ref = (Gemma3RMSNorm(32, eps=1e-6) if unit_offset else LlamaRMSNorm(32, eps=1e-6)).to(dtype)
    ref.load_state_dict(ours.state_dict())
    x = (torch.randn(2, 7, 32, generator=gen(3)) * 4).to(dtype)
    out = ours(x)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(out, ref(x))  # same ops in the same order: bit-identical


# --------------------------------------------------------------------------- RoPE

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "linear", "factor": 8.0}, LLAMA3_SCALING],
    ids=["vanilla", "linear", "llama3"],
)
def test_rope_shapes(scaling: dict[str, Any] | None) -> None:
    inv = rope_inv_freq(64, 500000.0, scaling)
    assert inv.shape == (32,) and inv.dtype == torch.float32
    rot = RotaryEmbedding(64, 500000.0, scaling)
    positions = torch.arange(10)[None].expand(3, 10)  # [B, T]
    cos, sin = rot(positions, torch.bfloat16)
    assert cos.shape == sin.shape == (3, 10, 64)
    assert cos.dtype == sin.dtype == torch.bfloat16
    torch.testing.assert_close(cos[:, 0].float(), torch.ones(3, 64))  # position 0: no rotation
    torch.testing.assert_close(sin[:, 0].float(), torch.zeros(3, 64))


def test_rope_scaling_variants_differ_as_documented() -> None:
    vanilla = rope_inv_freq(64, 500000.0)
    linear = rope_inv_freq(64, 500000.0, {"rope_type": "linear", "factor": 8.0})
    llama3 = rope_inv_freq(64, 500000.0, LLAMA3_SCALING)
    torch.testing.assert_close(linear, vanilla / 8.0)
    # llama3: high frequencies untouched, the lowest divided by the full factor
    assert llama3[0] == vanilla[0]
    torch.testing.assert_close(llama3[-1], vanilla[-1] / 32.0)
    assert not torch.equal(llama3, vanilla)


def test_different_theta_gives_different_tables() -> None:
    positions = torch.arange(1, 9)[None]
    cos_a, sin_a = RotaryEmbedding(16, 10_000.0)(positions, torch.float32)
    cos_b, sin_b = RotaryEmbedding(16, 1_000_000.0)(positions, torch.float32)
    assert not torch.allclose(cos_a, cos_b) and not torch.allclose(sin_a, sin_b)
    # the first frequency is 1 for every theta; the others differ
    torch.testing.assert_close(cos_a[..., 0], cos_b[..., 0])


def test_unsupported_rope_type() -> None:
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs() / b.double().abs()).max().item()


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_inv_freq_matches_transformers_at_dev_configs(
    dev_configs: dict[str, dict[str, Any]], name: str
) -> None:
    """Our frequencies for the dev models' RoPE settings equal transformers' rotary modules'."""
    from transformers import CONFIG_MAPPING, Gemma3TextConfig, LlamaConfig, Qwen3Config
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    data = dev_configs[name]
    ours = make_rotary_embeddings(config_from_dict(data))
    hf_config = CONFIG_MAPPING[data["model_type"]].from_dict(copy.deepcopy(data))
    if name == "gemma3":
        assert isinstance(hf_config, Gemma3TextConfig)
        hf_gemma = Gemma3RotaryEmbedding(hf_config)
        hf = {lt: getattr(hf_gemma, f"{lt}_inv_freq") for lt in (FULL_ATTENTION, SLIDING_ATTENTION)}
    elif name == "llama":
        assert isinstance(hf_config, LlamaConfig)
        hf = {FULL_ATTENTION: LlamaRotaryEmbedding(hf_config).inv_freq}
    else:
        assert isinstance(hf_config, Qwen3Config)
        hf = {FULL_ATTENTION: Qwen3RotaryEmbedding(hf_config).inv_freq}
    assert set(ours) == set(hf)
    for lt, inv in hf.items():
        err = _max_rel(ours[lt].inv_freq, inv)
        print(f"{name} {lt}: inv_freq max rel err vs transformers {err:.1e}")
        assert err <= 1e-6


@pytest.mark.parametrize("rope_type", ["linear", "llama3"])
def test_inv_freq_matches_rope_init_functions(rope_type: str) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params: dict[str, Any] = {"rope_type": rope_type, "rope_theta": 250000.0, "factor": 4.0}
    if rope_type == "llama3":
        params |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    hf_config = LlamaConfig(hidden_size=384, num_attention_heads=4, head_dim=96, rope_parameters=dict(params))
    expected, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    assert attention_factor == 1.0  # we do not scale cos/sin for these types
    ours = config_from_dict(hf_config.to_dict())
    assert ours.rope_scaling is not None and ours.rope_scaling["rope_type"] == rope_type
    inv = rope_inv_freq(96, ours.rope_theta, ours.rope_scaling)
    err = _max_rel(inv, expected)
    print(f"{rope_type}: inv_freq max rel err vs ROPE_INIT_FUNCTIONS {err:.1e}")
    assert err <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_cos_sin_match_transformers_module(dtype: torch.dtype) -> None:
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    hf_config = Gemma3TextConfig(
        head_dim=32,
        num_hidden_layers=6,
        rope_parameters={
            FULL_ATTENTION: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    hf = Gemma3RotaryEmbedding(hf_config)
    ours = make_rotary_embeddings(config_from_dict(hf_config.to_dict()))
    positions = torch.stack([torch.arange(50, 70), torch.arange(0, 20)])  # [B=2, T=20], different offsets
    x = torch.zeros(1, dtype=dtype)
    for lt in (FULL_ATTENTION, SLIDING_ATTENTION):
        hf_cos, hf_sin = hf(x, positions, lt)
        cos, sin = ours[lt](positions, dtype)
        err = max(
            (cos.float() - hf_cos.float()).abs().max().item(),
            (sin.float() - hf_sin.float()).abs().max().item(),
        )
        print(f"{lt} {dtype}: cos/sin max abs err vs transformers {err:.1e}")
        assert cos.dtype == hf_cos.dtype == dtype
        assert err <= (1e-6 if dtype == torch.float32 else 0.0)


def test_rope_tables_per_layer_type(dev_configs: dict[str, dict[str, Any]]) -> None:
    gemma = config_from_dict(dev_configs["gemma3"])
    tables = rope_tables(gemma, max_positions=40)
    assert set(tables) == {FULL_ATTENTION, SLIDING_ATTENTION}
    for cos, sin in tables.values():
        assert cos.shape == sin.shape == (40, 256) and cos.dtype == torch.float32
    positions = torch.arange(40)[None]
    full_cos, _ = RotaryEmbedding(256, 1_000_000.0)(positions, torch.float32)
    local_cos, _ = RotaryEmbedding(256, 10_000.0)(positions, torch.float32)
    torch.testing.assert_close(tables[FULL_ATTENTION][0], full_cos[0])
    torch.testing.assert_close(tables[SLIDING_ATTENTION][0], local_cos[0])
    assert not torch.allclose(tables[FULL_ATTENTION][0], tables[SLIDING_ATTENTION][0])

    llama = config_from_dict(dev_configs["llama"])
    (lt,) = rope_tables(llama, max_positions=16)
    assert lt == FULL_ATTENTION
    cos, _ = rope_tables(llama, max_positions=16)[lt]
    assert cos.shape == (16, 64)
    scaled, _ = RotaryEmbedding(64, 500000.0, llama.rope_scaling)(torch.arange(16)[None], torch.float32)
    torch.testing.assert_close(cos, scaled[0])


def test_apply_rotary_hand_computed() -> None:
    # head_dim 4: rotate_half pairs dim i with dim i + 2. Angles pi/2 (pair 0/2) and pi (pair 1/3).
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)  # [B, H, T, hd]
    angles = torch.tensor([math.pi / 2, math.pi, math.pi / 2, math.pi])
    cos, sin = angles.cos().view(1, 1, 4), angles.sin().view(1, 1, 4)  # [B, T, hd]
    out = apply_rotary(x, cos, sin)
    # pair (0, 2) rotated by 90 degrees: (1, 3) -> (-3, 1); pair (1, 3) by 180: (2, 4) -> (-2, -4)
    torch.testing.assert_close(out.view(4), torch.tensor([-3.0, -2.0, 1.0, -4.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rotate_half(x).view(4), torch.tensor([-3.0, -4.0, 1.0, 2.0]))


def test_apply_rotary_general_angle_and_relative_positions() -> None:
    q = torch.randn(1, 2, 1, 8, generator=gen(4))
    k = torch.randn(1, 2, 1, 8, generator=gen(5))
    rot = RotaryEmbedding(8, 100.0)
    theta = rot.inv_freq * 3  # position 3
    cos, sin = rot(torch.tensor([[3]]), torch.float32)
    out = apply_rotary(q, cos, sin)
    a, b = q[..., :4], q[..., 4:]
    expected = torch.cat((a * theta.cos() - b * theta.sin(), b * theta.cos() + a * theta.sin()), dim=-1)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out.norm(dim=-1), q.norm(dim=-1))  # a rotation keeps lengths

    def score(m: int, n: int) -> torch.Tensor:
        cq, sq = rot(torch.tensor([[m]]), torch.float32)
        ck, sk = rot(torch.tensor([[n]]), torch.float32)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum(-1)

    torch.testing.assert_close(score(7, 2), score(15, 10))  # depends on m - n only


# --------------------------------------------------------------------------- masks


def test_causal_mask_values() -> None:
    mask = causal_mask(4)
    assert mask.shape == (1, 1, 4, 4) and mask.dtype == torch.float32
    expected = torch.tensor(
        [
            [0.0, NEG_INF, NEG_INF, NEG_INF],
            [0.0, 0.0, NEG_INF, NEG_INF],
            [0.0, 0.0, 0.0, NEG_INF],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    assert torch.equal(mask[0, 0], expected)
    assert causal_mask(3, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_sliding_window_mask_values() -> None:
    mask = sliding_window_causal_mask(6, 3)
    assert mask.shape == (1, 1, 6, 6)
    visible = mask[0, 0] == 0
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 1, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(visible, expected)
    assert torch.isneginf(mask[0, 0][~expected]).all()
    assert torch.equal(sliding_window_causal_mask(6, 6), causal_mask(6))  # window >= length: plain causal
    assert torch.equal(sliding_window_causal_mask(6, None), causal_mask(6))


@pytest.mark.parametrize(("seq_len", "window"), [(12, 8), (5, 8), (9, 1)])
def test_masks_match_transformers(seq_len: int, window: int) -> None:
    from transformers import Gemma3TextConfig
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    cfg = Gemma3TextConfig(num_hidden_layers=2, sliding_window=window, hidden_size=16)
    cfg._attn_implementation = "eager"
    kw: dict[str, Any] = dict(
        config=cfg,
        inputs_embeds=torch.zeros(1, seq_len, 16),
        attention_mask=None,
        past_key_values=None,
        position_ids=torch.arange(seq_len)[None],
    )
    hf_full, hf_sliding = create_causal_mask(**kw), create_sliding_window_causal_mask(**kw)
    assert isinstance(hf_full, torch.Tensor) and isinstance(hf_sliding, torch.Tensor)
    assert torch.equal(causal_mask(seq_len) == 0, hf_full == 0)
    assert torch.equal(sliding_window_causal_mask(seq_len, window) == 0, hf_sliding == 0)


# --------------------------------------------------------------------------- attention


def reference_attention(
    module: Attention,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention written out in float64: RoPE by hand, explicit repeat_interleave of K/V, softmax, sum."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    B, T, _ = x.shape
    H, Hkv, D = module.num_heads, module.num_kv_heads, module.head_dim
    w = {n: p.detach().double() for n, p in module.named_parameters()}
    q = (x @ w["q_proj.weight"].T).view(B, T, H, D)
    k = (x @ w["k_proj.weight"].T).view(B, T, Hkv, D)
    v = (x @ w["v_proj.weight"].T).view(B, T, Hkv, D)

    def rms(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        scale_w = (1 + weight) if module.q_norm is not None and module.q_norm.unit_offset else weight
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * scale_w

    if module.q_norm is not None:
        q, k = rms(q, w["q_norm.weight"]), rms(k, w["k_norm.weight"])
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        # Written out, not the `apply_rotary` under test: dim i pairs with dim i + D/2,
        # (a, b) -> (a cos - b sin, b cos + a sin).
        a, b = t[..., : D // 2], t[..., D // 2 :]
        c, s = cos[:, None], sin[:, None]  # [B, 1, T, D]
        return t * c + torch.cat((-b, a), dim=-1) * s

    q, k = rotate(q), rotate(k)
    k = k.repeat_interleave(H // Hkv, dim=1)  # [B, H, T, D]
    v = v.repeat_interleave(H // Hkv, dim=1)
    scores = q @ k.transpose(-1, -2) * scale  # [B, H, T, T]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF) if mask.dtype == torch.bool else scores + mask.double()
    out = torch.softmax(scores, dim=-1) @ v  # [B, H, T, D]
    return out.transpose(1, 2).reshape(B, T, H * D) @ w["o_proj.weight"].T


def padded_bool_mask(B: int, T: int) -> torch.Tensor:
    """[B, 1, T, T]: causal, row b has b left-padding keys (a padding query sees itself)."""
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None]
    rows = []
    for b in range(B):
        rows.append((k <= q) & ((k >= b) | (k == q)))
    return torch.stack(rows)[:, None]


MASKS: dict[str, Callable[[int], torch.Tensor | None]] = {
    "none": lambda T: None,
    "causal": lambda T: causal_mask(T),
    "sliding": lambda T: sliding_window_causal_mask(T, 3),
    "bool-padded": lambda T: padded_bool_mask(2, T),
}


@pytest.mark.parametrize("mask_kind", list(MASKS))
@pytest.mark.parametrize("qk_norm", [False, True], ids=["no-qk-norm", "qk-norm"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 1), (4, 4)], ids=["gqa2", "mqa", "mha"])
def test_attention_matches_repeat_interleave_reference(
    mask_kind: str, qk_norm: bool, heads: int, kv_heads: int
) -> None:
    hidden, head_dim, T = 24, 8, 7  # num_heads * head_dim = 32 != hidden_size
    module = randomize_(Attention(hidden, heads, kv_heads, head_dim, qk_norm=qk_norm, norm_eps=1e-6), seed=6)
    x = torch.randn(2, T, hidden, generator=gen(7))
    cos, sin = RotaryEmbedding(head_dim, 10_000.0)(torch.arange(T)[None].expand(2, T), torch.float32)
    mask = MASKS[mask_kind](T)
    out = module(x, cos, sin, mask)
    assert out.shape == (2, T, hidden)
    expected = reference_attention(module, x, cos, sin, mask, head_dim**-0.5)
    err = (out.double() - expected).abs().max().item()
    print(f"attention H={heads} Hkv={kv_heads} qk_norm={qk_norm} mask={mask_kind}: max abs err {err:.2e}")
    assert err < 1e-5


def test_qk_norm_changes_the_output() -> None:
    plain = randomize_(Attention(16, 4, 2, 8), seed=1)
    normed = Attention(16, 4, 2, 8, qk_norm=True)
    assert plain.q_norm is None and plain.k_norm is None
    assert normed.q_norm is not None and normed.q_norm.weight.shape == (8,)
    normed.load_state_dict(
        plain.state_dict() | {"q_norm.weight": torch.full((8,), 2.0), "k_norm.weight": torch.ones(8)}
    )
    x = torch.randn(1, 5, 16, generator=gen(8)) * 5
    cos, sin = RotaryEmbedding(8, 10_000.0)(torch.arange(5)[None], torch.float32)
    assert not torch.allclose(plain(x, cos, sin, causal_mask(5)), normed(x, cos, sin, causal_mask(5)))


def test_custom_scale_query_pre_attn_scalar() -> None:
    scale = 24**-0.5  # Gemma-style query_pre_attn_scalar=24 with head_dim=8
    custom = randomize_(Attention(16, 4, 2, 8, qk_norm=True, norm_unit_offset=True, scale=scale), seed=2)
    default = Attention(16, 4, 2, 8, qk_norm=True, norm_unit_offset=True)
    default.load_state_dict(custom.state_dict())
    assert custom.scale == scale and default.scale == 8**-0.5
    x = torch.randn(1, 6, 16, generator=gen(9))
    cos, sin = RotaryEmbedding(8, 10_000.0)(torch.arange(6)[None], torch.float32)
    mask = sliding_window_causal_mask(6, 4)
    out = custom(x, cos, sin, mask)
    expected = reference_attention(custom, x, cos, sin, mask, scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, default(x, cos, sin, mask))


def test_softcapped_attention_matches_reference() -> None:
    module = randomize_(Attention(16, 4, 2, 8, softcap=5.0), seed=3)
    x = torch.randn(2, 6, 16, generator=gen(10)) * 3
    cos, sin = RotaryEmbedding(8, 10_000.0)(torch.arange(6)[None].expand(2, 6), torch.float32)
    for mask in (causal_mask(6), padded_bool_mask(2, 6)):
        out = module(x, cos, sin, mask)
        expected = reference_attention(module, x, cos, sin, mask, 8**-0.5, softcap=5.0)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (6, 3), (2, 2)])
@pytest.mark.parametrize("T", [1, 3])
def test_attend_gqa_folding_with_longer_keys(heads: int, kv_heads: int, T: int) -> None:
    """Decode-shaped calls (keys from a cache: S > T) with a per-row boolean mask."""
    B, S, D = 2, 9, 16
    g = gen(11)
    q = torch.randn(B, heads, T, D, generator=g)
    k = torch.randn(B, kv_heads, S, D, generator=g)
    v = torch.randn(B, kv_heads, S, D, generator=g)
    mask = torch.rand(B, 1, T, S, generator=g) > 0.3
    mask[..., -1] = True  # no fully masked row
    for m in (mask, None):
        out = attend(q, k, v, m, 0.2)
        kr, vr = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = q @ kr.transpose(-1, -2) * 0.2
        if m is not None:
            scores = scores.masked_fill(~m, NEG_INF)
        expected = torch.softmax(scores, -1) @ vr
        assert out.shape == (B, heads, T, D)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_attention_head_count_must_divide() -> None:
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        Attention(16, 4, 3, 8)


def test_attention_from_config(dev_configs: dict[str, dict[str, Any]]) -> None:
    gemma = config_from_dict(
        dev_configs["gemma3"]
        | {"num_hidden_layers": 1, "hidden_size": 48, "head_dim": 16, "query_pre_attn_scalar": 24}
    )
    attn = attention_from_config(gemma, qk_norm=True, norm_unit_offset=True)
    assert attn.q_proj.weight.shape == (4 * 16, 48)
    assert attn.k_proj.weight.shape == (1 * 16, 48)
    assert attn.o_proj.weight.shape == (48, 4 * 16)
    assert attn.scale == 24**-0.5
    assert attn.q_proj.bias is None


# --------------------------------------------------------------------------- MLP


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_mlp_formula(act: str) -> None:
    mlp = randomize_(GatedMLP(12, 20, act), seed=4)
    x = torch.randn(2, 3, 12, generator=gen(12))
    fn = F.silu if act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    expected = mlp.down_proj(fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    out = mlp(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, expected)
    x64 = x.double()
    w = {n: p.detach().double() for n, p in mlp.named_parameters()}
    gate = x64 @ w["gate_proj.weight"].T
    act64 = (
        gate * torch.sigmoid(gate)
        if act == "silu"
        else (0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))))
    )
    ref = (act64 * (x64 @ w["up_proj.weight"].T)) @ w["down_proj.weight"].T
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_gated_mlp_bias() -> None:
    mlp = GatedMLP(8, 16, "silu", bias=True)
    assert mlp.gate_proj.bias is not None and mlp.down_proj.bias is not None
    assert GatedMLP(8, 16).gate_proj.bias is None


@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh", "gelu_new", "gelu"])
def test_activations_match_transformers(name: str) -> None:
    from transformers.activations import ACT2FN

    x = torch.linspace(-6, 6, 101)
    torch.testing.assert_close(activation(name)(x), ACT2FN[name](x))


def test_unsupported_activation() -> None:
    with pytest.raises(ValueError, match="relu2"):
        GatedMLP(4, 8, "relu2")
