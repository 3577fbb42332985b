"""The import-linter contracts of pyproject.toml ([tool.importlinter]) hold: `lint-imports` passes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def test_lint_imports_keeps_every_contract(tmp_path):
    if importlib.util.find_spec("importlinter") is None:
        pytest.fail("import-linter is not installed: run hack/setup (requirements/dev.lock pins it)", pytrace=False)
    # From a folder of its own: lint-imports puts its working directory first on sys.path, and in the
    # repository root the folder operator/ would shadow the standard library's operator. --no-cache:
    # its cache would be written there too.
    done = subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, f"lint-imports exited {done.returncode}:\n{done.stdout}{done.stderr}"
    assert "0 broken" in done.stdout, done.stdout
