"""The load path, once: a name -> a `Checkpoint` -> one builder -> its destination -> a `DecoderLM`.

`infer.load` reads as these steps:

1. **resolve** (`open_checkpoint`): the path or hub id, its format (the one place that
   asks), its config, and `LoadOptions` with the format's defaults (`Checkpoint.options`);
2. **build** (`build_model`: `infer.assembly.build.ModelBuilder`, the same walk for every
   format and mode) into its destination: resident (`load_model`), streamed under a memory
   budget (`infer.streaming.build_streamed`), or this rank's part of a parallel run
   (`infer.distributed.load_parallel`, with either of the two);
3. **finish**: the deterministic mode, or fused projections for a resident model.

The checkpoint is read by `infer.loader`, the model assembled by `infer.assembly`;
`infer.api.load` wraps the result and the tokenizer in an `LLM`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import infer.models  # noqa: F401  (registers every architecture's config rules with the reader)
from infer.assembly.build import Build, ModelBuilder, load_model
from infer.assembly.options import LoadOptions
from infer.combinations import check_load
from infer.loader.config import ModelConfig, load_config
from infer.loader.source import StoredTensor, WeightSource
from infer.models.base import DecoderLM
from infer.models.projections import fuse_projections, set_deterministic

if TYPE_CHECKING:
    from infer.assembly.repack_cache import RepackCache
    from infer.distributed import Parallel
    from infer.gguf.reader import GGUFFile
    from infer.loader.tokenizer import Tokenizer

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}

# GGUF files default to float32 activations with the packed matrix products in bfloat16:
# torch's CPU int4/int8 kernels take bfloat16 and are 10-30x slower with float32
# (docs/gguf.md has the numbers).
GGUF_COMPUTE_DTYPE = torch.bfloat16


def resolve_dtype(
    dtype: torch.dtype | str | None, default: str | None = None, source: str = "the checkpoint"
) -> torch.dtype:
    """``dtype`` as a torch dtype; ``None`` means ``default`` (``source``'s), else float32.

    Models compute in float32, float16 or bfloat16; anything else (``torch.int8``,
    ``"float64"``, ...) is a `ValueError`.
    """
    choices = "float32, float16 or bfloat16 (a torch dtype or a name such as 'bf16')"
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}: models compute in {choices}")
        return dtype
    if dtype is not None and not isinstance(dtype, str):
        raise TypeError(f"dtype must be a torch.dtype or a string, got {dtype!r} ({type(dtype).__name__})")
    name = dtype if dtype is not None else default
    if name is None:
        return torch.float32
    name = str(name).removeprefix("torch.")
    try:
        return _DTYPES[name]
    except KeyError:
        if dtype is None:
            raise ValueError(
                f"{source}: 'torch_dtype' = {default!r} is not a dtype models compute in; "
                f"pass dtype= ({choices})"
            ) from None
        raise ValueError(f"unsupported dtype {name!r}: models compute in {choices}") from None


def resolve_checkpoint(path_or_hub_id: str | os.PathLike[str]) -> Path:
    """A local directory or .gguf file, or a hub id found in the local HF cache (or downloaded)."""
    path = Path(path_or_hub_id).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ggufs[0]
            raise FileNotFoundError(f"{path} has no config.json: not a HuggingFace checkpoint directory")
        return path
    hub_id = str(path_or_hub_id)
    if hub_id.count("/") != 1 or hub_id.startswith((".", "/", "~")):
        raise FileNotFoundError(f"no such file or directory: {hub_id}")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(hub_id, allow_patterns=patterns, local_files_only=True))
    except Exception:  # not in the local cache: try the network below, if it can be a hub id
        pass
    if _looks_like_a_path(hub_id):
        raise FileNotFoundError(f"{hub_id}: no such file or directory; not a hub id in the local cache")
    try:
        return Path(snapshot_download(hub_id, allow_patterns=patterns))
    except Exception as e:
        raise FileNotFoundError(
            f"model {hub_id!r} is not on disk and could not be downloaded ({type(e).__name__}). "
            f"On a machine with internet run `huggingface-cli download {hub_id}` (or pass a local "
            f"directory with config.json + *.safetensors)."
        ) from None


# A name ending so is a file someone meant, never a hub repository worth asking the network about.
_FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin", ".pt", ".pth", ".txt")


def _looks_like_a_path(name: str) -> bool:
    """Whether a missing ``a/b`` names a local file rather than a hub id: a file suffix, or ``a`` exists."""
    first = name.split("/", 1)[0]
    return name.lower().endswith(_FILE_SUFFIXES) or Path(first).expanduser().exists()


@dataclass
class Checkpoint:
    """A resolved checkpoint: ``path``, its ``format`` (``"safetensors"`` or ``"gguf"``) and config.

    ``config.torch_dtype`` is the checkpoint's (a GGUF file has none until `options` sets
    the dtype a load computes in).
    """

    path: Path
    format: str
    config: ModelConfig
    gguf: GGUFFile | None = None

    @property
    def config_file(self) -> Path:
        """The file the config came from (named in errors)."""
        return self.path if self.gguf is not None else self.path / "config.json"

    def options(self, dtype: torch.dtype | str | None = None, **fields: Any) -> LoadOptions:
        """`LoadOptions` for this checkpoint: ``dtype`` resolved against the format's default.

        A GGUF file: float32 activations and bfloat16 packed products unless ``dtype`` is
        given (then both are ``dtype``); ``quantize`` is refused (the file is quantized).
        Safetensors: ``dtype`` defaults to the config's ``torch_dtype``.
        """
        if self.gguf is not None:
            check_load(quantize=fields.get("quantize"), gguf=str(self.path))
            run = torch.float32 if dtype is None else resolve_dtype(dtype)
            compute = GGUF_COMPUTE_DTYPE if dtype is None else run
            self.config.torch_dtype = str(run).removeprefix("torch.")
            return LoadOptions(dtype=run, compute_dtype=compute, **fields)
        run = resolve_dtype(dtype, self.config.torch_dtype, str(self.config_file))
        return LoadOptions(dtype=run, **fields)

    def source(self) -> WeightSource:
        """A new `WeightSource` over the stored tensors (the caller closes it)."""
        if self.gguf is not None:
            from infer.gguf.source import GGUFSource

            return GGUFSource(self.gguf)
        from infer.loader.weights import SafetensorsSource

        return SafetensorsSource(self.path)

    def stored_tensors(self) -> list[StoredTensor]:
        """Every stored tensor (name, shape, dtype or GGML type, bytes), without reading data."""
        source = self.source()
        try:
            return list(source.tensors().values())
        finally:
            source.close()

    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer (its files, or the vocabulary a GGUF file carries)."""
        if self.gguf is not None:
            from infer.gguf.tokenizer import gguf_tokenizer

            return gguf_tokenizer(self.gguf, self.config)
        from infer.loader.tokenizer import Tokenizer

        return Tokenizer(self.path, eos_token_id=self.config.eos_token_id)

    def repack_cache(self, options: LoadOptions) -> RepackCache | None:
        """The on-disk cache of a GGUF file's converted matrices, when ``options`` ask for it."""
        if self.gguf is None or not options.repack_cache or options.streaming is not None or options.parallel:
            return None
        from infer.assembly.repack_cache import RepackCache

        return RepackCache(
            self.path,
            data_start=self.gguf.data_offset,
            compute_dtype=options.products_dtype,
            device=options.device,
        )


def open_checkpoint(path_or_hub_id: str | os.PathLike[str]) -> Checkpoint:
    """Resolve ``path_or_hub_id`` and read its config (nothing else is read yet)."""
    path = resolve_checkpoint(path_or_hub_id)
    if path.suffix == ".gguf":
        from infer.gguf import GGUFFile, config_from_gguf

        gguf = GGUFFile(path)
        return Checkpoint(path, "gguf", config_from_gguf(gguf), gguf)
    return Checkpoint(path, "safetensors", load_config(path))


def _destination(options: LoadOptions) -> Build:
    """Where the builder's walk puts the model: resident, or streamed under a memory budget."""
    if options.streaming is None:
        return load_model
    from infer.streaming import build_streamed

    return build_streamed


def build_model(checkpoint: Checkpoint, options: LoadOptions) -> tuple[DecoderLM, Parallel | None]:
    """The model ``options`` ask for, and this rank's place in a parallel run (None in one process).

    A streamed model keeps its `WeightSource` open (its executor closes it); every other
    build closes it before returning, and every build closes it on failure.
    """
    source = checkpoint.source()
    parallel: Parallel | None = None
    try:
        build = _destination(options)
        if options.parallel:
            from infer.distributed import load_parallel

            model, parallel = load_parallel(source, checkpoint.config, options, build=build)
        else:
            repack = checkpoint.repack_cache(options)
            model = build(ModelBuilder(source, checkpoint.config, options, repack=repack))
    except BaseException:
        source.close()
        raise
    if options.streaming is None:
        source.close()
    if options.deterministic:
        set_deterministic(model)
    elif options.streaming is None and not options.parallel:
        fuse_projections(model)  # q/k/v and gate/up as one product each
    return model, parallel


__all__ = [
    "GGUF_COMPUTE_DTYPE",
    "Checkpoint",
    "build_model",
    "open_checkpoint",
    "resolve_checkpoint",
    "resolve_dtype",
]
