"""`infer.lens.sae` against SAELens itself: SAEs built and saved with ``sae-lens``'s own classes
(standard, topk, jumprelu, a hook_z one), loaded with `load_sae`, spliced into a tiny model.

Feature activations and reconstructions are compared with SAELens' ``encode`` / ``decode`` on the
same activations; the spliced model's logits with transformers' model whose module output is
replaced by SAELens' reconstruction (or by the feature-edited one plus the error term). Errors printed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import infer
import infer.lens as lens
from infer.lens.sae import load_sae, run_with_cache_with_saes, run_with_saes, saes

pytestmark = pytest.mark.slow
sae_lens = pytest.importorskip("sae_lens")

TOL = 1e-4
IDS = torch.randint(0, 260, (2, 24), generator=torch.Generator().manual_seed(5))
POINT = "blocks.1.hook_resid_post"


def _saelens_sae(architecture: str, hook_name: str, d_in: int, path: Path, **cfg: Any) -> Any:
    """An SAE of SAELens' own classes with random weights, saved by its ``save_model`` to ``path``."""
    from sae_lens.saes.sae import SAEMetadata

    classes = {
        "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig),
        "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig),
        "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig),
    }
    model_cls, cfg_cls = classes[architecture]
    sae = model_cls(cfg_cls(d_in=d_in, d_sae=96, metadata=SAEMetadata(hook_name=hook_name), **cfg))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.05 if name == "threshold" else 0.3))
        if architecture == "jumprelu":
            sae.threshold.abs_()
    sae.save_model(path)
    return sae


@pytest.fixture(scope="module")
def llama(
    tiny_ckpt_factory: Callable[..., Path], hf_model_factory: Callable[..., Any]
) -> tuple[infer.LLM, Any]:
    path = tiny_ckpt_factory("llama")
    return infer.load(path, dtype=torch.float32), hf_model_factory(path)


def _hf_logits(hf: Any, layer: int, replace: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """transformers' logits with decoder layer ``layer``'s output replaced by ``replace(output)``."""

    def hook(m: nn.Module, a: Any, o: Any) -> Any:
        return (replace(o[0]), *o[1:]) if isinstance(o, tuple) else replace(o)

    handle = hf.model.layers[layer].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits: torch.Tensor = hf(IDS).logits
    finally:
        handle.remove()
    return logits


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


@pytest.mark.parametrize(
    ("architecture", "cfg"),
    [("standard", {}), ("topk", {"k": 8}), ("jumprelu", {}), ("standard", {"apply_b_dec_to_input": False})],
)
def test_sae_matches_sae_lens(
    llama: tuple[infer.LLM, Any], tmp_path: Path, architecture: str, cfg: dict[str, Any]
) -> None:
    llm, hf = llama
    theirs = _saelens_sae(architecture, POINT, llm.config.hidden_size, tmp_path, **cfg)
    ours = load_sae(tmp_path)
    assert ours.hook_name == POINT and ours.architecture == architecture
    _, plain = lens.run_with_cache(llm, IDS, POINT)
    x = plain[POINT]
    logits, cache = run_with_cache_with_saes(llm, IDS, [ours], names_filter=lambda n: "hook_sae" in n)
    with torch.no_grad():
        acts = theirs.encode(x)
        recons = theirs.decode(acts)
    active = float((acts > 0).float().sum(-1).mean())
    e_acts = _err(cache[f"{POINT}.hook_sae_acts_post"], acts)
    e_recons = _err(cache[f"{POINT}.hook_sae_recons"], recons)
    e_logits = _err(logits, _hf_logits(hf, 1, lambda o: theirs.decode(theirs.encode(o)).detach()))
    assert f"{POINT}.hook_sae_error" not in cache  # no error term asked
    # the error term: the model unchanged, the error SAELens' own x - recons
    kept, with_error = run_with_cache_with_saes(
        llm, IDS, [ours], names_filter=f"{POINT}.hook_sae_error", use_error_term=True
    )
    e_error = _err(with_error[f"{POINT}.hook_sae_error"], x - recons)
    e_kept = _err(kept, lens.run_with_hooks(llm, IDS))
    print(
        f"\n{architecture} {cfg}: {active:.1f} features active a token; max abs error vs sae-lens: "
        f"acts {e_acts:.2e}, recons {e_recons:.2e}, error term {e_error:.2e}; spliced logits vs "
        f"transformers with sae-lens' reconstruction {e_logits:.2e}; with the error term vs plain "
        f"{e_kept:.2e}"
    )
    assert 0 < active < 96
    assert max(e_acts, e_recons, e_error, e_logits, e_kept) <= TOL


def test_feature_edit_with_error_term(llama: tuple[infer.LLM, Any], tmp_path: Path) -> None:
    """Zeroing features under the error term moves the activation by exactly their decoded part."""
    llm, hf = llama
    theirs = _saelens_sae("standard", POINT, llm.config.hidden_size, tmp_path)
    ours = load_sae(tmp_path)
    features = [3, 10, 40]

    def zero(acts: torch.Tensor, hook: lens.HookPoint) -> torch.Tensor:
        acts = acts.clone()
        acts[..., features] = 0
        return acts

    got = run_with_saes(
        llm, IDS, [ours], use_error_term=True, fwd_hooks=[(f"{POINT}.hook_sae_acts_post", zero)]
    )

    def edited(o: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            acts = theirs.encode(o)
            out: torch.Tensor = o + theirs.decode(zero(acts, None)) - theirs.decode(acts)  # type: ignore[arg-type]
        return out

    want = _hf_logits(hf, 1, edited)
    moved = _err(_hf_logits(hf, 1, lambda o: o), want)
    err = _err(got, want)
    print(
        f"\nfeature edit with the error term vs transformers with sae-lens' edit {err:.2e} "
        f"(moved {moved:.2e})"
    )
    assert moved > 100 * TOL and err <= TOL


def test_hook_z_sae_and_generation(llama: tuple[infer.LLM, Any], tmp_path: Path) -> None:
    """An SAE on hook_z (heads flattened, as SAELens' hook_z reshaping), and SAEs held by
    ``saes(...)`` during generation: the greedy tokens of a recompute loop over `run_with_saes`."""
    llm, _ = llama
    H, hd = llm.config.num_attention_heads, llm.config.computed_head_dim
    point = "blocks.0.attn.hook_z"
    theirs = _saelens_sae("topk", point, H * hd, tmp_path, k=6, reshape_activations="hook_z")
    ours = load_sae(tmp_path)
    _, plain = lens.run_with_cache(llm, IDS, point)
    _, cache = run_with_cache_with_saes(llm, IDS, [ours], names_filter=lambda n: n.startswith(point))
    with torch.no_grad():
        acts = theirs.encode(plain[point])
        recons = theirs.decode(acts)  # [B, T, H, hd]
    e_acts = _err(cache[f"{point}.hook_sae_acts_post"], acts)
    e_out = _err(cache[f"{point}.hook_sae_output"].reshape(recons.shape), recons)
    prompt = IDS[0, :7].tolist()
    with saes(llm, [ours]):
        steered = llm.generate(prompt, max_new_tokens=6).token_ids
    ids = list(prompt)
    for _ in range(6):
        ids.append(int(run_with_saes(llm, [ids], [ours])[0, -1].argmax()))
    print(f"\nhook_z SAE: acts {e_acts:.2e}, output {e_out:.2e}; generated {steered}, recomputed {ids[7:]}")
    assert max(e_acts, e_out) <= TOL and steered == ids[7:]


def test_load_errors(llama: tuple[infer.LLM, Any], tmp_path: Path) -> None:
    llm, _ = llama
    _saelens_sae("jumprelu", POINT, llm.config.hidden_size, tmp_path)
    weights = load_file(str(tmp_path / "sae_weights.safetensors"))
    save_file(
        {**weights, "W_dec": weights["W_dec"][:, :-1].contiguous()}, str(tmp_path / "sae_weights.safetensors")
    )
    with pytest.raises(ValueError, match=r"tensor W_dec has shape \(96, 63\), expected \(96, 64\)") as e:
        load_sae(tmp_path)
    print("\n", e.value)
    save_file(weights, str(tmp_path / "sae_weights.safetensors"))
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    (tmp_path / "cfg.json").write_text(json.dumps({**cfg, "architecture": "gated"}))
    with pytest.raises(ValueError, match="architecture 'gated' is not supported") as e:
        load_sae(tmp_path)
    print(e.value)
    (tmp_path / "cfg.json").write_text(
        json.dumps({**cfg, "metadata": {**cfg["metadata"], "hook_name": "blocks.1.hook_resid_pots"}})
    )
    with pytest.raises(ValueError, match=r"nearest: blocks\.1\.hook_resid_post"):
        run_with_saes(llm, IDS, [load_sae(tmp_path)])
