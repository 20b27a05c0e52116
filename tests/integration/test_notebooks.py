"""docs/notebooks/*.ipynb run top to bottom in a real Jupyter kernel (nbclient + ipykernel) on the
shipped SmolLM2, failing on any cell's error; and the committed copies keep their rendered outputs
(plots included), so a reader sees what each shows. The run's time is printed, not asserted (a
busy machine runs it several times slower; docs/notebooks.md has the quiet figure): a cell still
running after `CELL_LIMIT_S` is a hang."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "docs" / "notebooks").glob("*.ipynb"))
CELL_LIMIT_S = 900.0


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "docs/notebooks holds no notebook"


@pytest.mark.slow
@pytest.mark.realmodel
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_notebook_runs_in_a_kernel(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)  # type: ignore[no-untyped-call]
    monkeypatch.setenv("INFER_AOT", "off")  # the kernel inherits it: no package builds for this run
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))
    client = nbclient.NotebookClient(
        nb, timeout=CELL_LIMIT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError naming the cell and its traceback
    took = time.perf_counter() - t0
    print(f"\n{path.name}: {len(nb.cells)} cells executed in {took:.1f} s")
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_committed_notebook_keeps_its_outputs(path: Path) -> None:
    import nbformat

    nb = nbformat.read(path, as_version=4)  # type: ignore[no-untyped-call]
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("outputs") for c in code), "a code cell without outputs: run and save it"
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "no rendered plot in the committed notebook"
    assert not [o for c in code for o in c.outputs if o.get("output_type") == "error"]
