"""The load path, once: a resolved checkpoint -> one builder -> placement -> a `DecoderLM`.

`infer.load` reads as these steps:

1. **resolve** (`infer.loader.checkpoint.open_checkpoint`): the path or hub id, its
   format (the one place that asks), its config, and `LoadOptions` with the format's
   defaults;
2. **build** (`infer.loader.build.ModelBuilder`, the same walk for every format and mode)
   into its **place**: resident on the device (`load_model`), streamed under a memory
   budget (`infer.streaming.build_streamed`), or this rank's part of a tensor- /
   pipeline-parallel run (`infer.distributed.load_parallel`, either of the two per rank);
3. **finish**: the deterministic mode, or fused projections for a resident model.

`infer.api.load` wraps the result and the tokenizer in an `LLM`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from infer.loader.build import Build, ModelBuilder, load_model
from infer.loader.checkpoint import Checkpoint
from infer.loader.options import LoadOptions
from infer.models.base import DecoderLM
from infer.models.common import fuse_projections, set_deterministic

if TYPE_CHECKING:
    from infer.distributed import Parallel


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


__all__ = ["build_model"]
