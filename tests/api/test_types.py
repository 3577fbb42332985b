"""The type checker passes (mypy, configured by mypy.ini): the whole package with mypy's defaults, the API model,
the engine and kubetrain.shared strictly."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
# Its cache outside the clone (a warm run checks only what changed: seconds instead of a minute and a half).
CACHE = Path(os.environ.get("KUBETRAIN_CACHE", Path.home() / ".cache" / "kubetrain")) / "mypy"


def mypy(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed: run hack/setup (requirements/test.lock pins it)", pytrace=False)
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(CACHE), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_mypy_passes_on_the_package():
    done = mypy("--config-file", str(ROOT / "mypy.ini"))
    assert done.returncode == 0, f"mypy exited {done.returncode}:\n{done.stdout}{done.stderr}"
    assert "Success" in done.stdout, done.stdout


def test_the_core_is_checked_strictly(tmp_path):
    """The strict section holds: a function of the engine without annotations fails the check."""
    pkg = tmp_path / "kubetrain" / "engine"
    pkg.mkdir(parents=True)
    (tmp_path / "kubetrain" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "loose.py").write_text("def f(x):\n    return x\n")
    config = (ROOT / "mypy.ini").read_text().replace("files = kubetrain\n", "files = kubetrain/engine\n")
    (tmp_path / "mypy.ini").write_text(config)
    done = mypy("--config-file", str(tmp_path / "mypy.ini"), "--no-incremental", cwd=tmp_path)
    assert done.returncode == 1 and "loose.py:1: error: Function is missing a type annotation" in done.stdout, \
        done.stdout + done.stderr
