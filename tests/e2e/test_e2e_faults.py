"""Real faults on the real node: a replica's process SIGKILLed, a DDP rank's pod deleted; the job still succeeds."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from e2elib import NAMESPACE, example, job_status, json_objects, read_claim, stepped

pytestmark = pytest.mark.e2e

# Long enough that the fault lands after the first checkpoint and well before the end.
EPOCHS = {"parameter-server.yaml": 60, "ddp.yaml": 80}


def run_job(e2e, manifest: str, name: str) -> dict:
    doc = example(manifest, EPOCHS[manifest])
    doc["metadata"]["name"] = name
    e2e.cluster.run("kubectl", "-n", NAMESPACE, "apply", "-f", "-", input=yaml.safe_dump(doc))
    e2e.wait(f"{name}'s first checkpoint", lambda: stepped(e2e, name) and
             (job_status(e2e, name).get("lastCheckpoint") or {}).get("step"), timeout=300, every=0.5)
    return job_status(e2e, name)


def sigkill(e2e, pod: str) -> None:
    """SIGKILL the pod's trainer process from the host, through the node's containerd (a kill from
    inside the container cannot reach its PID 1)."""
    container = e2e.get("pod", pod)["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    subprocess.run(["ctr", "--address", e2e.containerd, "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", container],
                   check=True, capture_output=True, timeout=30)


def finish(e2e, name: str) -> dict:
    return e2e.wait(f"{name} to succeed", lambda: (s := job_status(e2e, name)).get("state") == "Succeeded" and s,
                    timeout=600, every=2)


def warning_reasons(e2e, name: str) -> set[str]:
    events = json.loads(e2e.kubectl("get", "events", "--field-selector", f"involvedObject.name={name}",
                                    "-o", "json"))["items"]
    return {e["reason"] for e in events if e["type"] == "Warning"}


def resumes(e2e, claim: str, replica: str) -> list[int]:
    """The steps this replica resumed from, as its event log on the claim says."""
    text = read_claim(e2e, claim, f"cat /data/run/metrics/{replica}.jsonl")
    return [e["step"] for e in json_objects(text) if e.get("event") == "resume"]


@pytest.mark.parametrize("victim", ["worker-1", "ps-0"])
def test_sigkilled_parameter_server_replica_is_restarted_and_the_job_succeeds(e2e, victim):
    name = f"fault-{victim}"
    at_kill = run_job(e2e, "parameter-server.yaml", name)

    sigkill(e2e, f"{name}-{victim}")
    status = finish(e2e, name)

    assert status["restarts"] >= 1, status
    assert "Killed" in warning_reasons(e2e, name), warning_reasons(e2e, name)
    if victim == "ps-0":
        steps = resumes(e2e, f"{name}-ckpt-ps-0", "ps-0")
        assert steps and all(s >= at_kill["lastCheckpoint"]["step"] > 0 for s in steps), (steps, at_kill)
    print(f"{name}: killed after checkpoint {at_kill['lastCheckpoint']['step']}; {status['restarts']} restart(s); "
          f"progress {status['progress']}")


def test_deleted_ddp_rank_pod_is_recreated_and_the_job_resumes(e2e):
    name = "fault-ddp"
    at_kill = run_job(e2e, "ddp.yaml", name)

    e2e.kubectl("delete", "pod", f"{name}-ddp-1", "--wait=false")
    status = finish(e2e, name)

    steps = resumes(e2e, f"data-{name}-ddp-0", "ddp-0")
    assert steps and all(s >= at_kill["lastCheckpoint"]["step"] > 0 for s in steps), (steps, at_kill)
    print(f"{name}: rank 1's pod deleted after checkpoint {at_kill['lastCheckpoint']['step']}; resumed from {steps}; "
          f"restarts {status.get('restarts')}; warnings {warning_reasons(e2e, name)}")
