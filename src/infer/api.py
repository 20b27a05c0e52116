"""The public API: `load` a checkpoint, get an `LLM` (`infer.llm`), generate text."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch

import infer.aot.tiles  # noqa: F401  (registers the dequantized tiles' packages: infer.quant.tiles)
from infer.aot import PackageCache, Recipe
from infer.aot import pays as aot_pays
from infer.combinations import check_load
from infer.distributed.runtime import agree
from infer.execution import Execution
from infer.host.pages import keep_freed_blocks
from infer.loading import build_model, open_checkpoint
from infer.loading import resolve_checkpoint as resolve_checkpoint  # kept importable here
from infer.loading import resolve_dtype as resolve_dtype  # (the CLI imports it from here)
from infer.models.base import DecoderLM
from infer.params import MAX_SPECULATIVE, check_int
from infer.realmodels import resolve_name
from infer.speculative.settings import MAX_LOOKUP

if TYPE_CHECKING:
    from infer.speculative import Speculative
    from infer.streaming import StreamingConfig

from infer.llm import LLM as LLM
from infer.llm import GenerationResult as GenerationResult
from infer.llm import Message as Message
from infer.llm import Prompt as Prompt
from infer.llm import SamplingOptions as SamplingOptions

ProgressFn = Callable[[int, int], None]


def check_bool(name: str, value: object) -> None:
    """`TypeError` naming ``name`` unless ``value`` is a bool (``1``, ``"no"`` and None are not)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r} ({type(value).__name__})")


def load(
    path_or_hub_id: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    *,
    quantize: str | None = None,
    streaming: StreamingConfig | None = None,
    progress: ProgressFn | None = None,
    validate: bool = True,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    compile: bool | Literal["auto"] | None = None,
    deterministic: bool = False,
    cache: bool = True,
    lookup: int = 0,
    draft: str | os.PathLike[str] | LLM | None = None,
    speculative_tokens: int | None = None,
    kv_dtype: str | torch.dtype | None = None,
) -> LLM:
    """Load a checkpoint and its tokenizer into an `LLM`.

    ``path_or_hub_id``: a directory with ``config.json`` + safetensors (+ tokenizer
    files), a ``.gguf`` file, a hub id already in the local HF cache (or
    downloadable), or the name of a real model infer knows (``"smollm2"``,
    ``"gemma3-270m"``, ``"qwen-coder-1.5b"``, ``"qwen-coder-0.5b"``: `infer.realmodels`,
    fetched and cached once, with a progress bar; an unknown name lists them).
    ``dtype`` defaults to the checkpoint's; a GGUF file's default is float32 activations
    with its packed matrix products in bfloat16 (``dtype=torch.float32`` computes everything in
    float32: exact, slower). ``quantize`` ("q4_0" or "int8") quantizes the weight matrices of a
    safetensors checkpoint at load time.
    ``streaming`` runs the layers through the device under a memory budget instead of
    keeping them resident. ``validate`` refuses weights holding NaN or inf (a pass over
    every weight; streamed weights are checked the first time they are read).
    ``progress(done, total)`` is called as modules load. Each keyword is checked before anything is
    read: the bool options (``validate``, ``deterministic``, ``cache``) take bools only, the int ones
    (``tensor_parallel``, ``pipeline_parallel``, ``lookup``, ``speculative_tokens``) ints only, not
    bools (a `TypeError` naming the argument, what it expected and what it got).

    ``tensor_parallel`` / ``pipeline_parallel`` (T, P): run across ``T x P`` processes of
    `torch.distributed` (under ``torchrun``, or any initialized default process group;
    without one it is initialized from torchrun's environment variables: gloo on CPU,
    NCCL on CUDA). Every rank calls ``load`` with the same arguments and reads only its
    part of the weights; generation then gives the same result on every rank. See
    docs/distributed.md.

    ``compile`` (resident models only; `infer.execution`): ``"auto"`` runs each decode step from an
    ahead-of-time compiled package of its shape in the user's cache directory, and eagerly
    where there is none (`infer.aot`: the missing shapes are built after the process, while the
    machine is otherwise idle; CPU, outside the deterministic mode; prefill stays eager); ``True`` compiles
    every step in this process with ``torch.compile`` (the first request of each new (batch,
    length) bucket waits for it); ``False`` never compiles. ``None`` means `compile_by_default`.

    ``deterministic`` runs every matrix product on fixed tiles of rows and attention on
    fixed tiles of queries and keys, so a prompt's logits are bitwise the same whatever
    else is in its batch, however its prompt is chunked, and whether its layers are
    resident or streamed — on any CPU. It costs speed at small batches; docs/numerics.md has
    the contract and the figures.

    ``cache``: keep what loading computes from a GGUF file (its matrices converted for the
    packed kernels) in a file under the user's cache directory, and reuse it in later
    processes while the GGUF file is unchanged (`infer.assembly.repack_cache`; resident,
    single-process loads). ``cache=False`` converts every time and writes nothing.

    ``kv_dtype``: what the KV cache holds ("float32", "bfloat16", "float16", or "int8": int8
    values with a float32 scale per token and head); narrower K/V are widened to the
    activations' dtype when attention reads them. None: `default_kv_dtype` (the model's dtype on
    CPU; docs/engine.md, *KV memory*, has the memory and speed of each, docs/numerics.md the
    perplexity).

    Speculative decoding (docs/speculative.md; every `generate` / `stream` / `chat` call and the
    server use it): ``lookup=N`` proposes tokens by n-gram lookup in the prompt and the text so far
    (the last N tokens, then fewer); ``draft`` proposes them with a draft model: a path (loaded
    on ``device`` at its default settings and this ``kv_dtype``), an `LLM`, or ``"self"`` (this
    checkpoint's weights packed: a GGUF file at its default, packed products, safetensors
    quantized to Q4_0). Its tokenizer must equal this one's (`ValueError` naming the first token
    that differs). A request with a constraint, a logit bias or a penalty never speculates, and a
    decode step it takes part in is a plain one (docs/speculative.md).
    ``speculative_tokens`` bounds the tokens proposed per pass (default 16); each pass proposes
    what its measured cost and the acceptance so far say pays, down to none. Greedy tokens are
    plain decoding's (bitwise in the deterministic mode); sampled tokens are distributed as the
    model's.
    """
    for name, flag in (("validate", validate), ("deterministic", deterministic), ("cache", cache)):
        check_bool(name, flag)
    check_int("tensor_parallel", tensor_parallel, 1)
    check_int("pipeline_parallel", pipeline_parallel, 1)
    check_int("lookup", lookup, 0, MAX_LOOKUP)
    if speculative_tokens is not None:
        check_int("speculative_tokens", speculative_tokens, 1, MAX_SPECULATIVE)
    from infer.streaming import StreamingConfig

    if streaming is not None and not isinstance(streaming, StreamingConfig):
        raise TypeError(f"streaming must be an infer.StreamingConfig or None, got {type(streaming).__name__}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable (done, total) or None, got {progress!r}")
    device = torch.device(device)
    parallel = tensor_parallel != 1 or pipeline_parallel != 1
    if compile is not None and not isinstance(compile, bool) and compile != "auto":
        error = ValueError if isinstance(compile, str) else TypeError
        raise error(f"compile must be True, False, 'auto' or None, got {compile!r}")
    check_load(compile=compile, streaming=streaming, tensor_parallel=tensor_parallel,
               pipeline_parallel=pipeline_parallel, quantize=quantize)  # fmt: skip
    checkpoint = open_checkpoint(resolve_name(path_or_hub_id))
    options = checkpoint.options(
        dtype, quantize=quantize, validate=validate, device=device, streaming=streaming,
        tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
        deterministic=deterministic, repack_cache=cache, progress=progress,
    )  # fmt: skip
    kv = resolve_kv_dtype(kv_dtype)  # checked before the (slow) load
    tokenizer = checkpoint.tokenizer()
    model, placed = build_model(checkpoint, options)
    keep_freed_blocks()  # INFER_MALLOC=keep: every forward reuses freed blocks (infer.host.pages)
    model.kv_dtype = kv if kv is not None else default_kv_dtype(model)

    def packages() -> PackageCache | None:  # the recipe rebuilds this model for a build (infer.aot)
        if not aot_pays(model):
            return None
        dtype_name = None if dtype is None else str(dtype).removeprefix("torch.")
        kv_name = str(model.cache_dtype).removeprefix("torch.")
        return PackageCache(model, Recipe(str(checkpoint.path), dtype_name, quantize, kv_dtype=kv_name))

    execution = Execution.choose(
        model, compile_by_default(device) if compile is None else compile, streamed=streaming is not None,
        parallel=parallel, deterministic=deterministic, packages=packages,
    )  # fmt: skip
    llm = LLM(checkpoint.config, tokenizer, model, checkpoint.path, execution)
    llm.parallel = placed
    if lookup or draft is not None or speculative_tokens is not None:
        args = (lookup, draft, speculative_tokens, device, deterministic, kv_dtype)
        if placed is None:
            llm.speculative = _speculative(llm, *args)
        else:  # only rank 0 plans, so it alone proposes: its verify passes reach every rank in its plans
            rank = placed.rank

            def settings() -> tuple[Speculative | None]:
                return (_speculative(llm, *args) if rank == 0 else None,)

            llm.speculative = agree(placed, settings)[0]  # a draft refused on rank 0 fails every rank
    return llm


def resolve_kv_dtype(kv_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``load``'s ``kv_dtype`` as a torch dtype (None: `default_kv_dtype`); a clear error otherwise."""
    from infer.kv.cache import KV_DTYPES

    if kv_dtype is None or kv_dtype == "auto":
        return None
    if isinstance(kv_dtype, torch.dtype):
        kv_dtype = str(kv_dtype).removeprefix("torch.")
    if not isinstance(kv_dtype, str):
        raise TypeError(f"kv_dtype must be a string or a torch.dtype, got {type(kv_dtype).__name__}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} (or None), got {kv_dtype!r}")
    dtype: torch.dtype = getattr(torch, kv_dtype)
    return dtype


def default_kv_dtype(model: DecoderLM) -> torch.dtype | None:
    """The KV dtype of a model loaded without ``kv_dtype``: on CUDA, bfloat16 where its matrix
    products are packed bfloat16 products under wider activations (a GGUF file's default); else
    None, the model's own dtype (on CPU a narrower KV costs more than it saves: docs/engine.md)."""
    from infer.quant.linear import QuantizedLinear

    if model.device.type != "cuda" or model.dtype in (torch.bfloat16, torch.float16):
        return None
    products = {m.compute_dtype for m in model.modules() if isinstance(m, QuantizedLinear)}
    return torch.bfloat16 if torch.bfloat16 in products else None


def _speculative(
    llm: LLM,
    lookup: int,
    draft: str | os.PathLike[str] | LLM | None,
    tokens: int | None,
    device: torch.device,
    deterministic: bool,
    kv_dtype: str | torch.dtype | None = None,
) -> Speculative:
    """`load`'s speculative settings, checked, with the draft model loaded (in this process: under
    tensor/pipeline parallelism only rank 0 drafts, with the whole draft model)."""
    from infer.speculative import DEFAULT_TOKENS, Speculative, check_draft

    if lookup == 0 and draft is None:
        raise ValueError("speculative_tokens needs lookup >= 1 or a draft model")
    if draft is not None and not isinstance(draft, LLM):
        itself = isinstance(draft, str) and draft == "self"
        # "self": a GGUF file at its default (packed products on bfloat16 activations), else Q4_0
        quantize = "q4_0" if itself and llm.source.suffix != ".gguf" else None
        source = llm.source if itself else draft
        draft = load(source, device=device, quantize=quantize, deterministic=deterministic, kv_dtype=kv_dtype)
    if draft is not None:
        check_draft(llm, draft)
    return Speculative(lookup, draft, DEFAULT_TOKENS if tokens is None else tokens)


def compile_by_default(device: torch.device) -> bool | Literal["auto"]:
    """What `load` compiles when ``compile`` is not given: ``"auto"`` on CPU (it never waits for a
    compiler: `infer.aot`; docs/performance.md, *Compiled by default*), nothing elsewhere (CUDA
    packages are not built yet)."""
    return "auto" if device.type == "cpu" else False
