"""Kubernetes for the tests: the test cluster that `hack/cluster` starts and stops, the Cluster handle
the fixtures yield, and kubectl over a cluster's environment (KUBECONFIG, the built tools first on PATH),
in one namespace or none, failing with the command and its stderr.

Two fixtures bring a cluster up: `cluster` (tests/clusterlib.py, fake nodes
only) and `e2e` (tests/e2e/conftest.py, with a real node). Both go through here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import apiread
from helpers.process import run

ROOT = Path(__file__).resolve().parents[2]
HACK_CLUSTER = ROOT / "hack" / "cluster"


@dataclass(frozen=True)
class Kubectl:
    """kubectl against one cluster; `namespace` goes first on every command line when set."""

    env: Mapping[str, str]
    namespace: str | None = None
    timeout: float = 120
    """Seconds for one command unless a call says otherwise."""

    def run(self, *args: str, input: str | None = None, timeout: float | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        """The finished kubectl; with `check` (the default) a non-zero exit fails with its stderr."""
        namespace = ("-n", self.namespace) if self.namespace else ()
        return run("kubectl", *namespace, *args, env=self.env, input=input,
                   timeout=self.timeout if timeout is None else timeout, check=check)

    def __call__(self, *args: str, input: str | None = None, timeout: float | None = None) -> str:
        """kubectl's stdout; a non-zero exit fails with its stderr."""
        return self.run(*args, input=input, timeout=timeout).stdout

    def json(self, *args: str, timeout: float | None = None) -> Any:
        """`kubectl <args> -o json`, parsed. A plain read goes to the API server from this process
        (helpers/apiread.py: the polls' kubectl processes were a tenth of a CI run's CPU)."""
        try:
            found = self._read(args, timeout)
        except apiread.Unsupported:
            return json.loads(self(*args, "-o", "json", timeout=timeout))
        if found is apiread.NOT_FOUND:
            raise AssertionError(f"kubectl {' '.join(args)}: NotFound")
        return found

    def _read(self, args: tuple[str, ...], timeout: float | None) -> Any:
        kind, name, query = apiread.read_args(args)
        try:
            return apiread.reader(self.env).get(kind, name, self.namespace, query,
                                                self.timeout if timeout is None else timeout)
        except OSError as err:  # as kubectl would fail: the API server not answering
            raise AssertionError(f"kubectl {' '.join(args)}: {err}") from None

    def apply(self, *docs: dict, server_side: bool = False, dry_run: bool = False, check: bool = True,
              timeout: float | None = None) -> subprocess.CompletedProcess:
        """`kubectl apply -f -` of the manifests (dicts); dry_run asks the API server (`--dry-run=server`)."""
        args = ["apply", *(["--server-side"] if server_side else []), "-f", "-",
                *(["--dry-run=server"] if dry_run else [])]
        return self.run(*args, input=yaml.safe_dump_all(docs, sort_keys=False), timeout=timeout, check=check)

    def get(self, kind: str, name: str) -> dict | None:
        """The object, or None when the API server says it is not found."""
        try:
            return self._read(("get", kind, name), None)
        except apiread.Unsupported:
            pass
        done = self.run("get", kind, name, "-o", "json", check=False)
        if done.returncode != 0:
            if "NotFound" in done.stderr:
                return None
            raise AssertionError(done.stderr)
        return json.loads(done.stdout)

    def items(self, kind: str, *selectors: str) -> list[dict]:
        """The objects of a kind, selected by kubectl's own flags (`-l app=x`, `--field-selector ...`)."""
        return self.json("get", kind, *selectors)["items"]

    def events(self, name: str) -> list[dict]:
        """The Events about the object called `name`."""
        return self.items("events", "--field-selector", f"involvedObject.name={name}")


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

    def kube(self, namespace: str | None = None, timeout: float = 120) -> Kubectl:
        """kubectl against this cluster, in `namespace` when given."""
        return Kubectl(self.env, namespace, timeout)

    def run(self, *args: str, input: str | None = None, timeout: float = 120) -> str:
        """Runs a command with the cluster's environment; returns stdout, raises with stderr on failure."""
        return run(*args, env=self.env, input=input, timeout=timeout).stdout

    def hack_cluster(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Runs hack/cluster for this cluster; returns the finished process, whatever its exit status."""
        return hack_cluster(*args, env=self.env, timeout=timeout)

    def kubectl(self, *args: str, timeout: float = 120) -> str:
        return self.kube()(*args, timeout=timeout)

    def kubectl_json(self, *args: str) -> dict:
        return self.kube().json(*args)


def hack_cluster(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """hack/cluster with `args`; the finished process, whatever its exit status."""
    return run(str(HACK_CLUSTER), *args, env=env, timeout=timeout, check=False)


def environment(exports: str) -> dict[str, str]:
    """Applies the `export NAME=value` lines of `hack/cluster env` to a copy of os.environ."""
    env = dict(os.environ)
    for name, value in re.findall(r"^export (\w+)=(.*)$", exports, re.MULTILINE):
        env[name] = value.replace("$PATH", os.environ.get("PATH", ""))
    return env


def require_tools(env: dict[str, str] | None = None) -> None:
    """Fails the session at once, saying what to run, when the cluster's tools are not built: a cold
    build (about 20 minutes) inside a fixture would run into pytest's per-test timeout."""
    built = hack_cluster("build", "--check", env=env, timeout=60)
    if built.returncode != 0:
        pytest.fail(
            f"the test cluster's tools are not built: run `hack/cluster build` first "
            f"(Go 1.26+, about 30 minutes cold). {built.stderr.strip()}",
            pytrace=False,
        )


def connect(name: str, nodes: int, env: dict[str, str] | None = None) -> Cluster:
    """The handle of the cluster that `hack/cluster up` started with `env` (KUBETRAIN_CLUSTER names it)."""
    exports = hack_cluster("env", env=env, timeout=60)
    assert exports.returncode == 0, exports.stderr
    cluster_env = environment(exports.stdout)
    if env is not None and "KUBETRAIN_CLUSTER" in env:
        cluster_env["KUBETRAIN_CLUSTER"] = env["KUBETRAIN_CLUSTER"]
    return Cluster(name=name, kubeconfig=Path(cluster_env["KUBECONFIG"]),
                   bin_dir=Path(cluster_env["PATH"].split(os.pathsep)[0]), env=cluster_env, nodes=nodes)


def install_crd(cluster: Cluster) -> Path:
    """The TrainingJob CRD applied and Established; its file."""
    crd = ROOT / "deploy" / "crd" / "trainingjobs.yaml"
    cluster.kubectl("apply", "--server-side", "-f", str(crd))
    wait_established(cluster, "trainingjobs.kubetrain.dev")
    return crd


ESTABLISH_TIMEOUT_SECONDS = 120  # an API server that has just started establishes its first CRDs after a while


def wait_established(cluster: Cluster, *crds: str, timeout: float = ESTABLISH_TIMEOUT_SECONDS) -> None:
    """Poll until every CRD named is Established. Neither `kubectl wait --for=condition=Established` nor a
    jsonpath filter on the conditions: a CRD the API server has not processed yet has no
    status.conditions, and both fail at once on it ("accessor error: <nil>", seen in CI) instead of
    waiting. The object as JSON is read instead."""
    from helpers.wait import wait_for

    def established() -> bool:
        for crd in crds:
            conditions = (json.loads(cluster.kubectl("get", "crd", crd, "-o", "json")).get("status") or {}).get(
                "conditions") or []
            if not any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions):
                return False
        return True

    wait_for(f"CRDs {', '.join(crds)} to be Established", established, timeout=timeout)
