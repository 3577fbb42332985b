"""The operator under test: `kubetrain operator` as a real process against the test cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from support import free_port, wait_for

ROOT = Path(__file__).parents[2]
CRD = ROOT / "deploy" / "crd" / "trainingjobs.yaml"


class Operator:
    def __init__(self, cluster, namespace: str, log: Path, metrics_port: int):
        self.cluster = cluster
        self.namespace = namespace
        self.log = log
        self.metrics_port = metrics_port

    def kubectl(self, *args: str, timeout: float = 60) -> str:
        return self.cluster.kubectl("-n", self.namespace, *args, timeout=timeout)

    def apply(self, doc: dict) -> None:
        done = subprocess.run(
            ["kubectl", "-n", self.namespace, "apply", "--server-side", "-f", "-"],
            input=yaml.safe_dump(doc), env=self.cluster.env, capture_output=True, text=True, timeout=60,
        )
        assert done.returncode == 0, done.stderr

    def get(self, kind: str, name: str) -> dict | None:
        done = subprocess.run(
            ["kubectl", "-n", self.namespace, "get", kind, name, "-o", "json"],
            env=self.cluster.env, capture_output=True, text=True, timeout=60,
        )
        if done.returncode != 0:
            if "NotFound" in done.stderr:
                return None
            raise AssertionError(done.stderr)
        return json.loads(done.stdout)

    def items(self, kind: str, selector: str) -> list[dict]:
        return json.loads(self.kubectl("get", kind, "-l", selector, "-o", "json"))["items"]

    def wait(self, what: str, check, timeout: float = 60, every: float = 0.5):
        """Poll check() until it returns a truthy value; fail naming `what` and the operator's log tail."""
        return wait_for(what, check, timeout, every,
                        explain=lambda: "operator log:\n" + "\n".join(self.log.read_text().splitlines()[-30:]))

    def job_status(self, name: str) -> dict:
        job = self.get("trainingjob", name)
        return (job or {}).get("status") or {}

    def set_pod_status(self, pod: str, phase: str, exit_code: int | None = None, reason: str | None = None,
                       pod_ip: str | None = None) -> None:
        """What a kubelet would report, written through the status subresource (kwok leaves it)."""
        status: dict = {"phase": phase}
        if reason:
            status["reason"] = reason
        if pod_ip:
            status["podIP"] = pod_ip
            status["podIPs"] = [{"ip": pod_ip}]
        if exit_code is not None:
            status["containerStatuses"] = [{
                "name": "trainer", "image": "kubetrain/trainer:test", "imageID": "", "ready": False,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error"}},
            }]
        self.kubectl("patch", "pod", pod, "--subresource=status", "--type=merge", "-p", json.dumps({"status": status}))

    def events(self, name: str) -> list[dict]:
        return json.loads(self.kubectl("get", "events", "--field-selector", f"involvedObject.name={name}", "-o", "json"))["items"]


@pytest.fixture(scope="session")
def crd(cluster):
    cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/trainingjobs.kubetrain.dev", "--timeout=60s")
    return CRD


@pytest.fixture(scope="session")
def volumes(cluster):
    """Static PersistentVolumes for the jobs' checkpoint claims: kwok's nodes have no storage
    provisioner, and a pod whose claim never binds is never scheduled. (The real-node tests
    get rancher's local-path-provisioner instead.) Nothing is ever mounted on a fake node."""
    pvs = [
        {"apiVersion": "v1", "kind": "PersistentVolume",
         "metadata": {"name": f"kt-test-pv-{i}", "labels": {"kubetrain.dev/test": "static"}},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce", "ReadWriteMany"],
                  "persistentVolumeReclaimPolicy": "Delete", "hostPath": {"path": f"/tmp/kt-test-pv-{i}"}}}
        for i in range(60)
    ]
    done = subprocess.run(["kubectl", "apply", "-f", "-"], input=yaml.safe_dump_all(pvs), env=cluster.env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return len(pvs)


@pytest.fixture(scope="session")
def operator(cluster, crd, volumes, tmp_path_factory):
    """One operator process for the session, watching its own namespace."""
    namespace = f"op-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    metrics_port = free_port()
    cmd = [sys.executable, "-m", "kubetrain_operator.cli", "operator", "--namespace", namespace,
           "--metrics-port", str(metrics_port), "--liveness-port", str(free_port()),
           "--scrape-networks", "127.0.0.0/8"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=cluster.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    op = Operator(cluster, namespace, log, metrics_port)
    try:
        op.wait("the operator to start", lambda: proc.poll() is not None or "Starting the main" in log.read_text() or "startup" in log.read_text().lower(), timeout=60)
        assert proc.poll() is None, log.read_text()
        yield op
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")
