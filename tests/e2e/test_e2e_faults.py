"""Real faults on the real node: a replica's process SIGKILLed, a DDP rank's pod deleted; the job still succeeds.

Each fault lands right after the first durable checkpoint (read from the
checkpointing replica's /metrics every 0.2 s). The replacement must resume
from a checkpoint at or after that one, never from step 0, the restart must
be counted with its reason, and the final accuracy must stay within 2 points
of the same example's fault-free run.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from e2elib import (
    EPOCHS, FAULT_FREE, HOLDER, PodWatch, apply, events_of, example, figure, first_checkpoint, first_step, recovery,
    standby_recovery, succeeded, warning_reasons,
)

pytestmark = pytest.mark.e2e

ACCURACY_POINTS = 0.02


def sigkill(e2e, pod: str) -> None:
    """SIGKILL the pod's trainer process from the host, through the node's containerd (a kill from
    inside the container cannot reach its PID 1)."""
    container = e2e.get("pod", pod)["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    subprocess.run(["ctr", "--address", e2e.containerd, "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", container],
                   check=True, capture_output=True, timeout=30)


def fault_free(e2e, manifest: str) -> float:
    """The example's accuracy without a fault: from test_e2e_examples.py in this session, else run now."""
    if manifest not in FAULT_FREE:
        doc = example(manifest, EPOCHS[manifest])
        doc["metadata"]["name"] = f"ref-{doc['metadata']['name']}"
        apply(e2e, doc)
        FAULT_FREE[manifest] = succeeded(e2e, doc["metadata"]["name"])["progress"]["evalAccuracy"]
    return FAULT_FREE[manifest]


def faulty_run(e2e, manifest: str, name: str, victim: str, fault, standby: bool = False,
               while_running=None) -> dict:
    """Run the example as `name`; at its first checkpoint apply `fault` to the victim's pod; wait for success.

    `standby`: the parameter-server example with a standby worker, which takes the victim's place
    (the replacement whose first step counts); `while_running`, when given, is called after that first
    step and before the job's end (its pods go once it has succeeded).

    Returns what the test checks: the status, the checkpoint step at the fault,
    the replacement's first step (time after the fault, the step it saw), and
    the recovery in parts (helpers/recovery.py), printed among the figures."""
    reference = fault_free(e2e, manifest)
    doc = standby_job(name) if standby else example(manifest, EPOCHS[manifest])
    doc["metadata"]["name"] = name
    holder, _ = HOLDER[manifest]
    apply(e2e, doc)
    checkpoint = first_checkpoint(e2e, f"{name}-{holder}")
    if standby:
        faulted, after, parts = strike_with_standby(e2e, name, victim)
    else:
        faulted, after, parts = strike(e2e, name, victim, fault)
    figure(f"{name}: {parts.describe()}")
    if while_running is not None:
        while_running()
    status = succeeded(e2e, name)
    accuracy = status["progress"]["evalAccuracy"]
    figure(f"{name}: {fault.__name__} {victim} after checkpoint {checkpoint.metrics['kubetrain_last_checkpoint_step']:.0f}"
           f" -> first step of its {'standby' if standby else 'replacement'} {after.at - faulted:.1f} s later (at step "
           f"{after.metrics['kubetrain_training_step']:.0f}); restarts {status['restarts']}, "
           f"accuracy {accuracy:.4f} (fault-free {reference:.4f})")
    assert abs(accuracy - reference) <= ACCURACY_POINTS, (accuracy, reference)
    # Presence and causal order only: durations are figures, never assertions.
    assert not parts.missing and not parts.out_of_order(), (parts.missing, parts.out_of_order(), parts.marks)
    return {"status": status, "checkpoint": int(checkpoint.metrics["kubetrain_last_checkpoint_step"]),
            "replacement": after, "recovery": parts}


def delete_pod(e2e, pod: str) -> None:
    e2e.kubectl("delete", "pod", pod, "--wait=false")


def test_sigkilled_parameter_server_worker_is_replaced_and_resumes_from_the_shards(e2e):
    name = "fault-worker-1"
    run = faulty_run(e2e, "parameter-server.yaml", name, "worker-1", sigkill)

    assert run["status"]["restarts"] >= 1 and "Killed" in warning_reasons(e2e, name), run["status"]
    # A worker keeps no state: its replacement starts from the shards' current step, not from 0.
    assert run["replacement"].metrics["kubetrain_training_step"] >= run["checkpoint"] > 0, run


def standby_job(name: str) -> dict:
    """The parameter-server example with one standby worker (spec.parameterServer.standbyWorkers)."""
    doc = example("parameter-server.yaml", EPOCHS["parameter-server.yaml"])
    doc["metadata"]["name"] = name
    doc["spec"]["parameterServer"]["standbyWorkers"] = 1
    return doc


def strike_with_standby(e2e, name: str, victim: str = "worker-1"):
    """SIGKILL the victim's process and wait for the standby's first step in its place: (monotonic time
    of the fault, the standby's first step on its /metrics, the break-down)."""
    sigkill(e2e, f"{name}-{victim}")
    faulted, faulted_at = time.monotonic(), time.time()
    after = first_step(e2e, f"{name}-standby-0")
    return faulted, after, standby_recovery(e2e, name, victim, "standby-0", faulted_at)


def test_sigkilled_worker_of_a_job_with_a_standby_is_taken_over_by_the_standby(e2e):
    """The standby (torch imported, waiting at ps-0) takes worker-1's place the moment its process dies,
    in real pods; worker-1's pod is replaced as always (counted), and its replacement waits as the next
    standby until the job ends, which it does with the fault-free accuracy."""
    name = "fault-standby"

    def log_of(replica: str) -> str:
        return e2e.kube.run("logs", f"{name}-{replica}", "-c", "trainer", timeout=60, check=False).stdout

    def standing_by() -> None:
        standby_log = log_of("standby-0")
        assert "standby-0: takes worker-1's place" in standby_log, standby_log[-3000:]
        e2e.wait("worker-1's replacement pod waiting as a standby",
                 lambda: "worker-1's place is held by another process" in log_of("worker-1"), timeout=120, every=0.5)

    run = faulty_run(e2e, "parameter-server.yaml", name, "worker-1", sigkill, standby=True, while_running=standing_by)

    assert run["status"]["restarts"] >= 1 and "Killed" in warning_reasons(e2e, name), run["status"]
    assert run["replacement"].metrics["kubetrain_training_step"] >= run["checkpoint"] > 0, run


def test_sigkilled_parameter_server_resumes_from_its_newest_checkpoint(e2e):
    name = "fault-ps-0"
    run = faulty_run(e2e, "parameter-server.yaml", name, "ps-0", sigkill)

    assert run["status"]["restarts"] >= 1 and "Killed" in warning_reasons(e2e, name), run["status"]
    resumes = [e["step"] for e in events_of(e2e, f"{name}-ckpt-ps-0", "ps-0") if e["event"] == "resume"]
    assert resumes and all(s >= run["checkpoint"] > 0 for s in resumes), (resumes, run)


def test_deleted_ddp_rank_pod_is_recreated_counted_and_resumes_from_its_newest_checkpoint(e2e):
    name = "fault-ddp"
    run = faulty_run(e2e, "ddp.yaml", name, "ddp-1", delete_pod)

    assert run["status"]["restarts"] >= 1 and "Deleted" in warning_reasons(e2e, name), run["status"]
    for rank in ("ddp-0", "ddp-1"):
        resumes = [e["step"] for e in events_of(e2e, f"data-{name}-{rank}", rank) if e["event"] == "resume"]
        assert resumes and all(s >= run["checkpoint"] > 0 for s in resumes), (rank, resumes, run)


def strike(e2e, name: str, victim: str, fault):
    """Fault the victim's pod and wait for its replacement's first step, watching the pod so the
    recovery can be broken into parts: (monotonic time of the fault, the first step, the parts)."""
    pod = f"{name}-{victim}"
    old_uid = e2e.get("pod", pod)["metadata"]["uid"]
    watch = PodWatch(e2e, pod)
    try:
        fault(e2e, pod)
        faulted, faulted_at = time.monotonic(), time.time()
        after = first_step(e2e, pod, not_uid=old_uid)
        return faulted, after, recovery(e2e, name, victim, faulted_at, old_uid, watch)
    finally:
        watch.stop()
