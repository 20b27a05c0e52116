"""Sparse autoencoders in SAELens' saved format, spliced in at a hook point.

`load_sae(path)` reads a directory SAELens' ``SAE.save_model`` wrote (``cfg.json`` and
``sae_weights.safetensors``: ``W_enc [d_in, d_sae]``, ``b_enc [d_sae]``, ``W_dec [d_sae, d_in]``,
``b_dec [d_in]``, ``threshold [d_sae]`` for JumpReLU), SAELens 6's config or an older one.
Its architectures, as SAELens computes them:

* ``standard``: ``acts = relu((x - b_dec) @ W_enc + b_enc)``, ``recons = acts @ W_dec + b_dec``;
* ``topk``: the ``k`` largest pre-activations kept (then relu), the rest zero;
* ``jumprelu``: ``relu(pre) * (pre > threshold)``.

(``x - b_dec`` only with ``apply_b_dec_to_input``; a ``hook_z`` SAE flattens the heads first.)
`run_with_saes` / `run_with_cache_with_saes` are SAELens' ``HookedSAETransformer`` calls: the
point's activation is replaced by the reconstruction (plus, with ``use_error_term``, the error
``x - recons`` of the unedited features, so only feature edits change the model), and the SAE's
own points are hookable and cacheable under ``f"{hook_name}.hook_sae_acts_post"`` and so on.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from infer.lens import run
from infer.lens.points import NameFilter

CFG_FILE, WEIGHTS_FILE = "cfg.json", "sae_weights.safetensors"
ARCHITECTURES = ("standard", "topk", "jumprelu")
SAE_POINTS = (
    "hook_sae_input",
    "hook_sae_acts_pre",
    "hook_sae_acts_post",
    "hook_sae_recons",
    "hook_sae_error",
    "hook_sae_output",
)


class SAE(nn.Module):
    """One sparse autoencoder (see the module's docstring): `encode`, `decode`, ``forward``
    (the reconstruction), and where it attaches (``hook_name``)."""

    threshold: torch.Tensor | None

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        architecture: str,
        hook_name: str,
        *,
        k: int | None = None,
        apply_b_dec_to_input: bool = True,
        reshape_hook_z: bool = False,
        rescale_acts_by_decoder_norm: bool = False,
    ) -> None:
        super().__init__()
        self.architecture, self.hook_name, self.k = architecture, hook_name, k
        self.apply_b_dec_to_input = apply_b_dec_to_input
        self.reshape_hook_z = reshape_hook_z
        self.rescale_acts_by_decoder_norm = rescale_acts_by_decoder_norm
        self.W_enc = nn.Parameter(weights["W_enc"], requires_grad=False)
        self.b_enc = nn.Parameter(weights["b_enc"], requires_grad=False)
        self.W_dec = nn.Parameter(weights["W_dec"], requires_grad=False)
        self.b_dec = nn.Parameter(weights["b_dec"], requires_grad=False)
        self.threshold = None
        if "threshold" in weights:
            self.threshold = nn.Parameter(weights["threshold"], requires_grad=False)
        self.d_in, self.d_sae = self.W_enc.shape
        self.path: str | None = None  # the directory `load_sae` read, for errors

    def pre(self, sae_in: torch.Tensor) -> torch.Tensor:
        """The pre-activations ``[..., d_sae]`` of ``sae_in [..., d_in]`` (already in the SAE's dtype)."""
        if self.apply_b_dec_to_input:
            sae_in = sae_in - self.b_dec
        pre = sae_in @ self.W_enc + self.b_enc
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        return pre

    def activation(self, pre: torch.Tensor) -> torch.Tensor:
        if self.architecture == "topk":
            assert self.k is not None
            values, indices = torch.topk(pre, k=self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter(-1, indices, values.relu())
        acts = pre.relu()
        if self.architecture == "jumprelu":
            assert self.threshold is not None
            acts = acts * (pre > self.threshold).to(acts.dtype)
        return acts

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the SAE reads it: its dtype; ``[..., H, hd] -> [..., H * hd]`` for a hook_z SAE."""
        x = x.to(self.W_enc.dtype)
        return x.flatten(-2) if self.reshape_hook_z else x

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``[..., d_sae]`` of activations ``x`` at the SAE's point."""
        return self.activation(self.pre(self.flat(x)))

    def decode(self, acts: torch.Tensor) -> torch.Tensor:
        """The reconstruction ``[..., d_in]`` of feature activations ``acts`` (flat for hook_z)."""
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            acts = acts / self.W_dec.norm(dim=-1)
        return acts @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    def extra_repr(self) -> str:
        k = f", k={self.k}" if self.k is not None else ""
        return f"{self.architecture}, d_in={self.d_in}, d_sae={self.d_sae}{k}, at {self.hook_name}"


class _Spliced(run.Splice):
    """An SAE at its point, its own points run through the session (`infer.lens.run.Splice`)."""

    names = SAE_POINTS

    def __init__(self, sae: SAE, use_error_term: bool, label: str = "saes[0]") -> None:
        self.sae, self.use_error_term, self.label = sae, use_error_term, label

    def check(self, x: torch.Tensor) -> None:
        """`ValueError` naming the SAE, its point and both widths unless ``x`` is ``d_in`` wide."""
        sae = self.sae
        width = x.shape[-2] * x.shape[-1] if sae.reshape_hook_z and x.ndim >= 2 else x.shape[-1]
        if width != sae.d_in:
            flat = " (heads flattened: a hook_z SAE)" if sae.reshape_hook_z else ""
            source = f" from {sae.path}" if sae.path else ""
            raise ValueError(
                f"{self.label}: the SAE{source} at {sae.hook_name} reads d_in={sae.d_in} values a position, "
                f"but {sae.hook_name} is {width} wide{flat} (shape {tuple(x.shape)}): an SAE of another "
                "model or point"
            )

    def run(self, x: torch.Tensor, apply: Callable[[str, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        self.check(x)
        sae = self.sae
        sae_in = apply("hook_sae_input", sae.flat(x))
        acts = apply("hook_sae_acts_post", sae.activation(apply("hook_sae_acts_pre", sae.pre(sae_in))))
        out = apply("hook_sae_recons", sae.decode(acts))
        if self.use_error_term:  # as SAELens: the error of the unhooked reconstruction
            with torch.no_grad():
                error = sae.flat(x) - sae(x)
            out = out + apply("hook_sae_error", error)
        out = apply("hook_sae_output", out)
        return out.reshape(x.shape).to(x.dtype)


def _splices(saes: Sequence[SAE], use_error_term: bool) -> dict[str, run.Splice]:
    out: dict[str, run.Splice] = {}
    for i, sae in enumerate(saes):
        if not isinstance(sae, SAE):
            raise TypeError(f"saes[{i}]: expected an infer.lens.sae.SAE (load_sae), got {type(sae).__name__}")
        if sae.hook_name in out:
            raise ValueError(f"saes[{i}]: two SAEs at {sae.hook_name}")
        out[sae.hook_name] = _Spliced(sae, use_error_term, f"saes[{i}]")
    return out


def run_with_saes(
    llm: run.LLM,
    input: run.Input,
    saes: Sequence[SAE],
    *,
    use_error_term: bool = False,
    fwd_hooks: run.Hooks = (),
) -> torch.Tensor:
    """Logits with each SAE's reconstruction in place of its point's activation (SAELens'
    ``run_with_saes``); ``fwd_hooks`` may name the SAEs' points (``f"{hook_name}.hook_sae_acts_post"``)."""
    return run.run_with_hooks(llm, input, fwd_hooks, splices=_splices(saes, use_error_term))


def run_with_cache_with_saes(
    llm: run.LLM,
    input: run.Input,
    saes: Sequence[SAE],
    names_filter: NameFilter = None,
    *,
    use_error_term: bool = False,
    stop_at_layer: int | None = None,
    fwd_hooks: run.Hooks = (),
) -> tuple[torch.Tensor, run.ActivationCache]:
    """`run_with_saes`, caching what ``names_filter`` picks, the SAEs' points included."""
    return run.run_with_cache(
        llm, input, names_filter, stop_at_layer, fwd_hooks=fwd_hooks, splices=_splices(saes, use_error_term)
    )


@contextlib.contextmanager
def saes(llm: run.LLM, saes: Sequence[SAE], *, use_error_term: bool = False) -> Iterator[run.Hooked]:
    """``with saes(llm, [sae]):`` the SAEs spliced in for every forward meanwhile, generation
    included (SAELens' ``HookedSAETransformer.saes`` context; `infer.lens.run.hooks`)."""
    with run.hooks(llm, splices=_splices(saes, use_error_term)) as out:
        yield out


def _config(path: Path) -> dict[str, Any]:
    file = path / CFG_FILE
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: no {CFG_FILE} (an SAE directory as SAELens' save_model writes)"
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return raw


def load_sae(
    path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> SAE:
    """The SAE SAELens saved in directory ``path`` (see the module's docstring), on ``device`` in
    ``dtype`` (default: the file's). Errors name the file, the field or tensor, expected and found."""
    path = Path(path)
    cfg = _config(path)
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    assert isinstance(meta, dict)
    hook_name = meta.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")
    if not isinstance(hook_name, str):
        raise ValueError(f"{path / CFG_FILE}: no hook_name (metadata.hook_name or hook_name)")
    architecture = cfg.get("architecture", "standard")
    activation = cfg.get("activation_fn", cfg.get("activation_fn_str", "relu"))
    k = cfg.get("k")
    if architecture == "standard" and activation == "topk":  # SAELens < 6
        architecture, k = "topk", (cfg.get("activation_fn_kwargs") or {}).get("k")
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"{path / CFG_FILE}: architecture {architecture!r} is not supported ({', '.join(ARCHITECTURES)})"
        )
    if architecture == "topk" and not (isinstance(k, int) and k > 0):
        raise ValueError(f"{path / CFG_FILE}: a topk SAE needs k >= 1, got {k!r}")
    norm = cfg.get("normalize_activations", "none") or "none"
    if norm != "none":
        raise ValueError(f"{path / CFG_FILE}: normalize_activations {norm!r} is not supported (only 'none')")
    reshape = cfg.get("reshape_activations") or ("hook_z" if hook_name.endswith("hook_z") else "none")
    d_in, d_sae = cfg.get("d_in"), cfg.get("d_sae")
    file = path / WEIGHTS_FILE
    if not file.exists():
        raise FileNotFoundError(f"{path}: no {WEIGHTS_FILE}")
    weights = load_file(str(file))
    want = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    if architecture == "jumprelu":
        want["threshold"] = (d_sae,)
    extra = sorted(set(weights) - set(want))
    if extra:
        raise ValueError(
            f"{file}: unexpected tensors {extra} for a {architecture} SAE (expected {sorted(want)})"
        )
    for name, shape in want.items():
        if name not in weights:
            raise ValueError(f"{file}: tensor {name} is missing (a {architecture} SAE has {sorted(want)})")
        if tuple(weights[name].shape) != shape:
            raise ValueError(
                f"{file}: tensor {name} has shape {tuple(weights[name].shape)}, expected {shape} "
                f"(d_in={d_in}, d_sae={d_sae} in {CFG_FILE})"
            )
    file_dtype = getattr(torch, str(cfg.get("dtype", "float32")).removeprefix("torch."), None)
    target = dtype or (file_dtype if isinstance(file_dtype, torch.dtype) else weights["W_enc"].dtype)
    weights = {n: t.to(device=device, dtype=target) for n, t in weights.items()}
    sae = SAE(
        weights,
        architecture,
        hook_name,
        k=k if architecture == "topk" else None,
        apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)),
        reshape_hook_z=reshape == "hook_z",
        rescale_acts_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False)),
    )
    sae.path = str(path)
    return sae


__all__ = ["SAE", "SAE_POINTS", "load_sae", "run_with_cache_with_saes", "run_with_saes", "saes"]
