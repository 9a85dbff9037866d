"""Run the notebooks top to bottom in a real kernel, in reading order, and save them with their
outputs: the committed copies, which the documentation shows as pages. From the project root,
with a fresh ``notebooks/runs`` (later notebooks read the runs earlier ones made):

    rm -rf notebooks/runs && python scripts/notebooks.py            # all six
    python scripts/notebooks.py 04_lora_fine_tune.ipynb             # one

Each notebook starts its own local Ray cluster (set RAY_ADDRESS to run them on another). The
progress bar is left out of the saved copies: it is a widget, which a page without Jupyter's
widget manager shows stuck at 0%; the lines and figures stay. Paths in the outputs are written
relative to the notebooks' folder (see :func:`portable`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[1] / "notebooks"
WIDGET = "application/vnd.jupyter.widget-view+json"


def without_widgets(nb) -> None:
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if WIDGET not in o.get("data", {})]
    nb.metadata.pop("widgets", None)


def portable(nb) -> None:
    """Outputs without this machine's paths (tests/unit/test_docs.py fails on any): paths
    under the notebooks' folder, where they run, are left relative to it, and the home
    directory is written ``~``, as a reader's own run would show them from their checkout."""
    def clean(text: str) -> str:
        return text.replace(f"{FOLDER}/", "").replace(f"{Path.home()}/", "~/")

    def walk(value):
        if isinstance(value, str):
            return clean(value)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value

    import nbformat

    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [nbformat.from_dict(o) for o in walk(cell.outputs)]


def main(names: list[str]) -> int:
    import nbformat
    from nbclient import NotebookClient

    for path in [FOLDER / n for n in names] or sorted(FOLDER.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        started = time.time()
        NotebookClient(nb, timeout=3600, kernel_name="python3",
                       resources={"metadata": {"path": str(FOLDER)}}).execute()
        without_widgets(nb)
        portable(nb)
        nbformat.write(nb, path)
        print(f"{path.name}: {time.time() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
