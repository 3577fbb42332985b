import sys
from pathlib import Path

import pytest

# The job launcher (cluster.py) is a helper module of these tests, not a test.
sys.path.insert(0, str(Path(__file__).parent))

from cluster import run_job  # noqa: E402  (found through the path above)


@pytest.fixture(scope="session")
def sync_job(tmp_path_factory):
    """The reference job: 1 shard, 2 workers, Sync, 10 epochs of digits at batch 16 (cluster.manifest)."""
    return run_job(tmp_path_factory.mktemp("sync"), "sync")


@pytest.fixture(scope="session")
def async_job(tmp_path_factory):
    """The same job in Async, maxStaleness 4."""
    return run_job(tmp_path_factory.mktemp("async"), "async", aggregation="Async", maxStaleness=4)
