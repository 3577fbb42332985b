"""examples/notebooks/quickstart.ipynb runs end to end against the local backend, with a real Jupyter kernel
(the cluster's run: tests/e2e/test_e2e_client.py)."""

from __future__ import annotations

import pytest
import torch

from nbrun import outputs, run_notebook


@pytest.mark.slow
def test_the_quickstart_notebook_runs_on_this_machine(tmp_path):
    nb = run_notebook(tmp_path, {})
    text = outputs(nb)
    assert "spec.training.batchSize" in text  # the invalid manifest, refused with its field
    assert "state: Succeeded" in text and "ETA" in text  # the progress bar's last line
    assert "eval accuracy" in text and "Completed" in text  # logs and events
    assert (tmp_path / "report" / "report.md").is_file() and (tmp_path / "report" / "loss.png").is_file()
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert weights and all(isinstance(t, torch.Tensor) for t in weights.values())
    assert not (tmp_path / "runs" / "nb-fast").exists()  # deleted at the end
