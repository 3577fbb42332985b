"""Fault-tolerant DDP against the real API server and operator (chart RBAC, kwok's fake nodes): the job's
Lighthouse pod and Service beside its StatefulSet, `kubectl scale` 3 -> 2 -> 3 replica groups live (the
survivors' pods keep their UIDs, the StatefulSet never goes to 0, nothing is counted as a restart), a
lost group's container restarted in place counted once as ReplicaGroupLost with no other pod touched,
and a lost Lighthouse replaced. The trainers' own side (a real kill, the heal, the quorum) is
tests/local/test_fault_tolerant_runs.py and, in real pods, tests/e2e/test_e2e_fault_tolerance.py."""

from __future__ import annotations

import json

import pytest
from test_kubectl_scale import Watch, operator, reasons, resize, running_set, settled, uids  # noqa: F401 (a fixture)
from test_lifecycle import manifest, pods_of

pytestmark = pytest.mark.cluster

GROUPS = {"nodes": 3, "minNodes": 2, "maxNodes": 3, "procsPerNode": 1, "backend": "gloo", "faultTolerance": {}}


def restarted_in_place(op, pod: str, restarts: int, exit_code: int) -> None:
    """What a kubelet reports of a StatefulSet pod whose container was killed and started again."""
    status = {"phase": "Running", "containerStatuses": [{
        "name": "trainer", "image": "kubetrain/trainer:test", "imageID": "", "ready": True, "restartCount": restarts,
        "state": {"running": {"startedAt": "2026-12-02T00:00:00Z"}},
        "lastState": {"terminated": {"exitCode": exit_code, "reason": "Error"}}}]}
    op.kubectl("patch", "pod", pod, "--subresource=status", "--type=merge", "-p", json.dumps({"status": status}))


def test_a_fault_tolerant_job_keeps_its_groups_through_scaling_and_losses(operator, tmp_path):  # noqa: F811
    doc = manifest(mode="DDP", ddp=GROUPS)
    name = doc["metadata"]["name"]
    lighthouse, sts = f"{name}-lighthouse-0", f"{name}-ddp"
    operator.apply(doc)
    everyone = {"ddp-0", "ddp-1", "ddp-2", "lighthouse-0"}
    before = uids(running_set(operator, name, everyone))
    service = operator.get("service", lighthouse)
    assert service["spec"]["selector"]["kubetrain.dev/replica"] == "lighthouse-0"
    assert service["spec"]["ports"][0]["port"] == 29510 and service["spec"]["type"] == "ClusterIP"
    assert service["metadata"]["ownerReferences"][0]["name"] == name
    settled(operator, name, 3)

    for size, replicas in ((2, everyone - {"ddp-2"}), (3, everyone)):
        watch = Watch(operator, "statefulset", sts, tmp_path / f"sts-{size}.json")
        try:
            went = resize(operator, name, size, tmp_path)
            pods = running_set(operator, name, replicas)
            watch.caught_up(lambda version: version["spec"]["replicas"] == size)
        finally:
            versions = watch.stop()
        assert went == [(5 - size, None), (size, None)], went  # live: never Restarting, never Resizing
        assert [v["spec"]["replicas"] for v in versions][-1] == size and 0 not in [v["spec"]["replicas"] for v in versions]
        survivors = {f"{name}-{r}" for r in replicas} - {f"{name}-ddp-2"}
        assert {n: u for n, u in uids(pods).items() if n in survivors} == {n: before[n] for n in survivors}
    status = operator.job_status(name)
    assert status["restarts"] == 0 and status["state"] == "Running"
    seen = reasons(operator, name)
    assert seen.count("Resized") == 2 and "Resizing" not in seen, seen
    assert any(e["reason"] == "Resized" and "live: ddp-2 leaves" in e["message"] for e in operator.events(name))

    # A group lost: its container killed (137) and started again in place, as the kubelet does.
    pods = pods_of(operator, name)
    restarted_in_place(operator, f"{name}-ddp-1", 1, 137)
    operator.wait("the lost group counted", lambda: operator.job_status(name).get("restarts") == 1, timeout=60)
    lost = next(e for e in operator.events(name) if e["reason"] == "ReplicaGroupLost")
    assert "ddp-1 was killed by SIGKILL; the other replica groups train on" in lost["message"]
    after = pods_of(operator, name)
    assert uids(after) == uids(pods) and not any(p["metadata"].get("deletionTimestamp") for p in after.values())
    assert operator.get("statefulset", sts)["spec"]["replicas"] == 3

    # The Lighthouse lost: its pod is replaced, the groups' pods stay.
    operator.set_pod_status(lighthouse, "Failed", exit_code=137)
    replaced = running_set(operator, name, everyone, {pods[lighthouse]["metadata"]["uid"]})
    assert replaced[lighthouse]["metadata"]["uid"] != pods[lighthouse]["metadata"]["uid"]
    assert {n: u for n, u in uids(replaced).items() if n != lighthouse} == \
        {n: u for n, u in uids(pods).items() if n != lighthouse}
    assert "LighthouseLost" in reasons(operator, name)
    assert operator.job_status(name)["restarts"] == 2
    assert "forbidden" not in operator.log.read_text().lower()
