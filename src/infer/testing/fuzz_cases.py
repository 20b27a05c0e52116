"""The cases of a fuzzing run (`infer.testing.fuzzing`): the valid seed inputs (`build_seeds`) and
`Mutator`, which derives case ``index`` of a run from ``(seed, index)`` and writes it."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from infer.testing.fuzz_gguf import gguf_layout, mutate_gguf
from infer.testing.fuzz_json import mutate_config, mutate_index, mutate_safetensors

KINDS = ("gguf", "safetensors", "index", "config")
KIND_WEIGHTS = (0.4, 0.25, 0.1, 0.25)


@dataclass(frozen=True)
class Seeds:
    """Paths of the valid inputs the mutations start from."""

    gguf: Path  # a .gguf file
    safetensors: Path  # a checkpoint directory (model.safetensors)
    sharded: Path  # a checkpoint directory (index + shards)


def build_seeds(directory: Path) -> Seeds:
    """Write the seed inputs into ``directory`` (once; later calls reuse them)."""
    from infer.gguf.writer import write_gguf
    from infer.testing import build_checkpoint, build_tokenizer, tiny_hf_model

    directory.mkdir(parents=True, exist_ok=True)
    gguf = directory / "tiny-llama-q8_0.gguf"
    if not gguf.is_file():
        model = tiny_hf_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        tmp = directory / "tmp.gguf"
        write_gguf(tmp, model, build_tokenizer(directory / "gguf-tokenizer"), qtype="Q8_0")
        tmp.rename(gguf)
    single, sharded = directory / "safetensors", directory / "sharded"
    if not (single / "config.json").is_file():
        build_checkpoint(single, "qwen3")
    if not (sharded / "config.json").is_file():
        build_checkpoint(sharded, "llama", sharded=True)
    return Seeds(gguf, single, sharded)


@dataclass
class Case:
    """One mutated input, written: what to feed (``path``) and how it was made."""

    index: int
    kind: str
    path: Path
    mutation: str
    streaming: bool = False


class Mutator:
    """Writes case ``index`` of run ``seed`` into ``work`` (one directory per kind, reused)."""

    def __init__(self, seeds: Seeds, work: Path, seed: int, kinds: tuple[str, ...] = KINDS) -> None:
        self.seeds = seeds
        self.work = work
        self.seed = seed
        self.kinds = kinds
        self.weights = [KIND_WEIGHTS[KINDS.index(k)] for k in kinds]
        self.gguf_bytes = seeds.gguf.read_bytes()
        self.layout = gguf_layout(self.gguf_bytes)
        self.st_bytes = (seeds.safetensors / "model.safetensors").read_bytes()
        self.config = json.loads((seeds.safetensors / "config.json").read_text())
        self.index = json.loads((seeds.sharded / "model.safetensors.index.json").read_text())
        self.shards = sorted(set(self.index["weight_map"].values()))
        for name, src in (("safetensors", seeds.safetensors), ("index", seeds.sharded)):
            target = work / name
            if not target.is_dir():
                shutil.copytree(src, target)
        (work / "gguf").mkdir(parents=True, exist_ok=True)

    def case(self, index: int) -> Case:
        rng = random.Random(f"{self.seed}:{index}")
        kind = rng.choices(self.kinds, self.weights)[0]
        streaming = rng.random() < 0.1
        if kind == "gguf":
            data, desc = mutate_gguf(self.gguf_bytes, self.layout, rng)
            path = self.work / "gguf" / "model.gguf"
            path.write_bytes(data)
            return Case(index, kind, path, desc, streaming)
        if kind == "index":
            directory = self.work / "index"
            text, desc = mutate_index(self.index, self.shards, rng)
            (directory / "model.safetensors.index.json").write_text(text, encoding="latin-1")
            return Case(index, kind, directory, desc, streaming)
        directory = self.work / "safetensors"
        if kind == "safetensors":
            data, desc = mutate_safetensors(self.st_bytes, rng)
            (directory / "model.safetensors").write_bytes(data)
            (directory / "config.json").write_text(json.dumps(self.config))
        else:
            text, desc = mutate_config(self.config, rng)
            (directory / "model.safetensors").write_bytes(self.st_bytes)
            (directory / "config.json").write_text(text, encoding="latin-1")
        return Case(index, kind, directory, desc, streaming)
