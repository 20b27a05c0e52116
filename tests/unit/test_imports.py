"""The import graph of `infer`: no circle, and no module importing a higher floor.

Every ``import`` / ``from ... import`` in every module under ``src/infer`` counts: at
module level, inside functions and under ``if TYPE_CHECKING:`` alike (a type-only arrow
still says which module knows which). ``from package import name`` is an arrow to the
submodule when ``name`` is one, else to the package. A run-time import of ``a.b.c`` also
runs ``a/b/__init__.py``: that is an arrow to the package ``a.b`` too, unless ``a.b``
contains the importing module (a package's own ``__init__`` runs before its modules
anyway) or is ``infer`` itself (whose ``__init__`` imports nothing when it runs).

`FLOORS` is the layering rule of docs/architecture.md: a module may import its own floor
and those below, never a higher one.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# Lowest first. A module's floor is that of its longest listed prefix; "=name" matches
# ``name`` only (a package whose ``__init__`` is below its modules).
FLOORS: list[tuple[str, ...]] = [
    # 0: no infer imports but each other's: numerics, formats, the config record, text rules
    (
        "infer.host",
        "infer.params",
        "infer.sampling",
        "infer.combinations",
        "infer.aot.idle",
        "infer.aot.builder",
        "infer.quant",
        "infer.text",
        "infer.loader.config",
        "infer.loader.source",
        "infer.assembly.options",
        "infer.gguf.reader",
        "infer.gguf.metadata",
        "infer.streaming.stats",
        "infer.streaming.config",
        "infer.distributed.runtime",
        "=infer.loader",  # a docstring only
        "=infer.assembly",  # a docstring only
    ),
    # 1: what a model runs on, and the stored checkpoint's readers; KV memory (the models write
    # their K/V into its cache; it knows a model only as a Protocol, `infer.kv.cache.KVModel`)
    (
        "infer.kv",
        "infer.loader",
        "infer.gguf.source",
        "infer.gguf.tokenizer",
    ),
    # 2: the models and the architecture records; interventions on their modules
    ("infer.models", "infer.interventions"),
    # 3: a model assembled from stored tensors (names, placement, the builder), the GGUF config
    # reader and writer, TP shards
    ("infer.assembly", "infer.gguf", "infer.distributed.shard"),
    # 4: execution modes beyond resident
    ("infer.streaming", "infer.distributed"),
    # 5: the load path that composes them; generation
    (
        "infer.loading",
        "infer.execution",
        "infer.aot",
        "infer.speculative",
        "infer.engine",
    ),
    # 6: the public API and what is built on a loaded model
    (
        "infer.llm",
        "infer.api",
        "infer.inspect",
        "infer.perplexity",
        "infer.realmodels",
        "infer.notebook",
        "infer.scores",
        "infer.lens",
        "infer.loglikelihood",
    ),
    # 7: front ends and test support
    ("=infer", "infer.cli", "infer.__main__", "infer.serve", "infer.testing", "infer.evaluation"),
]


def module_names() -> dict[str, Path]:
    names = {}
    for path in sorted((SRC / "infer").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = module_names()


def _owner(name: str) -> str | None:
    """The infer module ``name`` lives in (``infer.models.arch.Fix`` -> ``infer.models.arch``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(n) for b in node.body for n in ast.walk(b))
    return ids


def _packages_run(module: str, target: str) -> Iterator[str]:
    """The packages whose ``__init__`` importing ``target`` runs, beyond ``module``'s own."""
    parts = target.split(".")
    for i in range(2, len(parts)):
        package = ".".join(parts[:i])
        if package in MODULES and not module.startswith(package + "."):
            yield package


def imports_of(module: str) -> Iterator[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    type_only = _type_only(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            targets = subs or [base]
        else:
            continue
        for target in targets:
            owner = _owner(target)
            if owner is not None and owner != module:
                yield owner
                if id(node) not in type_only:
                    yield from (p for p in _packages_run(module, owner) if p != module)


GRAPH = {m: sorted(set(imports_of(m))) for m in MODULES}


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One import circle (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in graph[v]:
            if state.get(w) == 1:
                return [*path[path.index(w) :], w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        path.pop()
        state[v] = 2
        return None

    for v in graph:
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def floor(module: str) -> int:
    best, level = -1, -1
    for i, prefixes in enumerate(FLOORS):
        for p in prefixes:
            exact = p.startswith("=")
            name = p.removeprefix("=")
            hit = module == name or (not exact and module.startswith(name + "."))
            if hit and len(p) > best:
                best, level = len(p), i
    return level


def test_the_graph_is_read() -> None:
    # A parser that found nothing would pass every test below.
    assert "infer.loader.config" in GRAPH["infer.models.base"]
    assert "infer.models" in GRAPH["infer.assembly.build"]
    assert sum(len(v) for v in GRAPH.values()) > 100, sum(len(v) for v in GRAPH.values())


def test_no_import_circle() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": []}) is None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_has_a_floor(module: str) -> None:
    assert floor(module) >= 0, f"{module} is on no floor of FLOORS (tests/unit/test_imports.py)"


def test_no_module_imports_a_higher_floor() -> None:
    upward = [
        f"{m} (floor {floor(m)}) -> {t} (floor {floor(t)})"
        for m, targets in GRAPH.items()
        for t in targets
        if floor(t) > floor(m)
    ]
    assert not upward, "imports of a higher floor:\n" + "\n".join(upward)


# Pairs of packages that import each other, each through modules of different floors (every
# arrow between modules points down): none since the load path was split into readers
# (`infer.loader`) below the models and assembly (`infer.assembly`) above them; a new pair
# must be argued for in docs/architecture.md, *Packages*, and listed here.
PACKAGE_PAIRS: set[tuple[str, ...]] = set()


def package_of(module: str) -> str:
    """``infer.engine.core`` -> ``infer.engine``; a top-level module is its own."""
    parts = module.split(".")
    top = ".".join(parts[:2])
    return top if top in MODULES and MODULES[top].name == "__init__.py" else module


def test_packages_import_each_other_only_where_documented() -> None:
    arrows = {(package_of(m), package_of(t)) for m, targets in GRAPH.items() for t in targets}
    arrows = {(a, b) for a, b in arrows if a != b and "infer" not in (a, b)}
    pairs = {tuple(sorted((a, b))) for a, b in arrows if (b, a) in arrows}
    print(sorted(pairs))
    assert pairs == PACKAGE_PAIRS, (
        f"new: {sorted(pairs - PACKAGE_PAIRS)}; gone: {sorted(PACKAGE_PAIRS - pairs)}"
    )


def test_the_config_reader_imports_nothing_of_infer() -> None:
    # Architectures register their rules with it (infer.models does on import).
    assert GRAPH["infer.loader.config"] == []


def test_activation_names_match_the_models() -> None:
    from infer.loader.config import ACTIVATION_NAMES
    from infer.models.common import ACTIVATIONS

    assert sorted(ACTIVATION_NAMES) == sorted(ACTIVATIONS)


def test_a_fresh_process_reads_configs_through_every_entry_point(
    tiny_ckpt_factory: Callable[..., Path],
) -> None:
    # The registry is filled by importing infer.models; the entry points that read a
    # config must import it themselves (a fresh `infer inspect` once could not).
    path = tiny_ckpt_factory("llama")
    code = (
        "import sys\n"
        "from infer.inspect import inspect_checkpoint\n"
        "print(inspect_checkpoint(sys.argv[1]).splitlines()[1])\n"
        "from infer.loading import open_checkpoint\n"
        "print(open_checkpoint(sys.argv[1]).config.model_type)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env, timeout=300
    )
    print(out.stdout, out.stderr[-2000:])
    assert out.returncode == 0
    assert out.stdout.split()[:2] == ["architecture", "llama:"]
    assert out.stdout.splitlines()[-1] == "llama"
