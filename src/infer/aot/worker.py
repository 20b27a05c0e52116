"""The worker: ``python -m infer.aot REQUEST``, the process that builds one package.

Started by the builder (`infer.aot.builder`) once the machine is idle, at ``SCHED_IDLE`` with one
compile thread: loads the same checkpoint the same way (`Recipe`), checks the fingerprint, builds
(`infer.aot.export.build`) or leaves a ``.failed`` marker, and prunes (`infer.aot.prune`). A
request for a dequantized tile's kernel loads no model (`infer.aot.tiles.build`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.aot.export import build
from infer.aot.keys import fingerprint
from infer.aot.prune import prune
from infer.loading import build_model, open_checkpoint
from infer.models.base import DecoderLM
from infer.sampling import Sampling


@dataclass(frozen=True)
class Recipe:
    """How the building process loads the same model: `infer.load`'s arguments."""

    path: str
    dtype: str | None = None
    quantize: str | None = None
    validate: bool = False
    kv_dtype: str | None = None  # `DecoderLM.kv_dtype` as set at load (None: the model's dtype)

    def load(self) -> DecoderLM:
        """The model as `infer.load` builds it (resident, on the CPU, outside the deterministic mode)."""
        checkpoint = open_checkpoint(self.path)
        options = checkpoint.options(self.dtype, quantize=self.quantize, validate=self.validate,
                                     device=torch.device("cpu"), streaming=None, tensor_parallel=1,
                                     pipeline_parallel=1, deterministic=False, repack_cache=True,
                                     progress=None)  # fmt: skip
        model, _ = build_model(checkpoint, options)
        if self.kv_dtype is not None:
            model.kv_dtype = getattr(torch, self.kv_dtype)
        return model


def _yield_the_cpu() -> None:
    """Run (and let the compiler's children run) only when the CPU would otherwise idle.

    nice 19 is not enough (a core held for a scheduler slice stalls an OpenMP step:
    docs/performance.md); ``SCHED_IDLE`` yields at once to any waking thread."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    with contextlib.suppress(OSError):
        os.nice(19)


def main(argv: list[str]) -> int:
    """``python -m infer.aot REQUEST``: build the package asked for (the worker `aot.builder` starts)."""
    parser = argparse.ArgumentParser(prog="python -m infer.aot")
    parser.add_argument("request", help="JSON {recipe, key, batch, mode, out, files}")
    request = json.loads(parser.parse_args(argv).request)
    _yield_the_cpu()
    torch._inductor.config.compile_threads = 1  # this process only: leave the cores to the user's
    out = Path(request["out"])
    t0 = time.perf_counter()
    try:
        if "tile" in request:  # a dequantized tile's kernel: no model to load
            from infer.aot import tiles

            tiles.build(tiles.Spec.of_request(request["tile"]), out)
            print(f"built {out.name} in {time.perf_counter() - t0:.1f} s", flush=True)
            return 0
        model = Recipe(**request["recipe"]).load()
        fp = fingerprint(model)
        if not request["key"].startswith(fp + "-"):
            raise RuntimeError(f"the model loaded here has fingerprint {fp}, not the one asked for")
        mode = Sampling(**request["mode"])
        build(model, request["batch"], mode, out, request.get("width", 1))
    except Exception as e:
        out.with_suffix(".failed").write_text(f"{type(e).__name__}: {e}\n")
        print(f"failed {out.name}: {type(e).__name__}: {e}", flush=True)
        return 1
    finally:
        prune(out.parent)
    print(f"built {out.name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0
