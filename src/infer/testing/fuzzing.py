"""Mutated checkpoints for robustness tests: seed files, structured mutations, outcome classes.

`build_seeds` writes small valid inputs: a tiny Llama GGUF (Q8_0, with tokenizer), a
tiny safetensors checkpoint (single file) and a sharded one (index + shards). `mutate`
derives case ``index`` of a run deterministically from ``(seed, index)`` and writes it
into a work directory: bit flips, byte changes, truncation, integer fields set to
boundary values (0, 1, 2^31, 2^32-1, 2^63, negative...), NaN / infinite floats,
duplicated or shifted tensor offsets, swapped types, huge counts; for safetensors the
header's JSON entries and length field, the index's weight map and config.json values
are mutated as data. `run_case` feeds the result to the public entry points
(`GGUFFile`, `load_config`, `inspect_checkpoint`, `infer.load` and a two-token
`generate`) and `classify` names the outcome: loaded, rejected with a documented error
(``ValueError`` / ``OSError``; whether the message names the file), memory-capped, or
an undocumented exception, with the innermost `infer` source file it came from.

Used by ``tests/integration/test_fuzz.py`` (bounded, in process) and
``benchmarks/fuzz.py`` (100,000 inputs in worker processes with timeouts and a memory cap).

The parts: `infer.testing.fuzz_cases` (seeds, `Mutator`), `infer.testing.fuzz_gguf` (the
GGUF header walker and its mutations), `infer.testing.fuzz_json` (safetensors, index and
config mutations), `infer.testing.fuzz_run` (`run_case`, `classify`).
"""

from __future__ import annotations

from infer.testing.fuzz_cases import KIND_WEIGHTS, KINDS, Case, Mutator, Seeds, build_seeds
from infer.testing.fuzz_gguf import FLOAT_VALUES, U32_VALUES, U64_VALUES, GGUFLayout, gguf_layout, mutate_gguf
from infer.testing.fuzz_json import (
    JSON_VALUES,
    ST_DTYPES,
    mutate_config,
    mutate_index,
    mutate_json,
    mutate_safetensors,
)
from infer.testing.fuzz_run import DOCUMENTED, CaseTimeout, Outcome, classify, infer_frames, run_case

__all__ = [
    "DOCUMENTED",
    "FLOAT_VALUES",
    "JSON_VALUES",
    "KINDS",
    "KIND_WEIGHTS",
    "ST_DTYPES",
    "U32_VALUES",
    "U64_VALUES",
    "Case",
    "CaseTimeout",
    "GGUFLayout",
    "Mutator",
    "Outcome",
    "Seeds",
    "build_seeds",
    "classify",
    "gguf_layout",
    "infer_frames",
    "mutate_config",
    "mutate_gguf",
    "mutate_index",
    "mutate_json",
    "mutate_safetensors",
    "run_case",
]
