"""Mutated checkpoints for robustness tests: seed files, structured mutations, outcome classes.

`build_seeds` writes small valid inputs (a tiny GGUF, a safetensors checkpoint, a sharded one);
`mutate` derives case ``index`` from ``(seed, index)``; `run_case` feeds it to the public entry
points and `classify` names the outcome. Used by ``tests/integration/test_fuzz.py`` and
``benchmarks/fuzz.py``; the parts are `fuzz_cases`, `fuzz_gguf`, `fuzz_json` and `fuzz_run`.
See docs/reliability.md, "Fuzzing".
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
