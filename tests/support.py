"""The repository's paths, a TrainingJob manifest and the `kubetrain` command, for every test area
(imported as `support`; tests/ is on sys.path via tests/conftest.py). The other shared helpers are the
helpers package's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "examples"


def job_doc(name: str = "t", mode: str = "Single", **spec) -> dict:
    return {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"mode": mode, **spec}}


def kubetrain(*args: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """The real `kubetrain` command, as a user runs it."""
    env = {**os.environ, **kw.pop("env", {})}
    return subprocess.run(
        [sys.executable, "-m", "kubetrain.cli", *args],
        capture_output=True, text=True, timeout=timeout, env=env, **kw,
    )
