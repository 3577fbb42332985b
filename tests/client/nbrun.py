"""Running examples/notebooks/quickstart.ipynb with a real kernel (nbclient + ipykernel), for the local and the
cluster tests."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from support import EXAMPLES

NOTEBOOK = EXAMPLES / "notebooks" / "quickstart.ipynb"
CELL_SECONDS = 900  # a cell waits for two jobs at most; a cluster's first pods take their time


def run_notebook(workdir: Path, env: dict[str, str]) -> nbformat.NotebookNode:
    """The notebook executed in `workdir` (its runs, report and model.pt land there) with `env` added to the
    kernel's environment; a failing cell raises nbclient's CellExecutionError with its traceback."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    kernel_env = {**os.environ, "KUBETRAIN_EXAMPLES": str(EXAMPLES), "PYTHONSAFEPATH": "1", **env}
    NotebookClient(nb, timeout=CELL_SECONDS, kernel_name="python3",
                   resources={"metadata": {"path": str(workdir)}}).execute(env=kernel_env)
    return nb


def outputs(nb: nbformat.NotebookNode) -> str:
    """Every text the cells printed or returned (stdout, stderr, results), in order."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out["text"])
            elif "data" in out:
                parts.append(out["data"].get("text/plain", ""))
    return "\n".join(parts)
