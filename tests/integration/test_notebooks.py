"""The notebooks, run top to bottom in a real Jupyter kernel as a user runs them: in reading
order, in one folder (later ones read the runs earlier ones made), joined to the test's Ray
cluster through ``RAY_ADDRESS`` as a user joins theirs. Each must run without an error and
draw the figures its committed copy shows.

Fewer steps than a reader runs: a cell tagged ``parameters`` holds a notebook's sizes (steps,
grid points), and a cell injected after it sets these (papermill's convention), so the code
that runs is the code a reader runs."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

FOLDER = Path(__file__).parents[2] / "notebooks"
NOTEBOOKS = sorted(FOLDER.glob("*.ipynb"))
QUICK = {
    "02_train_and_resume.ipynb": "steps = 20\nmore_steps = 30",
    "03_sweep.ipynb": "steps = 9\nlr_points = 1",
    "04_lora_fine_tune.ipynb": "base_steps = 5\nlora_steps = 5\nheldout = 5\npretrain = 2000",
    "06_reinforcement_learning.ipynb": "steps = 30",
}


def with_parameters(nb, source: str):
    import nbformat

    (at,) = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    injected = nbformat.v4.new_code_cell(source)
    injected.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(at + 1, injected)
    return nb


def outputs(nb, kind: str) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == kind or kind in o.get("data", {})]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("notebooks")
    shutil.copy(FOLDER / "tiny.yaml", work / "tiny.yaml")
    return work


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_draws_its_figures(path, folder, monkeypatch):
    import nbformat
    import ray
    from nbclient import NotebookClient

    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    committed = nbformat.read(path, as_version=4)
    nb = nbformat.read(path, as_version=4)
    if path.name in QUICK:
        nb = with_parameters(nb, QUICK[path.name])
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(folder)}}).execute()
    errors = outputs(nb, "error")
    assert not errors, "\n".join(f"{e['ename']}: {e['evalue']}" for e in errors)
    # The committed copy shows what a reader sees without running it: outputs of a complete
    # run, with every figure this run drew.
    assert all(c.get("execution_count") for c in committed.cells if c.cell_type == "code")
    drawn = len(outputs(nb, "image/png"))
    assert drawn == len(outputs(committed, "image/png"))
    assert drawn >= 1 or path.name.startswith("01_")
    # A worker's own lines reach the reader once each (Ray Train 2.60 prints them twice
    # unless told not to), and without Ray's process prefix: the resumed run of notebook 2
    # has one.
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        said = [line for o in cell.get("outputs", []) if o.get("output_type") == "stream"
                for line in o["text"].splitlines() if line.startswith("raylm:")]
        assert len(said) == len(set(said)), said
    if path.name.startswith("04_"):
        # The committed copy is a full run: its fine-tune answers the held-out questions by
        # generation and as multiple choice alike (the default template trains an answer's
        # first word with its space, as lm-eval writes a choice).
        (cell,) = [c for c in committed.cells if c.source.startswith("scores = {")]
        (result,) = [o for o in cell.outputs if o["output_type"] == "execute_result"]
        scores = ast.literal_eval(result["data"]["text/plain"])
        assert len(scores) == 2 and min(scores.values()) >= 0.9, scores
    if path.name.startswith("06_"):
        # The committed copy is a full run: GRPO took the held-out answers from about half
        # right to at least 0.8.
        (result,) = [o for o in outputs(committed, "execute_result")
                     if "'held-out'" in o["data"]["text/plain"]]
        figures = ast.literal_eval(result["data"]["text/plain"])
        assert figures["reward, first 10 steps"] < 0.6 and figures["held-out"] >= 0.8, figures
    if path.name.startswith("02_"):
        assert "raylm: 1 worker resuming from step 20" in [
            line for o in outputs(nb, "stream") for line in o["text"].splitlines()]
