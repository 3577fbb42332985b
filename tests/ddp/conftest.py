"""Fixtures of the DDP tests: the uninterrupted reference run, shared by every file."""

import sys
from pathlib import Path

import pytest

# The group launcher (ddp_group.py) is a helper module of these tests, not a test.
sys.path.insert(0, str(Path(__file__).parent))

from ddp_group import Group, assert_ok, run_group, write_job  # noqa: E402


@pytest.fixture(scope="session")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Group:
    """The uninterrupted reference: 2 nodes x 1 rank, gloo, no hook."""
    directory = tmp_path_factory.mktemp("baseline")
    group = run_group(write_job(directory), directory / "run")
    assert_ok(group)
    return group
