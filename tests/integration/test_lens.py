"""`infer.lens` (TransformerLens' names and calls) against transformers on the same tiny checkpoints.

Every hook point's value is compared with the input or output of the transformers module this file
names for it (its own table, `_hf_points`: not infer's), the rotated q/k with transformers'
``apply_rotary_pos_emb``, the pattern with its eager ``output_attentions``; edits with the same
edit made by hooks on transformers' modules; gradients at the points with transformers' autograd.
Errors are printed; the bound is the parity suite's float32 one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import infer
import infer.lens as lens
from infer.testing import ARCHITECTURES

pytestmark = pytest.mark.slow  # parity with transformers, as test_inspection.py

TOL = 1e-4  # test_models.py's float32 logit bound
IDS = torch.randint(0, 260, (2, 40), generator=torch.Generator().manual_seed(3))  # past Gemma's window of 8
GATED = {"llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3"}  # up_proj: hook_pre_linear


@pytest.fixture
def pair(
    tiny_ckpt_factory: Callable[..., Path], hf_model_factory: Callable[..., Any], arch: str
) -> tuple[infer.LLM, Any]:
    path = tiny_ckpt_factory(arch)
    return infer.load(path, dtype=torch.float32), hf_model_factory(path)


def _dims(hf: Any) -> tuple[int, int, int]:
    c = hf.config
    H = c.num_attention_heads
    return H, getattr(c, "num_key_value_heads", None) or H, getattr(c, "head_dim", None) or c.hidden_size // H


def _hf_points(
    hf: Any, arch: str
) -> dict[str, tuple[nn.Module, str, Callable[[torch.Tensor], torch.Tensor]]]:
    """TransformerLens name -> (transformers module, "in" / "out", the view of its tensor)."""
    H, Hkv, hd = _dims(hf)
    gpt2, sandwich = arch == "gpt2", arch == "gemma3"

    def same(t: torch.Tensor) -> torch.Tensor:
        return t

    def heads(n: int, start: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: t[..., start : start + n * hd].reshape(*t.shape[:-1], n, hd)

    def half(first: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: t.chunk(2, dim=-1)[0 if first else 1]

    stack = hf.transformer if gpt2 else hf.model
    out: dict[str, tuple[nn.Module, str, Callable[[torch.Tensor], torch.Tensor]]] = {}
    if gpt2:
        out["hook_embed"] = (stack.wte, "out", same)
        out["hook_pos_embed"] = (stack.wpe, "out", lambda t: t.expand(IDS.shape[0], -1, -1))  # [1, T, D]
    else:
        out["hook_embed"] = (stack.embed_tokens, "out", same)  # Gemma 3's scales: TransformerLens' W_E does
    for i, layer in enumerate(stack.h if gpt2 else stack.layers):
        n = f"blocks.{i}"
        attn = layer.attn if gpt2 else layer.self_attn
        mlp = layer.mlp
        out[f"{n}.hook_resid_pre"] = (layer, "in", same)
        out[f"{n}.ln1.hook_normalized"] = (layer.ln_1 if gpt2 else layer.input_layernorm, "out", same)
        if gpt2:
            for j, x in enumerate("qkv"):
                out[f"{n}.attn.hook_{x}"] = (attn.c_attn, "out", heads(H, j * H * hd))
        elif arch == "phi3":
            for x, h, start in (("q", H, 0), ("k", Hkv, H * hd), ("v", Hkv, (H + Hkv) * hd)):
                out[f"{n}.attn.hook_{x}"] = (attn.qkv_proj, "out", heads(h, start))
        else:
            for x, h in (("q", H), ("k", Hkv), ("v", Hkv)):
                out[f"{n}.attn.hook_{x}"] = (getattr(attn, f"{x}_proj"), "out", heads(h))
        if arch in (
            "qwen3",
            "gemma3",
        ):  # Gemma 3's transformers normalizes [B, H, T, hd], Qwen 3's [B, T, H, hd]
            per_head = (lambda t: t.transpose(1, 2)) if arch == "gemma3" else same
            out[f"{n}.attn.q_norm.hook_normalized"] = (attn.q_norm, "out", per_head)
            out[f"{n}.attn.k_norm.hook_normalized"] = (attn.k_norm, "out", per_head)
        out[f"{n}.attn.hook_z"] = (attn.c_proj if gpt2 else attn.o_proj, "in", heads(H))
        if sandwich:
            out[f"{n}.ln1_post.hook_normalized"] = (layer.post_attention_layernorm, "out", same)
            out[f"{n}.hook_attn_out"] = (layer.post_attention_layernorm, "out", same)
        else:
            out[f"{n}.hook_attn_out"] = (attn, "out", same)
        ln2 = (
            layer.ln_2
            if gpt2
            else layer.pre_feedforward_layernorm
            if sandwich
            else layer.post_attention_layernorm
        )
        out[f"{n}.hook_resid_mid"] = (ln2, "in", same)
        out[f"{n}.ln2.hook_normalized"] = (ln2, "out", same)
        if gpt2:
            out[f"{n}.mlp.hook_pre"] = (mlp.c_fc, "out", same)
            out[f"{n}.mlp.hook_post"] = (mlp.c_proj, "in", same)
        elif arch == "phi3":
            out[f"{n}.mlp.hook_pre"] = (mlp.gate_up_proj, "out", half(True))
            out[f"{n}.mlp.hook_pre_linear"] = (mlp.gate_up_proj, "out", half(False))
        else:
            out[f"{n}.mlp.hook_pre"] = (mlp.gate_proj, "out", same)
            out[f"{n}.mlp.hook_pre_linear"] = (mlp.up_proj, "out", same)
        if not gpt2:
            out[f"{n}.mlp.hook_post"] = (mlp.down_proj, "in", same)
        if sandwich:
            out[f"{n}.ln2_post.hook_normalized"] = (layer.post_feedforward_layernorm, "out", same)
            out[f"{n}.hook_mlp_out"] = (layer.post_feedforward_layernorm, "out", same)
        else:
            out[f"{n}.hook_mlp_out"] = (mlp, "out", same)
        out[f"{n}.hook_resid_post"] = (layer, "out", same)
    out["ln_final.hook_normalized"] = (stack.ln_f if gpt2 else stack.norm, "out", same)
    out["unembed.hook_in"] = (hf.lm_head, "in", same)
    out["unembed.hook_out"] = (hf.lm_head, "out", same)
    return out


@contextmanager
def _hf_capture(
    hf: Any,
    arch: str,
    edits: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    retain: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """Within, transformers' forwards record each point's tensor (the view `_hf_points` says) and,
    with ``edits``, replace the full module tensor by ``edits[name](tensor)``; ``retain``: keep
    their gradients (``got[name + ".full"]``: the module's whole tensor)."""
    got: dict[str, torch.Tensor] = {}
    handles = []
    for name, (module, side, view) in _hf_points(hf, arch).items():

        def record(t: torch.Tensor, name: str = name, view: Any = view) -> torch.Tensor:
            if edits and name in edits:
                t = edits[name](t)
            if retain and t.requires_grad:
                t.retain_grad()
            got[name], got[name + ".full"] = view(t), t
            return t

        if side == "in":

            def pre(m: nn.Module, a: tuple[Any, ...], kw: dict[str, Any], record: Any = record) -> Any:
                if a:
                    return (record(a[0]), *a[1:]), kw
                return a, {**kw, "hidden_states": record(kw["hidden_states"])}

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        else:

            def post(m: nn.Module, a: Any, o: Any, record: Any = record) -> Any:
                return (record(o[0]), *o[1:]) if isinstance(o, tuple) else record(o)

            handles.append(module.register_forward_hook(post))
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _hf_rotary(hf: Any, arch: str) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """transformers' own ``apply_rotary_pos_emb`` of the model's module, its results recorded."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    module = sys.modules[type(hf.model.layers[0].self_attn).__module__]
    original = getattr(module, "apply_rotary_pos_emb")  # noqa: B009

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        q, k = original(*args, **kwargs)
        calls.append((q, k))
        return q, k

    setattr(module, "apply_rotary_pos_emb", wrapped)  # noqa: B010
    try:
        yield calls
    finally:
        setattr(module, "apply_rotary_pos_emb", original)  # noqa: B010


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_point_matches_transformers(pair: tuple[infer.LLM, Any], arch: str) -> None:
    llm, hf = pair
    L = llm.config.num_hidden_layers
    with torch.no_grad(), _hf_capture(hf, arch) as want:
        if arch == "gpt2":
            out = hf(IDS, output_attentions=True)
            rot: list[tuple[torch.Tensor, torch.Tensor]] = []
        else:
            with _hf_rotary(hf, arch) as rot:
                out = hf(IDS, output_attentions=True)
        logits, cache = lens.run_with_cache(llm, IDS)
    names = lens.hook_names(llm)
    expected = set(_hf_points(hf, arch)) | {f"blocks.{i}.attn.hook_{x}" for i in range(L)
                                             for x in ("attn_scores", "pattern")}  # fmt: skip
    if arch != "gpt2":
        expected |= {f"blocks.{i}.attn.hook_rot_{x}" for i in range(L) for x in "qk"}
    assert set(names) == expected and set(cache) == expected and len(names) == len(expected)
    errors: dict[str, float] = {}
    for name in _hf_points(hf, arch):
        kind = name.split(".", 2)[-1] if name.startswith("blocks.") else name
        errors[kind] = max(errors.get(kind, 0.0), _err(cache[name], want[name]))
    H, _, hd = _dims(hf)
    for i in range(L):
        n = f"blocks.{i}.attn"
        attn = hf.transformer.h[i].attn if arch == "gpt2" else hf.model.layers[i].self_attn
        pattern = out.attentions[i]  # [B, H, T, T]
        if arch == "gpt2":
            q, k = want[f"{n}.hook_q"].transpose(1, 2), want[f"{n}.hook_k"].transpose(1, 2)
            scale = hd**-0.5
        else:
            q, k = rot[i]  # [B, H, T, hd], [B, Hkv, T, hd]
            errors["attn.hook_rot_q"] = max(
                errors.get("attn.hook_rot_q", 0.0), _err(cache[f"{n}.hook_rot_q"], q.transpose(1, 2))
            )
            errors["attn.hook_rot_k"] = max(
                errors.get("attn.hook_rot_k", 0.0), _err(cache[f"{n}.hook_rot_k"], k.transpose(1, 2))
            )
            scale = attn.scaling
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        scores = q @ k.transpose(-1, -2) * scale  # [B, H, T, T]
        cap = getattr(hf.config, "attn_logit_softcapping", None)
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        ours = cache[f"{n}.hook_attn_scores"]
        visible = pattern > 0  # transformers' masked scores underflow to exactly 0
        assert torch.equal(torch.isfinite(ours), visible), (
            f"{n}: masked scores are not where transformers masks"
        )
        errors["attn.hook_attn_scores"] = max(
            errors.get("attn.hook_attn_scores", 0.0), _err(ours[visible], scores[visible])
        )
        errors["attn.hook_pattern"] = max(
            errors.get("attn.hook_pattern", 0.0), _err(cache[f"{n}.hook_pattern"], pattern)
        )
    errors["logits"] = _err(logits, out.logits)
    print(f"\n{arch}: max abs error vs transformers per point:")
    for kind, e in errors.items():
        print(f"  {kind:34s} {e:.2e}")
    worst = max(errors, key=lambda k: errors[k])
    assert errors[worst] <= TOL, (worst, errors[worst])


def _steer(t: torch.Tensor) -> torch.Tensor:
    return t + torch.linspace(-2.0, 2.0, t.shape[-1])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_edits_match_the_same_edits_in_transformers(pair: tuple[infer.LLM, Any], arch: str) -> None:
    """Edits at module points (a fused part, hook_z's head, hook_resid_mid, an MLP point) and of the
    pattern (each query attends to itself only: z becomes v, made in transformers at o_proj's input)."""
    llm, hf = pair
    H, Hkv, hd = _dims(hf)
    B, T = IDS.shape

    def zero_head(t: torch.Tensor, hook: Any) -> torch.Tensor:
        t = t.clone()
        t[:, :, 1] = 0
        return t

    def self_only(t: torch.Tensor, hook: Any) -> torch.Tensor:
        return torch.eye(T, dtype=t.dtype).expand_as(t).contiguous()

    ours = lens.run_with_hooks(
        llm,
        IDS,
        fwd_hooks=[
            ("blocks.0.attn.hook_q", lambda t, h: t * 0.5),
            ("blocks.0.hook_resid_mid", lambda t, h: _steer(t)),
            ("blocks.1.attn.hook_z", zero_head),
            ("blocks.1.mlp.hook_pre", lambda t, h: t * 1.5),
            ("blocks.2.attn.hook_pattern", self_only),
        ],
    )
    captured: dict[str, torch.Tensor] = {}
    v_point = _hf_points(hf, arch)["blocks.2.attn.hook_v"]

    def keep_v(m: nn.Module, a: Any, o: torch.Tensor) -> None:
        captured["v"] = v_point[2](o)  # [B, T, Hkv, hd]

    def q_half(t: torch.Tensor) -> torch.Tensor:
        if arch in ("gpt2", "phi3"):  # the q columns of the fused product
            return torch.cat([t[..., : H * hd] * 0.5, t[..., H * hd :]], dim=-1)
        return t * 0.5

    def hf_zero_head(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[..., hd : 2 * hd] = 0
        return t

    def hf_mlp_pre(t: torch.Tensor) -> torch.Tensor:
        if arch == "phi3":
            gate, up = t.chunk(2, dim=-1)
            return torch.cat([gate * 1.5, up], dim=-1)
        return t * 1.5

    def z_is_v(t: torch.Tensor) -> torch.Tensor:
        return captured["v"].repeat_interleave(H // Hkv, dim=2).reshape(B, T, H * hd)

    layer0 = hf.transformer.h[0] if arch == "gpt2" else hf.model.layers[0]
    seen: dict[str, dict[str, torch.Tensor]] = {}

    def rest_of_block(t: torch.Tensor) -> torch.Tensor:
        """Block 0's output recomputed by transformers' modules from its edited resid_mid (the
        residual stream there: both the MLP and the residual add read it); ``.forward``: unhooked."""
        x = seen["got"]["blocks.0.hook_resid_mid"]
        if arch == "gpt2":
            out: torch.Tensor = x + layer0.mlp.forward(layer0.ln_2.forward(x))
        elif arch == "gemma3":
            mlp = layer0.mlp.forward(layer0.pre_feedforward_layernorm.forward(x))
            out = x + layer0.post_feedforward_layernorm.forward(mlp)
        else:
            out = x + layer0.mlp.forward(layer0.post_attention_layernorm.forward(x))
        return out

    edits: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "blocks.0.attn.hook_q": q_half,
        "blocks.0.hook_resid_mid": _steer,
        "blocks.0.hook_resid_post": rest_of_block,
        "blocks.1.attn.hook_z": hf_zero_head,
        "blocks.1.mlp.hook_pre": hf_mlp_pre,
        "blocks.2.attn.hook_z": z_is_v,
    }
    handle = v_point[0].register_forward_hook(keep_v)
    try:
        with torch.no_grad(), _hf_capture(hf, arch, edits) as got:
            seen["got"] = got
            want = hf(IDS).logits
    finally:
        handle.remove()
    with torch.no_grad():
        unedited = hf(IDS).logits
    err, moved = _err(ours, want), _err(unedited, want)
    print(f"\n{arch}: edited logits vs transformers' same edits {err:.2e} (the edits moved them {moved:.2e})")
    assert moved > 100 * TOL and err <= TOL


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_score_edits_match_transformers(pair: tuple[infer.LLM, Any], arch: str) -> None:
    """Scores masked to each query's own key (and the rotated keys passed through a hook) make z
    equal v: transformers with o_proj's input replaced by its v_proj output (heads repeated)."""
    llm, hf = pair
    H, Hkv, hd = _dims(hf)
    B, T = IDS.shape

    def only_self(s: torch.Tensor, hook: Any) -> torch.Tensor:
        return s.masked_fill(~torch.eye(T, dtype=torch.bool), float("-inf"))

    hooks: list[tuple[str, lens.HookFn]] = [("blocks.0.attn.hook_attn_scores", only_self)]
    if arch != "gpt2":
        hooks.append(("blocks.0.attn.hook_rot_k", lambda k, h: k.clone()))
    ours = lens.run_with_hooks(llm, IDS, fwd_hooks=hooks)
    v_point = _hf_points(hf, arch)["blocks.0.attn.hook_v"]
    captured: dict[str, torch.Tensor] = {}
    handle = v_point[0].register_forward_hook(lambda m, a, o: captured.update(v=v_point[2](o)))
    edits: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "blocks.0.attn.hook_z": lambda t: (
            captured["v"].repeat_interleave(H // Hkv, dim=2).reshape(B, T, H * hd)
        )
    }
    try:
        with torch.no_grad(), _hf_capture(hf, arch, edits):
            want = hf(IDS).logits
    finally:
        handle.remove()
    with torch.no_grad():
        moved = _err(hf(IDS).logits, want)
    err = _err(ours, want)
    print(f"\n{arch}: logits with edited scores vs transformers' z = v {err:.2e} (moved {moved:.2e})")
    assert moved > 100 * TOL and err <= TOL


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_gradients_at_points_match_transformers(pair: tuple[infer.LLM, Any], arch: str) -> None:
    llm, hf = pair
    names = [
        "blocks.0.hook_resid_pre", "blocks.0.attn.hook_q", "blocks.0.hook_attn_out",
        "blocks.1.hook_resid_mid", "blocks.1.attn.hook_z", "blocks.1.mlp.hook_post",
        "blocks.2.hook_resid_post", "ln_final.hook_normalized",
    ]  # fmt: skip
    targets = IDS[:, 1:]
    grads: dict[str, torch.Tensor] = {}

    def keep(g: torch.Tensor, hook: lens.HookPoint) -> None:
        grads[hook.name] = g

    with torch.inference_mode():  # as generation runs: run_with_hooks leaves it for the backward
        logits = lens.run_with_hooks(llm, IDS, bwd_hooks=[(n, keep) for n in names])
    assert logits.requires_grad
    torch.log_softmax(logits[:, :-1], -1).gather(-1, targets[..., None]).sum().backward()  # type: ignore[no-untyped-call]
    with _hf_capture(hf, arch, retain=True) as want:
        hf_logits = hf(IDS).logits
        torch.log_softmax(hf_logits[:, :-1], -1).gather(-1, targets[..., None]).sum().backward()  # type: ignore[no-untyped-call]
    hf.zero_grad(set_to_none=True)
    print(f"\n{arch}: max abs gradient error vs transformers' autograd (max |grad|):")
    worst = 0.0
    for n in names:
        full = want[n + ".full"]
        assert full.grad is not None, n
        view = _hf_points(hf, arch)[n][2]
        ref = view(full.grad)
        e = _err(grads[n], ref)
        worst = max(worst, e / max(1.0, float(ref.abs().max())))
        print(f"  {n:30s} {e:.2e} ({float(ref.abs().max()):.2e})")
    assert worst <= TOL


def test_names_are_transformer_lens_names(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """Every name is one TransformerLens' HookedTransformer has for the same kind of model."""
    pytest.importorskip("transformer_lens")
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    common = dict(d_model=64, n_ctx=32, d_head=16, n_heads=4, d_mlp=128, d_vocab=50)
    rotary = dict(
        normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True, n_key_value_heads=2
    )
    kinds = {
        "gpt2": dict(act_fn="gelu_new", normalization_type="LN", positional_embedding_type="standard"),
        "llama": dict(act_fn="silu", **rotary),
        "phi3": dict(act_fn="silu", **rotary),
        "qwen3": dict(act_fn="silu", use_qk_norm=True, **rotary),
        "gemma3": dict(act_fn="gelu_pytorch_tanh", use_normalization_before_and_after=True, use_qk_norm=True,
                       **rotary),
    }  # fmt: skip
    for arch, extra in kinds.items():
        llm = infer.load(tiny_ckpt_factory(arch), dtype=torch.float32)
        n_layers = llm.config.num_hidden_layers
        tl = set(HookedTransformer(HookedTransformerConfig(n_layers=n_layers, **common, **extra)).hook_dict)  # type: ignore[arg-type]
        ours = set(lens.hook_names(llm))
        lacking = sorted({n.split(".")[-1] for n in tl - ours})
        print(f"\n{arch}: {len(ours)} names, all in TransformerLens' {len(tl)}; theirs we lack: {lacking}")
        assert not ours - tl, sorted(ours - tl)


@pytest.mark.parametrize("arch", ["llama"])
def test_errors_and_what_is_kept(pair: tuple[infer.LLM, Any], arch: str) -> None:
    llm, _ = pair
    with pytest.raises(ValueError, match=r"nearest: blocks\.1\.hook_resid_post") as e:
        lens.run_with_cache(llm, IDS, names_filter="blocks.1.hook_resid_pots")
    print("\n", e.value)
    with pytest.raises(ValueError, match="matches no hook point") as e:
        lens.run_with_cache(llm, IDS, names_filter=lambda n: n.endswith("hook_nothing"))
    print(e.value)
    with pytest.raises(
        ValueError, match=r"returned shape \(2, 40, 63\) torch.float32; expected shape \(2, 40, 64\)"
    ) as e:
        lens.run_with_hooks(llm, IDS, fwd_hooks=[("blocks.0.hook_resid_post", lambda t, h: t[..., 1:])])
    print(e.value)
    with pytest.raises(ValueError, match=r"on blocks\.0\.attn\.hook_z returned shape .* torch\.float64") as e:
        lens.run_with_hooks(llm, IDS, fwd_hooks=[("blocks.0.attn.hook_z", lambda t, h: t.double())])
    print(e.value)
    with (
        pytest.raises(ValueError, match="computed inside attention"),
        lens.hooks(llm, fwd_hooks=[("blocks.0.attn.hook_pattern", lambda t, h: None)]),
    ):
        pass
    asked = ["blocks.1.attn.hook_q", "blocks.2.hook_resid_pre"]
    logits, cache = lens.run_with_cache(llm, IDS, names_filter=asked)
    assert sorted(cache) == sorted(asked) and not llm.model.hooks.active()
    with torch.no_grad():
        assert torch.equal(logits, llm.model(IDS))  # module points only: the default path, bitwise
    resid, _ = lens.run_with_cache(llm, IDS, names_filter=asked, stop_at_layer=2)
    assert torch.equal(resid, cache["blocks.2.hook_resid_pre"])
    last, rc = lens.run_with_cache(llm, IDS, names_filter="blocks.2.hook_resid_post", stop_at_layer=3)
    assert torch.equal(last, rc["blocks.2.hook_resid_post"])
    with pytest.raises(KeyError, match=r"this cache holds: blocks\.1\.attn\.hook_q"):
        cache["blocks.0.attn.hook_q"]
    # the inputs: a text (the tokenizer's ids), ids, a [T] tensor, rows of one length
    text = "Hello there"
    ids = llm.encode(text)
    by_text, c1 = lens.run_with_cache(llm, text, "hook_embed")
    by_ids, c2 = lens.run_with_cache(llm, torch.tensor(ids), "hook_embed")
    assert by_text.shape[:2] == (1, len(ids)) and torch.equal(by_text, by_ids)
    assert torch.equal(c1["hook_embed"], c2["hook_embed"])
    rows, _ = lens.run_with_cache(llm, [ids, ids[::-1]], "hook_embed")
    assert rows.shape[0] == 2 and torch.equal(rows[0], by_ids[0])
    with pytest.raises(ValueError, match=r"different lengths \[3, 4\]"):
        lens.run_with_cache(llm, [[1, 2, 3], [1, 2, 3, 4]], "hook_embed")
    seen: list[tuple[str, int]] = []
    lens.run_with_hooks(
        llm, IDS, fwd_hooks=[(lambda n: n.endswith("hook_z"), lambda z, h: seen.append((h.name, h.layer())))]
    )
    assert seen == [(f"blocks.{i}.attn.hook_z", i) for i in range(llm.config.num_hidden_layers)]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hooks_context_edits_generation(pair: tuple[infer.LLM, Any], arch: str) -> None:
    """An edit inside ``hooks(...)`` changes ``llm.generate``'s greedy tokens exactly as the same
    edit in a recompute-from-scratch loop over `run_with_hooks` does."""
    llm, _ = pair
    prompt = IDS[0, :9].tolist()
    edit = [("blocks.1.hook_resid_post", lambda t, h: _steer(t) * 1.5)]
    plain = llm.generate(prompt, max_new_tokens=8).token_ids
    with llm.hooks(fwd_hooks=edit):  # LLM's methods are infer.lens' calls
        steered = llm.generate(prompt, max_new_tokens=8).token_ids
    assert not llm.model.hooks.active()
    ids = list(prompt)
    for _ in range(8):
        ids.append(int(llm.run_with_hooks([ids], fwd_hooks=edit)[0, -1].argmax()))
    logits, cache = llm.run_with_cache([ids], "blocks.1.hook_resid_post")
    assert list(cache) == ["blocks.1.hook_resid_post"]
    assert torch.equal(logits, lens.run_with_cache(llm, [ids], "blocks.1.hook_resid_post")[0])
    print(f"\n{arch}: plain {plain}\n  steered {steered}\n  recomputed {ids[len(prompt) :]}")
    assert steered != plain and steered == ids[len(prompt) :]
