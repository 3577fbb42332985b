"""The operator against the real control plane: children, restarts, lifecycle, status.

Pods run on kwok's fake nodes: a failure is what a kubelet would report,
written through the pod's status subresource.
"""

from __future__ import annotations

import ipaddress
import json
import uuid

import pytest
import yaml

from helpers.net import free_port
from kubetrain.api.status import read_status, to_dict
from support import EXAMPLES

pytestmark = pytest.mark.cluster


def manifest(mode: str = "ParameterServer", name: str | None = None, **spec) -> dict:
    doc = yaml.safe_load((EXAMPLES / {"ParameterServer": "parameter-server.yaml", "DDP": "ddp.yaml", "Single": "single.yaml"}[mode]).read_text())
    doc["metadata"]["name"] = name or f"{mode.lower()[:6]}-{uuid.uuid4().hex[:5]}"
    for key, value in spec.items():
        doc["spec"][key] = value
    return doc


def pods_of(op, job: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in op.items("pods", f"kubetrain.dev/job-name={job}")}


def condition(status: dict, ctype: str) -> dict | None:
    return next((c for c in status.get("conditions", []) if c["type"] == ctype), None)


def running_pods(op, job: str, n: int) -> dict[str, dict]:
    return op.wait(f"{n} running pods of {job}", lambda: (p := pods_of(op, job)) and len(p) == n
                   and all(x["status"].get("phase") == "Running" for x in p.values()) and p)


def test_parameter_server_job_gets_its_children_and_a_status(operator):
    doc = manifest()
    name = doc["metadata"]["name"]
    operator.apply(doc)
    pods = running_pods(operator, name, 3)
    assert set(pods) == {f"{name}-ps-0", f"{name}-worker-0", f"{name}-worker-1"}
    uid = operator.get("trainingjob", name)["metadata"]["uid"]
    # The token Secret's name carries the job's uid: a job re-created under the same name gets its own.
    for kind, child in [("configmap", f"{name}-config"), ("secret", f"{name}-token-{uid[:8]}"), ("service", f"{name}-ps-0"),
                        ("persistentvolumeclaim", f"{name}-ckpt-ps-0"), ("pod", f"{name}-worker-1")]:
        obj = operator.get(kind, child)
        assert obj is not None, f"{kind} {child} missing"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
    # The shard's Service got a virtual address from the cluster's Service range.
    assert ipaddress.ip_address(operator.get("service", f"{name}-ps-0")["spec"]["clusterIP"]) in \
        ipaddress.ip_network("10.0.0.0/16")
    worker = pods[f"{name}-worker-1"]["spec"]["containers"][0]
    env = {e["name"]: e for e in worker["env"]}
    assert env["KUBETRAIN_PS_ADDRS"]["value"] == f"{name}-ps-0:50051"
    assert env["KUBETRAIN_JOB_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == f"{name}-token-{uid[:8]}"
    status = operator.wait("state Running", lambda: (s := operator.job_status(name)).get("state") == "Running" and s)
    assert status["replicaStatuses"]["worker"]["active"] == 2
    assert status["workers"] == 2 and status["startTime"]
    assert condition(status, "Running")["status"] == "True"
    assert condition(status, "Running")["observedGeneration"] == 1
    # The status reads back from the API server as the operator wrote it (its JSON is what the typed status
    # gives again): what lets the operator know its own write's event and skip a round (own_status_echo).
    assert to_dict(read_status(status)) == status
    line = operator.kubectl("get", "tj", name)
    header, row = line.splitlines()[:2]
    assert header.split() == ["NAME", "MODE", "WORKERS", "STEP", "ETA", "RESTARTS", "STATE", "AGE"]
    assert row.split()[1:3] == ["ParameterServer", "2"] and "Running" in row


def test_failed_worker_is_replaced_and_the_restart_recorded(operator):
    doc = manifest()
    name = doc["metadata"]["name"]
    operator.apply(doc)
    pods = running_pods(operator, name, 3)
    old_uid = pods[f"{name}-worker-1"]["metadata"]["uid"]
    operator.set_pod_status(f"{name}-worker-1", "Failed", exit_code=137)
    operator.wait("a new worker-1 pod", lambda: (p := operator.get("pod", f"{name}-worker-1")) and p["metadata"]["uid"] != old_uid)
    status = operator.wait("restarts 1", lambda: (s := operator.job_status(name)).get("restarts") == 1 and s)
    events = operator.wait("a Killed event", lambda: [e for e in operator.events(name) if e["reason"] == "Killed"])
    assert "worker-1 was killed by SIGKILL; restart 1 of 6" in events[0]["message"]
    restarting = condition(status, "Restarting")
    assert restarting is not None and restarting["reason"] == "Killed"


def test_a_worker_reported_dead_is_replaced_before_its_pod_is_marked_failed(operator):
    """The kubelet reports the trainer's exit first, the pod's phase Failed only after tearing its
    sandbox down: the operator replaces it at the first report (here the phase never follows)."""
    doc = manifest()
    name = doc["metadata"]["name"]
    operator.apply(doc)
    pods = running_pods(operator, name, 3)
    old_uid = pods[f"{name}-worker-1"]["metadata"]["uid"]
    operator.set_pod_status(f"{name}-worker-1", "Running", exit_code=137)
    operator.wait("a new worker-1 pod", lambda: (p := operator.get("pod", f"{name}-worker-1")) and p["metadata"]["uid"] != old_uid)
    operator.wait("a Killed event", lambda: [e for e in operator.events(name) if e["reason"] == "Killed"])
    assert operator.job_status(name)["restarts"] == 1


def test_eviction_and_deletion_are_restarts_with_their_reasons(operator):
    doc = manifest()
    name = doc["metadata"]["name"]
    operator.apply(doc)
    running_pods(operator, name, 3)
    operator.wait("state Running", lambda: operator.job_status(name).get("state") == "Running")
    operator.set_pod_status(f"{name}-worker-0", "Failed", reason="Evicted")
    operator.wait("an Evicted event", lambda: [e for e in operator.events(name) if e["reason"] == "Evicted"])
    operator.kubectl("delete", "pod", f"{name}-ps-0", "--wait=false")
    operator.wait("a Deleted event", lambda: [e for e in operator.events(name) if e["reason"] == "Deleted"])
    running_pods(operator, name, 3)
    assert operator.job_status(name)["restarts"] == 2


@pytest.mark.parametrize("policy, code, reason", [("Never", 75, "TransientError"), ("ExitCode", 1, "Error"), ("OnFailure", 2, "InvalidConfiguration")])
def test_permanent_failures_fail_the_job(operator, policy, code, reason):
    doc = manifest(restartPolicy={"policy": policy})
    name = doc["metadata"]["name"]
    operator.apply(doc)
    running_pods(operator, name, 3)
    operator.set_pod_status(f"{name}-worker-0", "Failed", exit_code=code)
    status = operator.wait("state Failed", lambda: (s := operator.job_status(name)).get("state") == "Failed" and s)
    assert condition(status, "Failed")["reason"] == reason
    assert status["completionTime"]
    # cleanPodPolicy Running: the pods still running are deleted.
    operator.wait("running pods deleted", lambda: all(
        p["metadata"].get("deletionTimestamp") or p["status"].get("phase") == "Failed" for p in pods_of(operator, name).values()))


def test_workers_then_shards_finishing_is_success(operator):
    doc = manifest(runPolicy={"cleanPodPolicy": "All"})
    name = doc["metadata"]["name"]
    operator.apply(doc)
    running_pods(operator, name, 3)
    for r in ("worker-0", "worker-1", "ps-0"):
        operator.set_pod_status(f"{name}-{r}", "Succeeded", exit_code=0)
    status = operator.wait("state Succeeded", lambda: (s := operator.job_status(name)).get("state") == "Succeeded" and s)
    assert condition(status, "Succeeded")["reason"] == "Completed"
    assert status["replicaStatuses"]["worker"]["succeeded"] == 2
    operator.wait("pods cleaned up", lambda: not [p for p in pods_of(operator, name).values() if not p["metadata"].get("deletionTimestamp")])


def test_suspend_stops_the_pods_and_resume_brings_them_back(operator):
    doc = manifest()
    name = doc["metadata"]["name"]
    operator.apply(doc)
    running_pods(operator, name, 3)
    operator.kubectl("patch", "tj", name, "--type=merge", "-p", json.dumps({"spec": {"runPolicy": {"suspend": True}}}))
    operator.wait("state Suspended", lambda: operator.job_status(name).get("state") == "Suspended")
    operator.wait("pods gone", lambda: not pods_of(operator, name))
    operator.kubectl("patch", "tj", name, "--type=merge", "-p", json.dumps({"spec": {"runPolicy": {"suspend": False}}}))
    running_pods(operator, name, 3)
    status = operator.wait("state Running", lambda: (s := operator.job_status(name)).get("state") == "Running" and s)
    assert status["restarts"] == 0
    assert condition(status, "Suspended")["status"] == "False"


def test_active_deadline_fails_the_job(operator):
    doc = manifest(runPolicy={"activeDeadlineSeconds": 3})
    name = doc["metadata"]["name"]
    operator.apply(doc)
    status = operator.wait("state Failed", lambda: (s := operator.job_status(name)).get("state") == "Failed" and s, timeout=30)
    assert condition(status, "Failed")["reason"] == "DeadlineExceeded"


def test_ttl_deletes_a_finished_job_and_deletion_cleans_up(operator):
    doc = manifest(mode="Single", runPolicy={"ttlSecondsAfterFinished": 2})
    name = doc["metadata"]["name"]
    operator.apply(doc)
    running_pods(operator, name, 1)
    uid = operator.get("trainingjob", name)["metadata"]["uid"]
    operator.set_pod_status(f"{name}-single-0", "Succeeded", exit_code=0)
    operator.wait("the job deleted by its TTL", lambda: operator.get("trainingjob", name) is None, timeout=60)
    operator.wait("children garbage-collected", lambda: all(
        operator.get(kind, child) is None for kind, child in
        [("configmap", f"{name}-config"), ("secret", f"{name}-token-{uid[:8]}"),
         ("persistentvolumeclaim", f"{name}-ckpt-single-0")]), timeout=60)


def test_immutable_fields_cannot_change(operator):
    doc = manifest()
    name = doc["metadata"]["name"]
    operator.apply(doc)
    done = operator.kube.run("patch", "tj", name, "--type=merge", "-p",
                             json.dumps({"spec": {"parameterServer": {"workers": 5}}}), check=False)
    assert done.returncode != 0
    assert "workers is immutable" in done.stderr


def test_ddp_job_runs_as_a_statefulset(operator):
    doc = manifest(mode="DDP")
    name = doc["metadata"]["name"]
    operator.apply(doc)
    sts = operator.wait("the StatefulSet", lambda: operator.get("statefulset", f"{name}-ddp"))
    assert sts["spec"]["replicas"] == 2
    assert operator.get("service", f"{name}-ddp")["spec"]["clusterIP"] == "None"
    pods = operator.wait("2 DDP pods", lambda: (p := pods_of(operator, name)) and len(p) == 2 and p)
    assert set(pods) == {f"{name}-ddp-0", f"{name}-ddp-1"}


def test_progress_is_read_from_the_chief_and_a_stall_is_a_hang(operator):
    """The chief's /metrics is served on loopback by the test (kwok pods run nothing):
    the pod's IP is set to 127.0.0.1 through the status subresource."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server


    port = free_port()
    registry = CollectorRegistry()
    labels = ["namespace", "job", "role", "replica"]
    step = Gauge("kubetrain_training_step", "s", labels, registry=registry)
    total = Gauge("kubetrain_total_steps", "t", labels, registry=registry)
    ckpt = Gauge("kubetrain_last_checkpoint_step", "c", labels, registry=registry)
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        doc = manifest(mode="Single", metrics={"port": port}, runPolicy={"progressDeadlineSeconds": 6})
        name = doc["metadata"]["name"]
        lab = dict(namespace=operator.namespace, job=name, role="single", replica="single-0")
        step.labels(**lab).set(40)
        total.labels(**lab).set(230)
        ckpt.labels(**lab).set(25)
        operator.apply(doc)
        running_pods(operator, name, 1)
        operator.set_pod_status(f"{name}-single-0", "Running", pod_ip="127.0.0.1")
        status = operator.wait("progress in the status", lambda: (s := operator.job_status(name)).get("progress", {}).get("step") == 40 and s)
        assert status["progress"]["totalSteps"] == 230
        assert status["lastCheckpoint"]["step"] == 25
        # No new step for progressDeadlineSeconds: a hang, handled as a failure.
        operator.wait("a Hung event", lambda: [e for e in operator.events(name) if e["reason"] == "Hung"], timeout=40)
        # The round records its Events before it writes the status: the restart may show a moment later.
        operator.wait("the hang counted as a restart", lambda: operator.job_status(name)["restarts"] >= 1, timeout=30)
    finally:
        server.shutdown()


def test_a_pending_volume_is_reported_in_the_status(operator):
    doc = manifest(mode="Single", checkpoint={"storage": {"storageClassName": "no-such-class"}})
    name = doc["metadata"]["name"]
    operator.apply(doc)
    status = operator.wait("a VolumePending condition", lambda: (s := operator.job_status(name)) and
                           (c := condition(s, "Created")) and c["reason"] == "VolumePending" and s)
    assert f"{name}-ckpt-single-0 is Pending" in condition(status, "Created")["message"]
    assert [e for e in operator.events(name) if e["reason"] == "VolumePending"]


def test_an_image_that_cannot_be_pulled_is_reported_in_the_status(operator):
    doc = manifest(mode="Single")
    name = doc["metadata"]["name"]
    operator.apply(doc)
    pod = f"{name}-single-0"
    operator.wait("the pod", lambda: operator.get("pod", pod))
    status = {"status": {"phase": "Pending", "containerStatuses": [{
        "name": "trainer", "image": "kubetrain/trainer:nope", "imageID": "", "ready": False, "restartCount": 0,
        "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image kubetrain/trainer:nope"}}}]}}
    operator.kubectl("patch", "pod", pod, "--subresource=status", "--type=merge", "-p", json.dumps(status))
    # On the condition of the job's state: Created, or Running when a round saw kwok run the pod first.
    got = operator.wait("an ImagePullFailed condition", lambda: (s := operator.job_status(name)) and
                        (c := condition(s, s.get("state", "Created"))) and c["reason"] == "ImagePullFailed" and c)
    assert "ImagePullBackOff" in got["message"] and "kubetrain/trainer:nope" in got["message"]


def fail_pod(operator, name: str, replica: str, code: int) -> None:
    """Fail the replica's current pod and wait until a new one replaced it."""
    pod = f"{name}-{replica}"
    old = operator.wait(f"{pod} running", lambda: (p := operator.get("pod", pod)) and p["status"].get("phase") == "Running" and p)
    operator.set_pod_status(pod, "Failed", exit_code=code)
    return old["metadata"]["uid"]


def test_backoff_limit_fails_the_job(operator):
    doc = manifest(restartPolicy={"backoffLimit": 1})
    name = doc["metadata"]["name"]
    operator.apply(doc)
    running_pods(operator, name, 3)
    old = fail_pod(operator, name, "worker-0", 137)
    operator.wait("worker-0 replaced", lambda: (p := operator.get("pod", f"{name}-worker-0")) and p["metadata"]["uid"] != old)
    fail_pod(operator, name, "worker-0", 137)
    status = operator.wait("state Failed", lambda: (s := operator.job_status(name)).get("state") == "Failed" and s)
    assert condition(status, "Failed")["reason"] == "BackoffLimitExceeded"
    assert status["restarts"] == 1


def test_restarts_without_a_new_checkpoint_fail_the_job(operator):
    # No trainer runs on kwok's nodes, so no checkpoint ever appears: the first
    # restart already made no progress, and the budget of 0 is spent.
    doc = manifest(restartPolicy={"maxRestartsWithoutProgress": 0})
    name = doc["metadata"]["name"]
    operator.apply(doc)
    running_pods(operator, name, 3)
    fail_pod(operator, name, "worker-1", 75)
    status = operator.wait("state Failed", lambda: (s := operator.job_status(name)).get("state") == "Failed" and s)
    assert condition(status, "Failed")["reason"] == "NoProgress"
