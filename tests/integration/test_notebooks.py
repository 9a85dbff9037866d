"""Notebooks run top to bottom in a real Jupyter kernel, as a user would run them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    work = tmp_path / path.stem
    work.mkdir()
    shutil.copy(path, work / path.name)
    nb = nbformat.read(work / path.name, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(work)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    # Each notebook leaves its results under runs/ beside it.
    assert any((work / "runs").rglob("manifest.json"))
