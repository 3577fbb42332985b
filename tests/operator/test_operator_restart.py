"""The operator restarts at the worst moments and the job ends as it would have without the restart.

What the engine remembers between rounds is declared in the status (`status.memory`), so the
API server keeps it: an operator killed during a restart backoff, while a DDP rank's pod is
replaced, or during a hang countdown, is replaced by a fresh process that goes on from there.
(Before, that memory was pruned by the API server and lived only in the process: a DDP job with
one real restart went to Failed/NoProgress after three operator restarts.)

Each test runs its own operator process in its own namespace (the session's operator watches
another), kills it with SIGKILL and starts a new one.
"""

from __future__ import annotations

import json
import signal
import time
import uuid

import pytest
import yaml

from helpers.net import free_port
from helpers.wait import wait_for
from test_lifecycle import manifest, pods_of, running_pods

pytestmark = pytest.mark.cluster

STALLED_BEFORE_RESTART = 8
"""Seconds the job's step has stood still when the operator is killed: well inside the 30 s progress
deadline, so that a hang found `deadline` after the restart (a clock that restarted) is told apart from
one found `deadline` after the stall began."""


@pytest.fixture
def fresh(cluster, operator, spawn_operator):
    """A namespace, an operator for it (restartable), and the session operator's helpers bound to it."""
    namespace = f"rs-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)

    class Fresh:
        def __init__(self) -> None:
            self.proc = None
            self.op = None
            self.start()

        def start(self) -> None:
            self.proc = spawn_operator(namespace)
            self.op = type(operator)(cluster, namespace, self.proc.log, self.proc.metrics_port)

        def kill(self) -> None:
            self.proc.signal(signal.SIGKILL)
            self.proc.proc.wait(timeout=20)

    try:
        yield Fresh()
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")


def memory(op, name: str) -> dict:
    return op.job_status(name).get("memory") or {}


def test_a_restart_during_a_backoff_keeps_the_count_and_the_timer(fresh):
    op = fresh.op
    doc = manifest(mode="Single", restartPolicy={"backoffLimit": 20, "maxRestartsWithoutProgress": 20})
    name = doc["metadata"]["name"]
    pod = f"{name}-single-0"
    op.apply(doc)
    # Four failures: restarts at once, after 1 s, 2 s and 4 s; the fifth waits 8 s.
    for n in range(1, 6):
        uid = running_pods(op, name, 1)[pod]["metadata"]["uid"]
        op.set_pod_status(pod, "Failed", exit_code=1)
        op.wait(f"restart {n} counted", lambda: op.job_status(name).get("restarts") == n, timeout=60)
        if n < 5:
            op.wait("the replacement", lambda: (p := op.get("pod", pod)) and p["metadata"]["uid"] != uid, timeout=60)
    due = memory(op, name)["pendingRestarts"]["single-0"]
    assert due - time.time() > 3, "the fifth restart should still be waiting for its backoff"
    fresh.kill()
    fresh.start()
    op = fresh.op
    replacement = op.wait("the pod made again after the backoff", lambda: (p := op.get("pod", pod)) and p, timeout=60)
    created = time.mktime(time.strptime(replacement["metadata"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    assert created >= int(due) - 1, "the backoff timer was lost: the pod came back before it was due"
    running_pods(op, name, 1)
    op.set_pod_status(pod, "Succeeded", exit_code=0)
    status = op.wait("Succeeded", lambda: (s := op.job_status(name)).get("state") == "Succeeded" and s, timeout=60)
    assert status["restarts"] == 5, "the new operator counted a restart the old one had already counted"


def test_a_restart_while_a_ddp_pod_is_replaced_counts_it_once(fresh):
    op = fresh.op
    doc = manifest(mode="DDP")
    name = doc["metadata"]["name"]
    op.apply(doc)
    op.wait("2 running DDP pods", lambda: (p := pods_of(op, name)) and len(p) == 2
            and all(x["status"].get("phase") == "Running" for x in p.values()), timeout=90)
    op.wait("state Running with both identities remembered",
            lambda: op.job_status(name).get("state") == "Running" and len(memory(op, name).get("identities", {})) == 2)
    old_uid = op.get("pod", f"{name}-ddp-1")["metadata"]["uid"]
    fresh.kill()
    # While no operator runs, the StatefulSet replaces rank 1's pod (deleted, as on a node drain).
    op.kubectl("delete", "pod", f"{name}-ddp-1", "--wait=false")
    op.wait("the StatefulSet's replacement", lambda: (p := op.get("pod", f"{name}-ddp-1")) and p["metadata"]["uid"] != old_uid)
    fresh.start()
    op = fresh.op
    status = op.wait("the replacement counted as one restart",
                     lambda: (s := op.job_status(name)).get("restarts") == 1 and s, timeout=60)
    assert any(e["reason"] == "Deleted" for e in op.events(name))
    for rank in (0, 1):
        op.wait(f"ddp-{rank} running", lambda: (op.get("pod", f"{name}-ddp-{rank}") or {}).get("status", {}).get("phase") == "Running")
        # A rank's container exits 0 and (the StatefulSet's restartPolicy is Always) restarts in
        # place, as a kubelet reports it: its last state is the successful end.
        finished = {"status": {"phase": "Running", "containerStatuses": [{
            "name": "trainer", "image": "kubetrain/trainer:test", "imageID": "", "ready": True, "restartCount": 1,
            "state": {"running": {}}, "lastState": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}}
        op.kubectl("patch", "pod", f"{name}-ddp-{rank}", "--subresource=status", "--type=merge", "-p", json.dumps(finished))
    status = op.wait("Succeeded", lambda: (s := op.job_status(name)).get("state") == "Succeeded" and s, timeout=60)
    assert status["restarts"] == 1


def test_a_restart_during_a_hang_countdown_keeps_the_clock(fresh):
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    port = free_port()
    registry = CollectorRegistry()
    step = Gauge("kubetrain_training_step", "s", ["replica"], registry=registry)
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    deadline = 30
    try:
        op = fresh.op
        doc = manifest(mode="Single", metrics={"port": port}, runPolicy={"progressDeadlineSeconds": deadline})
        name = doc["metadata"]["name"]
        step.labels(replica="single-0").set(40)
        op.apply(doc)
        running_pods(op, name, 1)
        op.set_pod_status(f"{name}-single-0", "Running", pod_ip="127.0.0.1")
        op.wait("the step read", lambda: memory(op, name).get("lastStep") == 40)
        stalled_since = memory(op, name)["lastStepTime"]
        # The operator goes down with the stall STALLED_BEFORE_RESTART seconds old by the job's own clock.
        wait_for("the stall to age", lambda: time.time() - stalled_since >= STALLED_BEFORE_RESTART, timeout=60)
        fresh.kill()
        fresh.start()
        restarted = time.time()
        op = fresh.op
        op.wait("a Hung event", lambda: [e for e in op.events(name) if e["reason"] == "Hung"], timeout=60)
        hung_at = time.time()
        # The clock went on across the restart: the hang came about `deadline` after the stall began,
        # not `deadline` after the new operator read the step again.
        assert hung_at - restarted < deadline, f"hang after {hung_at - stalled_since:.1f} s of stall: the clock restarted"
        assert hung_at - stalled_since >= deadline - 1
        op.wait("the chief made again", lambda: (p := op.get("pod", f"{name}-single-0")) and p["status"].get("phase") == "Running")
        op.set_pod_status(f"{name}-single-0", "Succeeded", exit_code=0)
        status = op.wait("Succeeded", lambda: (s := op.job_status(name)).get("state") == "Succeeded" and s, timeout=60)
        assert status["restarts"] == 1
    finally:
        server.shutdown()


def test_a_restart_during_a_resize_renders_the_statefulset_and_job_file_at_the_new_size(fresh):
    """The operator that finishes a resize may not be the one that made the children (a restart, a
    failover to the standby): the job file and the StatefulSet are rendered again all the same, else
    the group comes back with torchrun's old --nnodes and waits for a node that never comes."""
    op = fresh.op
    doc = manifest(mode="DDP", ddp={"nodes": 2, "minNodes": 1, "maxNodes": 2})
    name = doc["metadata"]["name"]
    op.apply(doc)
    op.wait("2 running DDP pods", lambda: (p := pods_of(op, name)) and len(p) == 2
            and all(x["status"].get("phase") == "Running" for x in p.values()), timeout=90)
    op.wait("state Running at 2", lambda: (s := op.job_status(name)).get("state") == "Running" and s.get("replicas") == 2)
    fresh.kill()
    op.kubectl("scale", "trainingjob", name, "--replicas=1")
    fresh.start()
    op = fresh.op
    status = op.wait("Running at 1", lambda: (s := op.job_status(name)).get("state") == "Running"
                     and s.get("replicas") == 1 and s, timeout=90)
    assert status["restarts"] == 0
    sts = op.get("statefulset", f"{name}-ddp")
    command = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    assert sts["spec"]["replicas"] == 1 and command[command.index("--nnodes") + 1] == "1"
    job_file = yaml.safe_load(op.get("configmap", f"{name}-config")["data"]["job.yaml"])
    assert job_file["spec"]["ddp"]["nodes"] == 1
    pods = op.wait("ddp-0 alone", lambda: (p := pods_of(op, name)) and set(p) == {f"{name}-ddp-0"} and p, timeout=60)
    command = pods[f"{name}-ddp-0"]["spec"]["containers"][0]["command"]
    assert command[command.index("--nnodes") + 1] == "1"
