"""A job's life in the cluster beyond training: suspend and resume, deletion, and the operator's RBAC."""

from __future__ import annotations

import json
import time

import pytest
from e2elib import (
    NAMESPACE, apply, events_of, example, figure, first_step, job_status, succeeded,
)

pytestmark = pytest.mark.e2e

OWNED_KINDS = "pods,services,configmaps,secrets,persistentvolumeclaims,statefulsets"


def test_suspended_job_stops_after_a_checkpoint_and_resumes_from_it(e2e):
    name = "suspend-single"
    doc = example("single.yaml", 2000)
    doc["metadata"]["name"] = name
    doc["spec"]["checkpoint"]["intervalSteps"] = 10_000  # the checkpoint it resumes from is the one made at the stop
    apply(e2e, doc)
    first_step(e2e, f"{name}-single-0")

    e2e.kubectl("patch", "trainingjob", name, "--type=merge", "-p", '{"spec": {"runPolicy": {"suspend": true}}}')
    suspended = e2e.wait(f"{name} to be Suspended with no pod left",
                         lambda: job_status(e2e, name).get("state") == "Suspended"
                         and not json.loads(e2e.kubectl("get", "pods", "-l", f"kubetrain.dev/job-name={name}",
                                                        "-o", "json"))["items"], timeout=180)
    assert suspended
    e2e.kubectl("patch", "trainingjob", name, "--type=merge", "-p", '{"spec": {"runPolicy": {"suspend": false}}}')
    status = succeeded(e2e, name, timeout=900)

    events = events_of(e2e, f"{name}-ckpt-single-0", "single-0")
    stops = [e["step"] for e in events if e["event"] == "stop"]
    resumes = [e["step"] for e in events if e["event"] == "resume"]
    checkpoints = [e["step"] for e in events if e["event"] == "checkpoint"]
    assert len(stops) == 1 and 0 < stops[0] < status["progress"]["totalSteps"], events[-5:]
    assert stops[0] in checkpoints, (stops, checkpoints)  # the final checkpoint at the stop ...
    assert resumes == stops, (resumes, stops)  # ... is where training continued
    assert status.get("restarts", 0) == 0, status  # a suspension is not a failure
    reasons = [e["reason"] for e in json.loads(e2e.kubectl(
        "get", "events", "--field-selector", f"involvedObject.name={name}", "-o", "json"))["items"]]
    assert {"Suspended", "Resumed"} <= set(reasons), reasons
    figure(f"{name}: suspended at step {stops[0]} (checkpoint written at the stop), resumed from step {resumes[0]}, "
           f"Succeeded at {status['progress']['step']}")


def owned(e2e, name: str) -> list[str]:
    """What of the job is left in its namespace (by its label or its name) and among the PersistentVolumes."""
    left = e2e.kubectl("get", OWNED_KINDS, "-o", "name").split()
    labelled = e2e.kubectl("get", OWNED_KINDS, "-l", f"kubetrain.dev/job-name={name}", "-o", "name").split()
    mine = sorted({x for x in left if x.split("/", 1)[1].startswith(f"{name}-") or f"-{name}-" in x} | set(labelled))
    volumes = json.loads(e2e.cluster.kubectl("get", "pv", "-o", "json"))["items"]
    mine += [f"pv/{v['metadata']['name']} (claim {v['spec']['claimRef']['name']})" for v in volumes
             if name in (v["spec"].get("claimRef") or {}).get("name", "")]
    return mine


def test_deleting_a_running_job_leaves_nothing_behind(e2e):
    name = "delete-ddp"
    doc = example("ddp.yaml", 2000)
    doc["metadata"]["name"] = name
    apply(e2e, doc)
    first_step(e2e, f"{name}-ddp-0")
    assert any(x.startswith("statefulset") for x in owned(e2e, name)), owned(e2e, name)

    start = time.monotonic()
    e2e.kubectl("delete", "trainingjob", name, "--wait=true", "--timeout=120s", timeout=150)
    e2e.wait(f"everything of {name} to go", lambda: not owned(e2e, name), timeout=180, every=2)
    figure(f"{name}: deleted while training; its pods, Services, ConfigMap, Secret, StatefulSet, claims and "
           f"volumes gone {time.monotonic() - start:.0f} s later")


def test_a_verb_missing_from_the_role_is_reported_with_the_operation_and_recovers(e2e):
    """The chart's Role without `create` on pods: the job's status and the operator's log say what was refused."""
    role = json.loads(e2e.kubectl("get", "role", "kubetrain", "-o", "json"))
    original = [dict(rule) for rule in role["rules"]]
    crippled = [dict(r, verbs=[v for v in r["verbs"] if v != "create"]) if r["resources"] == ["pods"] else r
                for r in original]
    assert crippled != original
    name = "rbac-single"
    doc = example("single.yaml", 5)
    doc["metadata"]["name"] = name
    patch = json.dumps([{"op": "replace", "path": "/rules", "value": crippled}])
    e2e.kubectl("patch", "role", "kubetrain", "--type=json", "-p", patch)
    try:
        apply(e2e, doc)
        condition = e2e.wait(f"{name}'s status to report the refused operation", lambda: next(
            (c for c in job_status(e2e, name).get("conditions", []) if c["reason"] == "Forbidden"), None), timeout=120)
        log = e2e.kubectl("logs", e2e.operator_pod(), "--tail=200")
    finally:
        e2e.kubectl("patch", "role", "kubetrain", "--type=json",
                    "-p", json.dumps([{"op": "replace", "path": "/rules", "value": original}]))
    assert f"create pod {NAMESPACE}/{name}-single-0: 403" in condition["message"], condition
    assert "lacks this permission" in condition["message"] and "rbac.yaml" in condition["message"], condition
    assert f"{NAMESPACE}/{name}: create pod {NAMESPACE}/{name}-single-0: 403" in log, log[-3000:]
    # The Role back as the chart made it, the same job goes on to succeed.
    status = succeeded(e2e, name)
    assert not [c for c in status["conditions"] if c["reason"] == "Forbidden"], status["conditions"]
    figure(f"{name}: Role without create on pods -> status condition {condition['type']}/{condition['reason']}: "
           f"{condition['message'][:160]}...; Role restored -> Succeeded")


def test_operator_pod_runs_under_its_own_service_account_with_no_token_beyond_its_role(e2e):
    pod = json.loads(e2e.kubectl("get", "pods", "-l", "app.kubernetes.io/component=operator", "-o", "json"))["items"][0]
    assert pod["spec"]["serviceAccountName"] == "kubetrain"
    can = e2e.kube.run("auth", "can-i", "--list", f"--as=system:serviceaccount:{NAMESPACE}:kubetrain",
                       timeout=60, check=False)
    assert can.returncode == 0, can.stderr
    lines = can.stdout.splitlines()
    assert any(line.startswith("pods ") and "create" in line for line in lines), can.stdout
    assert not any(line.startswith("secrets ") and ("get" in line or "list" in line) for line in lines), can.stdout
