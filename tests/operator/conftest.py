"""The operator under test: `kubetrain operator` as a real process against the test cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from helpers.kube import install_crd
from helpers.net import free_ports
from helpers.process import stop_process
from helpers.wait import wait_for


class Operator:
    def __init__(self, cluster, namespace: str, log: Path, metrics_port: int):
        self.cluster = cluster
        self.namespace = namespace
        self.log = log
        self.metrics_port = metrics_port
        self.kube = cluster.kube(namespace, timeout=60)
        """kubectl in the operator's namespace, for what the methods below do not cover."""

    def kubectl(self, *args: str, timeout: float = 60) -> str:
        return self.kube(*args, timeout=timeout)

    def apply(self, doc: dict) -> None:
        self.kube.apply(doc, server_side=True)

    def get(self, kind: str, name: str) -> dict | None:
        return self.kube.get(kind, name)

    def items(self, kind: str, selector: str) -> list[dict]:
        return self.kube.items(kind, "-l", selector)

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
        return self.kube.events(name)


@pytest.fixture(scope="session")
def crd(cluster):
    return install_crd(cluster)


STATIC_VOLUMES = 200
"""Jobs that tests leave running keep their claims to the end of the session (the session operator's
namespace holds dozens by test_standby.py): 60 were not enough even with recycling."""
RECYCLE_EVERY_SECONDS = 2.0


@pytest.fixture(scope="session")
def volumes(cluster):
    """Static PersistentVolumes for the jobs' checkpoint claims: kwok's nodes have no storage
    provisioner, and a pod whose claim never binds is never scheduled. (The real-node tests
    get rancher's local-path-provisioner instead.) Nothing is ever mounted on a fake node.

    The session's tests make far more claims than STATIC_VOLUMES over its life: a volume whose
    claim went with its job is Released (Retain) and made Available again by a thread of this
    fixture (its claimRef removed), as a provisioner would make a new one. Without it the session
    ran out of volumes part-way through, and the later tests' pods waited for ever for a claim (seen
    as a node-loss test and a standby test timing out only in the whole suite)."""
    pvs = [
        {"apiVersion": "v1", "kind": "PersistentVolume",
         "metadata": {"name": f"kt-test-pv-{i}", "labels": {"kubetrain.dev/test": "static"}},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce", "ReadWriteMany"],
                  "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": f"/tmp/kt-test-pv-{i}"}}}
        for i in range(STATIC_VOLUMES)
    ]
    kube = cluster.kube()
    kube.apply(*pvs)
    stop = threading.Event()

    def recycle() -> None:
        while not stop.wait(RECYCLE_EVERY_SECONDS):
            try:
                released = [pv["metadata"]["name"] for pv in kube.items("pv", "-l", "kubetrain.dev/test=static")
                            if pv.get("status", {}).get("phase") == "Released"]
                for name in released:
                    kube.run("patch", "pv", name, "--type=json", "-p", '[{"op":"remove","path":"/spec/claimRef"}]',
                             check=False)
            except (AssertionError, OSError, subprocess.SubprocessError) as err:  # the cluster going down
                print(f"volumes: recycling skipped a round: {err}", file=sys.stderr)

    thread = threading.Thread(target=recycle, name="recycle-volumes", daemon=True)
    thread.start()
    try:
        yield len(pvs)
    finally:
        stop.set()
        thread.join(timeout=30)


@pytest.fixture(scope="session")
def operator(cluster, crd, volumes, tmp_path_factory):
    """One operator process for the session, watching its own namespace."""
    namespace = f"op-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    metrics_port, liveness_port = free_ports(2)
    cmd = [sys.executable, "-m", "kubetrain.cli", "operator", "--namespace", namespace,
           "--metrics-port", str(metrics_port), "--liveness-port", str(liveness_port),
           "--scrape-networks", "127.0.0.0/8"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=cluster.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    op = Operator(cluster, namespace, log, metrics_port)
    try:
        op.wait("the operator to start", lambda: proc.poll() is not None or "Starting the main" in log.read_text() or "startup" in log.read_text().lower(), timeout=60)
        assert proc.poll() is None, log.read_text()
        yield op
    finally:
        stop_process(proc, timeout=20, group=True)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")


class OperatorProcess:
    """One `kubetrain operator` process started by `spawn_operator`."""

    def __init__(self, proc: subprocess.Popen, log: Path, metrics_port: int, liveness_port: int):
        self.proc = proc
        self.log = log
        self.metrics_port = metrics_port
        self.liveness_port = liveness_port

    def signal(self, sig: int) -> None:
        """`sig` to its process group (it was started in a session of its own)."""
        os.killpg(self.proc.pid, sig)

    def handle(self, cluster, namespace: str) -> Operator:
        """The Operator handle (apply, wait, pods' status, ...) for this process and its namespace."""
        return Operator(cluster, namespace, self.log, self.metrics_port)


@pytest.fixture
def spawn_operator(cluster, crd, volumes, tmp_path):
    """Starts extra `kubetrain operator` processes watching `namespace`, with extra arguments and
    environment (`spawn(namespace, *args, env={...})`); stops whatever is left of them afterwards."""
    started: list[OperatorProcess] = []

    def spawn(namespace: str, *args: str, env: dict[str, str] | None = None) -> OperatorProcess:
        log = tmp_path / f"operator-{len(started)}.log"
        metrics_port, liveness_port = free_ports(2)
        cmd = [sys.executable, "-m", "kubetrain.cli", "operator", "--namespace", namespace,
               "--metrics-port", str(metrics_port), "--liveness-port", str(liveness_port),
               "--scrape-networks", "127.0.0.0/8", *args]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env={**cluster.env, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        started.append(OperatorProcess(proc, log, metrics_port, liveness_port))
        return started[-1]

    yield spawn
    for p in started:
        if p.proc.poll() is None:
            stop_process(p.proc, timeout=20, group=True)
