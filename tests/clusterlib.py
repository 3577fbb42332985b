"""The `cluster` fixture: one test cluster per session, brought up and taken down by hack/cluster.

The tools (kube-apiserver, kubectl, helm, ...) must be built before the
session starts (`hack/cluster build`, about 30 minutes cold): a cold build
inside a fixture would run into pytest's per-test timeout, so the fixture
fails at once, saying what to run, instead of building. The Cluster handle
and hack/cluster's wrappers are helpers.kube's (the e2e fixture uses them too).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.kube import Cluster, connect, hack_cluster, require_tools

FAKE_NODES = 4


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    external = os.environ.get("KUBETRAIN_TEST_KUBECONFIG")
    if external:
        # A cluster someone else started (hack/kind-e2e): used as it is, never taken down.
        # kubectl and helm come from PATH.
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            pytest.fail("KUBETRAIN_TEST_KUBECONFIG is set but kubectl is not on PATH", pytrace=False)
        env = {**os.environ, "KUBECONFIG": external}
        yield Cluster(name="external", kubeconfig=Path(external), bin_dir=Path(kubectl).parent, env=env, nodes=0)
        return
    require_tools()
    up = hack_cluster("up", "--nodes", str(FAKE_NODES))
    if up.returncode != 0:
        if "already up" in up.stderr:
            # Another session's cluster of this name: never take it down from here.
            pytest.fail(f"hack/cluster up failed ({up.returncode}):\n{up.stderr}", pytrace=False)
        # A half-built cluster would make every later `up` of this name fail with "already up".
        down = hack_cluster("down")
        pytest.fail(f"hack/cluster up failed ({up.returncode}):\n{up.stderr}"
                    + ("" if down.returncode == 0 else f"\nhack/cluster down failed too: {down.stderr}"), pytrace=False)
    try:
        yield connect(os.environ.get("KUBETRAIN_CLUSTER", "kubetrain-test"), FAKE_NODES)
    finally:
        down = hack_cluster("down")
        assert down.returncode == 0, f"hack/cluster down failed: {down.stderr}"
