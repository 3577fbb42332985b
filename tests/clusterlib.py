"""The `cluster` fixture: one test cluster per session, brought up and taken down by hack/cluster.

The tools (kube-apiserver, kubectl, helm, ...) must be built before the
session starts (`hack/cluster build`, about 20 minutes cold): a cold build
inside a fixture would run into pytest's per-test timeout, so the fixture
fails at once, saying what to run, instead of building.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HACK_CLUSTER = ROOT / "hack" / "cluster"
FAKE_NODES = 4


@dataclass(frozen=True)
class Cluster:
    """A running test cluster, and how to talk to it with the built clients."""

    name: str
    kubeconfig: Path
    bin_dir: Path
    env: dict[str, str]
    """os.environ plus KUBECONFIG and the tools' bin directory first on PATH."""
    nodes: int

    @property
    def directory(self) -> Path:
        """kwokctl's directory for this cluster: its config, pki and logs."""
        return self.kubeconfig.parent

    def run(self, *args: str, input: str | None = None, timeout: float = 120) -> str:
        """Runs a command with the cluster's environment; returns stdout, raises with stderr on failure."""
        done = subprocess.run(args, input=input, env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def hack_cluster(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Runs hack/cluster for this cluster; returns the finished process, whatever its exit status."""
        return hack_cluster(*args, env=self.env, timeout=timeout)

    def kubectl(self, *args: str, timeout: float = 120) -> str:
        return self.run("kubectl", *args, timeout=timeout)

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json"))


def hack_cluster(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(HACK_CLUSTER), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _environment(exports: str) -> dict[str, str]:
    """Applies the `export NAME=value` lines of `hack/cluster env` to a copy of os.environ."""
    env = dict(os.environ)
    for name, value in re.findall(r"^export (\w+)=(.*)$", exports, re.MULTILINE):
        env[name] = value.replace("$PATH", os.environ.get("PATH", ""))
    return env


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    external = os.environ.get("KUBETRAIN_TEST_KUBECONFIG")
    if external:
        # A cluster someone else started (hack/kind-e2e): used as it is, never taken down.
        # kubectl and helm come from PATH.
        import shutil

        kubectl = shutil.which("kubectl")
        if kubectl is None:
            pytest.fail("KUBETRAIN_TEST_KUBECONFIG is set but kubectl is not on PATH", pytrace=False)
        env = {**os.environ, "KUBECONFIG": external}
        yield Cluster(name="external", kubeconfig=Path(external), bin_dir=Path(kubectl).parent, env=env, nodes=0)
        return
    built = hack_cluster("build", "--check")
    if built.returncode != 0:
        pytest.fail(
            f"the test cluster's tools are not built: run `hack/cluster build` first "
            f"(Go 1.26+, about 20 minutes cold). {built.stderr.strip()}",
            pytrace=False,
        )
    up = hack_cluster("up", "--nodes", str(FAKE_NODES))
    if up.returncode != 0:
        pytest.fail(f"hack/cluster up failed ({up.returncode}):\n{up.stderr}", pytrace=False)
    try:
        exports = hack_cluster("env")
        assert exports.returncode == 0, exports.stderr
        env = _environment(exports.stdout)
        yield Cluster(
            name=os.environ.get("KUBETRAIN_CLUSTER", "kubetrain-test"),
            kubeconfig=Path(env["KUBECONFIG"]),
            bin_dir=Path(env["PATH"].split(os.pathsep)[0]),
            env=env,
            nodes=FAKE_NODES,
        )
    finally:
        down = hack_cluster("down")
        assert down.returncode == 0, f"hack/cluster down failed: {down.stderr}"
