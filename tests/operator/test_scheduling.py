"""Why a job waits, and replicas on nodes that stop answering, against the real control plane.

The scheduler, the node lifecycle controller and the taint manager are the real ones (kwokctl runs
kube-scheduler and kube-controller-manager); the nodes are kwok's. A node "dies" the way a real one
does as far as the control plane can tell: kwok stops managing it (no more heartbeats, nothing
finishes its pods' deletion) and its Ready condition turns False.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.metrics import scrape
from kubetrain.engine.children import NODE_LOST_TAINTS
from helpers.wait import wait_for
from test_lifecycle import condition, manifest, pods_of

pytestmark = pytest.mark.cluster

POOL = "kubetrain.dev/test-pool"


def waiting_jobs(operator, reason: str) -> float:
    """kubetrain_operator_jobs_waiting{namespace=<the operator's>, reason} from the operator's /metrics."""
    for family in text_string_to_metric_families(scrape(f"127.0.0.1:{operator.metrics_port}")):
        for s in family.samples:
            if s.name == "kubetrain_operator_jobs_waiting" and s.labels == {"namespace": operator.namespace,
                                                                            "reason": reason}:
                return s.value
    return 0.0


def test_a_job_no_node_fits_says_why_and_fails_after_its_scheduling_timeout(operator):
    doc = manifest(mode="Single", runPolicy={"schedulingTimeoutSeconds": 12},
                   podTemplate={"spec": {"nodeSelector": {POOL: "no-such-pool"}}})
    name = doc["metadata"]["name"]
    operator.apply(doc)
    got = operator.wait("an Unschedulable condition", lambda: (s := operator.job_status(name)) and
                        (c := condition(s, "Created")) and c["reason"] == "Unschedulable" and c)
    # The scheduler's own words, so the user sees which constraint no node meets.
    assert got["message"].startswith("single-0 cannot be scheduled: 0/")
    assert "didn't match Pod's node affinity/selector" in got["message"]
    events = [e for e in operator.events(name) if e["reason"] == "Unschedulable"]
    assert len(events) == 1 and events[0]["type"] == "Warning"
    assert waiting_jobs(operator, "Unschedulable") == 1
    status = operator.wait("state Failed", lambda: (s := operator.job_status(name)).get("state") == "Failed" and s,
                           timeout=40)
    failed = condition(status, "Failed")
    assert failed["reason"] == "Unschedulable"
    assert "schedulingTimeoutSeconds (12 s)" in failed["message"]
    operator.wait("the waiting gauge back to 0", lambda: waiting_jobs(operator, "Unschedulable") == 0)
    operator.wait("the pending pod cleaned up", lambda: not pods_of(operator, name))


class Nodes:
    """kwok nodes of this test only: labelled and tainted with a pool of their own, so that no other
    test's pod lands on them and this test's pods land nowhere else."""

    def __init__(self, cluster, pool: str):
        self.kube = cluster.kube()
        self.pool = pool
        self.names: list[str] = []

    def add(self) -> str:
        name = f"kt-{self.pool}-{len(self.names)}"
        self.kube.apply({"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
            "labels": {"type": "kwok", "kubernetes.io/hostname": name, POOL: self.pool}},
            "spec": {"taints": [{"key": POOL, "value": self.pool, "effect": "NoSchedule"}]}})
        self.names.append(name)
        wait_for(f"node {name} Ready", lambda: (n := self.kube.get("node", name)) and any(
            c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", [])), timeout=30)
        return name

    def kill(self, name: str) -> None:
        """kwok lets go of the node (no heartbeat, no kubelet finishing its pods), and it reports NotReady."""
        self.kube("label", "node", name, "type=lost", "--overwrite")  # hack/cluster: kwok manages type=kwok
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ready = {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "test: the node stopped",
                 "lastHeartbeatTime": now, "lastTransitionTime": now}
        self.kube("patch", "node", name, "--subresource=status", "--type=strategic", "-p",
                  json.dumps({"status": {"conditions": [ready]}}))

    def remove(self) -> None:
        for name in self.names:
            self.kube.run("delete", "node", name, "--wait=false", check=False)


@pytest.fixture
def nodes(cluster):
    # A letter first: a label value such as 812e00 is a number to kubectl's YAML (seen once in CI), not a string.
    pool = f"p{uuid.uuid4().hex[:6]}"
    made = Nodes(cluster, pool)
    try:
        yield made
    finally:
        made.remove()


def on_pool(pool: str, seconds: int = 2) -> dict:
    """A pod template for the pool, tolerating a lost node for `seconds` only, with a grace period as short."""
    lost = [{"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds}
            for key in NODE_LOST_TAINTS]
    return {"spec": {"nodeSelector": {POOL: pool}, "terminationGracePeriodSeconds": seconds,
                     "tolerations": [{"key": POOL, "operator": "Equal", "value": pool, "effect": "NoSchedule"}, *lost]}}


def explain(operator, jobs, nodes) -> str:
    """The pods of the jobs, the pool's nodes and the operator's log tail, for a failure message."""
    lines = []
    for job in jobs:
        for p in pods_of(operator, job).values():
            conds = {c["type"]: c.get("reason", c["status"]) for c in p["status"].get("conditions", [])}
            lines.append(f"pod {p['metadata']['name']} on {p['spec'].get('nodeName')}: {p['status'].get('phase')}, "
                         f"deleting at {p['metadata'].get('deletionTimestamp')}, {conds}")
        status = operator.job_status(job)
        lines.append(f"job {job}: {status.get('state')}, restarts {status.get('restarts')}")
        lines += [f"  event {e['reason']}: {e['message']}" for e in operator.events(job)]
    for name in nodes.names:
        node = nodes.kube.get("node", name) or {}
        lines.append(f"node {name}: taints {node.get('spec', {}).get('taints')}")
    return "\n".join(lines + operator.log.read_text().splitlines()[-20:])


def placed(operator, jobs: dict[str, int], node: str) -> dict[str, str] | None:
    """Every pod of the jobs (name -> how many) Running on `node`, as pod name -> uid; None until so."""
    out = {}
    for job, count in jobs.items():
        pods = [p for p in pods_of(operator, job).values() if not p["metadata"].get("deletionTimestamp")]
        if len(pods) != count or not all(p["status"].get("phase") == "Running" and p["spec"].get("nodeName") == node
                                         for p in pods):
            return None
        out.update({p["metadata"]["name"]: p["metadata"]["uid"] for p in pods})
    return out


def nodelost_restarts(operator) -> dict[str, float]:
    """kubetrain_operator_replica_restarts_total{reason="NodeLost"} in the operator's namespace, by mode (the
    modes that counted any: every mode's series exists from its first job, at 0, metrics.start_counting)."""
    exposed = text_string_to_metric_families(scrape(f"127.0.0.1:{operator.metrics_port}"))
    return {s.labels["mode"]: s.value for f in exposed for s in f.samples
            if s.name == "kubetrain_operator_replica_restarts_total" and s.value
            and s.labels.get("reason") == "NodeLost" and s.labels.get("namespace") == operator.namespace}


def test_replicas_on_a_node_that_stops_answering_are_replaced_on_another_counted_nodelost(operator, nodes):
    first = nodes.add()
    ps = manifest(podTemplate=on_pool(nodes.pool))
    ddp = manifest(mode="DDP", podTemplate=on_pool(nodes.pool))
    jobs = {ps["metadata"]["name"]: 3, ddp["metadata"]["name"]: 2}
    try:
        for doc in (ps, ddp):
            operator.apply(doc)
        before = operator.wait(f"every pod running on {first}", lambda: placed(operator, jobs, first))
        second = nodes.add()
        started = time.monotonic()
        nodes.kill(first)
        # The taint manager evicts them; nothing on the dead node finishes that, so the operator deletes
        # them forcibly once their grace period is over; a PS replica comes back under its own name and the
        # StatefulSet makes its ranks again, all on the node that answers.
        # 22-39 s on a loaded 2-core machine: node monitor period (5 s), toleration, grace, the 10 s bound.
        after = wait_for(f"every pod replaced on {second}", lambda: placed(operator, jobs, second), timeout=90,
                         explain=lambda: explain(operator, jobs, nodes))
        replaced_in = time.monotonic() - started
        assert set(after) == set(before) and not set(after.values()) & set(before.values())
        for job, count in jobs.items():
            wait_for(f"{job}: {count} restarts, Running", lambda: (s := operator.job_status(job)).get("restarts") == count
                     and s.get("state") == "Running", timeout=30, explain=lambda: explain(operator, jobs, nodes))
            lost = [e["message"] for e in operator.events(job) if e["reason"] == "NodeLost"]
            assert sum("node stopped answering" in m for m in lost) == count, explain(operator, jobs, nodes)
            assert sum("deleted it forcibly" in m for m in lost) == count
        assert nodelost_restarts(operator) == {"ParameterServer": 3, "DDP": 2}
        print(f"replaced on {second} {replaced_in:.1f} s after {first} turned NotReady")
    finally:
        # Their pods would be lost again with the pool's nodes and churn on through the next tests.
        for job in jobs:
            operator.kubectl("delete", "trainingjob", job, "--wait=false")
