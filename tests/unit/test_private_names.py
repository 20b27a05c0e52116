"""No module of `infer` reads another module's underscore names.

A name that starts with one underscore is its module's own business: another module that reads
it (``llm._engine``, ``engine._submit(...)``, ``from infer.x import _helper``) depends on what
the owner may change at will. The rule, checked on the source of every module under
``src/infer``:

* ``from module import _name`` imports nothing private of another infer module;
* ``expr._name`` (an attribute read, write or call whose object is not ``self`` / ``cls``)
  names something this module defines itself: a function, class, assignment or attribute
  (``self._name = ...``) of its own. Names of other libraries' objects (``torch._int_mm``,
  a named tuple's ``_replace``) are outside the rule: they are listed in `FOREIGN`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "infer"

# Underscore names of other libraries that infer uses: torch's private kernels and compiler
# settings, the standard library's documented underscore names.
FOREIGN = frozenset(
    {
        "_int_mm",
        "_weight_int4pack_mm",
        "_weight_int4pack_mm_for_cpu",
        "_weight_int8pack_mm",
        "_linear_pointwise",  # oneDNN's linear (torch.ops.mkldnn), inductor's CPU linear
        "_convert_weight_to_int4pack",
        "_convert_weight_to_int4pack_for_cpu",
        "_dynamo",
        "_inductor",
        "_C",
        "_utils",
        "_export",
        "_subclasses",
        "_guards",
        "_functorch",
        "_prims_common",
        "_ops",
        "_higher_order_ops",
        "_logging",
        "_library",
        "_meta_registrations",
        "_decomp",
        "_replace",
        "_asdict",
        "_fields",
        "_make",
        "_getframe",
        "_exit",
        "_current_frames",
        "_debug_has_internal_overlap",
        "_base",
        "_version",
        "_cdata",
        "_values",
        "_indices",
        "_nnz",
        "_unsafe_view",
        "_safe_softmax",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_attention_math",
        "_fused_sdp_choice",
        "_pack_padded_sequence",
        "_has_compatible_shallow_copy_type",
        "_assert_async",
        "_foreach_copy_",
        "_lazy_init",
        "_get_default_group",
        "_rank_not_in_group",
        "_store",
        "_distributed_c10d",
        "_thread_id",
        "_cpu_info",
        "_check_vram",
        "_hf_hub_download",
        "_free_weak_ref",
        "_untyped_storage",
        "_pytree",
        "_aoti",
        "_modules",
        "_buffers",
        "_parameters",
        "_get_backend",
        "_timeout",
        "_is_amx_tile_supported",
        "_is_avx512_bf16_supported",
        # torch.nn.Module's forward hooks (per module and global): `infer.models.hooks` finds them
        "_forward_hooks",
        "_forward_pre_hooks",
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
    }
)


def _own_names(tree: ast.Module) -> set[str]:
    """Every underscore name this module defines: defs, classes, assignments, attributes set on
    anything, function parameters, imports' aliases."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("setattr", "object.__setattr__")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            names.add(str(node.args[1].value))
    return {n for n in names if n.startswith("_")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    own = _own_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("infer"):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{path.name}:{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and ast.unparse(base.func) == "super":
                continue
            if node.attr in own or node.attr in FOREIGN:
                continue
            found.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
    return found


MODULES = sorted(SRC.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(SRC)) for p in MODULES])
def test_no_module_reads_another_modules_private_names(path: Path) -> None:
    found = violations(path)
    assert not found, "reads of another module's underscore names:\n" + "\n".join(found)


def test_the_rule_sees_a_private_read(tmp_path: Path) -> None:
    """The check itself: a read of another object's underscore attribute and a private import are
    found; the module's own names and ``self._x`` are not."""
    source = tmp_path / "m.py"
    source.write_text(
        "from infer.api import _parse_json\n"
        "class A:\n    def __init__(self):\n        self._mine = 1\n"
        "    def f(self, llm, other):\n        return llm._engine, other._mine, self._x\n"
    )
    global SRC
    saved, SRC = SRC, tmp_path
    try:
        found = violations(source)
    finally:
        SRC = saved
    print(found)
    assert any("_parse_json" in f for f in found) and any("llm._engine" in f for f in found)
    assert not any("other._mine" in f or "self._x" in f for f in found)
