"""Helpers shared by the test areas (imported as `support`; tests/ is on sys.path via tests/conftest.py)."""

from __future__ import annotations

import os
import socket
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
        [sys.executable, "-m", "kubetrain_operator.cli", *args],
        capture_output=True, text=True, timeout=timeout, env=env, **kw,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
