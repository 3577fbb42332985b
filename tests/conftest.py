"""Fixtures shared by every test area."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))  # `import support` and `helpers` from any test area


@pytest.fixture
def write_job(tmp_path):
    """Write a manifest (a dict) to tmp_path and return its path."""

    def write(doc: dict, name: str = "job.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    return write


from clusterlib import cluster  # noqa: E402,F401  (the session's test cluster, for every area)
