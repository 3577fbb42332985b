"""Fixtures shared by every test area."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "examples"


def job_doc(name: str = "t", mode: str = "Single", **spec) -> dict:
    return {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"mode": mode, **spec}}


@pytest.fixture
def write_job(tmp_path):
    """Write a manifest (a dict) to tmp_path and return its path."""

    def write(doc: dict, name: str = "job.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    return write


def kubetrain(*args: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """The real `kubetrain` command, as a user runs it."""
    env = {**os.environ, **kw.pop("env", {})}
    return subprocess.run(
        [sys.executable, "-m", "kubetrain_operator.cli", *args],
        capture_output=True, text=True, timeout=timeout, env=env, **kw,
    )
