"""Mutated checkpoints through the public entry points: each loads or is refused cleanly (issue 10).

A bounded, seeded run of `infer.testing.fuzzing` (``benchmarks/fuzz.py`` runs 100,000 inputs in
worker processes): structured mutations of a tiny GGUF file, a safetensors header, an
index json and config.json, fed to `GGUFFile` / `load_config`, `inspect_checkpoint`,
`infer.load` and a two-token `generate`. Every input must load or raise a documented
error (``ValueError`` / ``OSError``) naming it. A good share must be refused and some
must load, or the run proves nothing. Each case runs under a time limit (SIGALRM: a hang is an outcome) and
the whole run under an address-space cap, so a hang or a runaway allocation fails the
test instead of the machine.
"""

from __future__ import annotations

import resource
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infer.gguf.writer import write_gguf
from infer.testing import build_tokenizer, tiny_hf_model
from infer.testing.fuzzing import Case, Mutator, Outcome, Seeds, run_case

SEED = 0
CASES = {"gguf": 100, "safetensors": 70, "index": 30, "config": 70}
CASE_LIMIT_S = 10  # generous: a case takes ~30 ms; the limit only catches hangs
MEMORY_CAP = 3 * 2**30  # address space over the process's own while the cases run


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@pytest.fixture(scope="module")
def outcomes(tiny_ckpt_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Outcome]]:
    d = tmp_path_factory.mktemp("fuzz")
    model = tiny_hf_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    gguf = write_gguf(d / "seed.gguf", model, build_tokenizer(d / "tok"), qtype="Q8_0")
    seeds = Seeds(gguf, tiny_ckpt_factory("qwen3"), tiny_ckpt_factory("llama", sharded=True))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(d / "cache"))
        for kind, path in (("gguf", gguf), ("safetensors", seeds.safetensors), ("index", seeds.sharded)):
            warm = run_case(Case(-1, kind, path, "seed"))  # imports and caches, outside the time limits
            assert warm.outcome == "loaded", warm
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + MEMORY_CAP, hard))
        try:
            results = []
            for kind, n in CASES.items():
                mutator = Mutator(seeds, d / f"work-{kind}", SEED, (kind,))
                results += [run_case(mutator.case(i), time_limit=CASE_LIMIT_S) for i in range(n)]
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    yield results


def report(outcomes: list[Outcome]) -> None:
    print()
    for kind in CASES:
        counts = Counter(o.outcome for o in outcomes if o.kind == kind)
        print(f"{kind:12s} {dict(counts)}")
    for o in outcomes:
        if o.outcome not in ("loaded", "rejected"):
            where = f"{o.outcome} {o.error} at {o.stage} ({o.origin})"
            print(f"  #{o.index} {o.kind} {o.mutation}: {where}")
            print(f"        {o.message[:160]!r}")


def test_every_input_loads_or_is_refused_cleanly(outcomes: list[Outcome]) -> None:
    report(outcomes)
    assert len(outcomes) == sum(CASES.values())
    unexpected = [o for o in outcomes if o.outcome not in ("loaded", "rejected")]
    assert not unexpected, [(o.kind, o.mutation, o.outcome, o.error, o.origin, o.message) for o in unexpected]
    for kind, n in CASES.items():
        counts = Counter(o.outcome for o in outcomes if o.kind == kind)
        assert counts["rejected"] >= n // 2, (kind, counts)  # most mutations must be caught...
        if kind != "index":  # (about 2% of index mutations leave a loadable checkpoint)
            assert counts["loaded"] >= 1, (kind, counts)  # ...and some still load (the seed is valid)
    loaded = sum(o.outcome == "loaded" for o in outcomes)
    assert loaded >= 0.05 * len(outcomes)
