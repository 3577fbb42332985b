"""Helpers shared by the test areas (imported as `support`; tests/ is on sys.path via tests/conftest.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
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


def wait_for(what: str, check: Callable, timeout: float, every: float = 0.5, explain: Callable[[], str] | None = None):
    """Poll check() until it returns something truthy and return that; on timeout fail naming `what`,
    the last value, and what explain() says (a log tail, the cluster's state)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    detail = f"\n{explain()}" if explain is not None else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}{detail}")
