"""Fault-tolerant DDP in real pods (examples/ddp-fault-tolerant.yaml: 3 replica groups, a Lighthouse pod
and Service): a group's container SIGKILLed through the node's containerd mid-training. The survivors'
own step times show them committing again within the heartbeat timeout + 1 s, the kubelet restarts the
container and it heals from a live group (a `heal` event, no `resume`: no checkpoint read) and takes part
again; then `kubectl scale` 3 -> 2 -> 3 groups, which never restarts a survivor. The job Succeeds with
the restart counted (ReplicaGroupLost), every group ends with the same final model (the same eval loss
to the last bit), and the accuracy within 2 points of the fault-free run of the same manifest."""

from __future__ import annotations

import json
import time

import pytest
from e2elib import FAULT_FREE, apply, events_of, example, figure, first_checkpoint, job_status, read_files, succeeded, \
    warning_reasons, watch_metrics
from test_e2e_faults import sigkill

pytestmark = pytest.mark.e2e

MANIFEST = "ddp-fault-tolerant.yaml"
# 15 steps an epoch at 3 groups. The kill, the heal and both resizes were over by step 601 of a run alone
# (20.7 s after the apply; 110 steps a second, 150 CPU s of pods for the two runs of 400 epochs): 2,400
# steps leave them four times that, and the pods' CPU falls with the steps.
EPOCHS = 160
GROUPS = ("ddp-0", "ddp-1", "ddp-2")
HEARTBEAT_SECONDS = 1.0  # the example's heartbeatTimeoutSeconds
ACCURACY_POINTS = 0.02


def pods(e2e, name: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in e2e.kube.items("pods", "-l", f"kubetrain.dev/job-name={name}")}


def attempts(events: list[dict]) -> list[list[dict]]:
    out: list[list[dict]] = []
    for e in events:
        if e["event"] == "start":
            out.append([])
        if out:
            out[-1].append(e)
    return out


def fault_free_accuracy(e2e) -> float:
    if MANIFEST not in FAULT_FREE:
        doc = example(MANIFEST, EPOCHS)
        doc["metadata"]["name"] = "ref-ddp-ft"
        apply(e2e, doc)
        FAULT_FREE[MANIFEST] = succeeded(e2e, "ref-ddp-ft", timeout=1200)["progress"]["evalAccuracy"]
    return FAULT_FREE[MANIFEST]


def scale(e2e, name: str, size: int, running: set[str]) -> None:
    e2e.kubectl("scale", "trainingjob", name, "--replicas", str(size))

    def done() -> bool:
        status = job_status(e2e, name)
        assert status.get("state") != "Succeeded", f"{name} finished during its resize to {size}"
        now = pods(e2e, name)
        return status.get("replicas") == size and set(now) == {f"{name}-{r}" for r in running} and all(
            p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp") for p in now.values())

    e2e.wait(f"{name} at {size} groups", done, timeout=240)


def test_a_fault_tolerant_job_survives_a_killed_group_and_scales_live_in_real_pods(e2e):
    reference = fault_free_accuracy(e2e)
    doc = example(MANIFEST, EPOCHS)
    name = doc["metadata"]["name"]
    apply(e2e, doc)
    first_checkpoint(e2e, f"{name}-ddp-0", timeout=600)
    before = pods(e2e, name)
    assert f"{name}-lighthouse-0" in before and e2e.get("service", f"{name}-lighthouse-0")

    victim = f"{name}-ddp-1"
    sigkill(e2e, victim)  # the container's PID 1, the group's torchrun agent, and its ranks with it
    killed_at = time.time()
    watch_metrics(e2e, victim, lambda m: m.get("kubetrain_ft_heals_total", 0) >= 1
                           and m.get("kubetrain_ft_quorum_participants") == 3, "to heal and take part again",
                           timeout=300)
    figure(f"{name}: ddp-1 SIGKILLed; its restarted container healed and took part again "
           f"{time.time() - killed_at:.1f} s later")
    after = pods(e2e, name)
    assert after[victim]["status"]["containerStatuses"][0]["restartCount"] == 1
    for group in ("ddp-0", "ddp-2"):
        pod = f"{name}-{group}"
        assert after[pod]["metadata"]["uid"] == before[pod]["metadata"]["uid"]
        assert after[pod]["status"]["containerStatuses"][0]["restartCount"] == 0
    # The status's quorum is the operator's reading of the chief's metrics, a scrape behind them.
    e2e.wait("the status to show every group in the quorum",
             lambda: (job_status(e2e, name).get("quorum") or {}).get("groups") == 3, timeout=60)

    scale(e2e, name, 2, {"ddp-0", "ddp-1", "lighthouse-0"})
    scale(e2e, name, 3, {*GROUPS, "lighthouse-0"})
    scaled = pods(e2e, name)
    for group, restarts in (("ddp-0", 0), ("ddp-1", 1)):  # scaled around, never restarted again
        pod = f"{name}-{group}"
        assert scaled[pod]["metadata"]["uid"] == after[pod]["metadata"]["uid"]
        assert scaled[pod]["status"]["containerStatuses"][0]["restartCount"] == restarts
    status = succeeded(e2e, name, timeout=1200)

    assert status["restarts"] == 1 and "ReplicaGroupLost" in warning_reasons(e2e, name), status
    events = {g: events_of(e2e, f"data-{name}-{g}", g) for g in GROUPS}
    for survivor in ("ddp-0", "ddp-2"):
        stall = next(e for e in events[survivor] if e["event"] == "quorum" and e["time"] > killed_at - 1
                     and e.get("previous") == 3 and e["participants"] == 2)
        gap = stall["time"] - stall["last_commit_time"]
        figure(f"{name}: {survivor} stood {gap:.2f} s from its last commit before the kill to its first after")
        assert gap <= HEARTBEAT_SECONDS + 1.0, stall
    first, replacement = attempts(events["ddp-1"])[:2]
    kinds = [e["event"] for e in replacement]
    assert "heal" in kinds and "resume" not in kinds, kinds
    assert any(e["event"] == "quorum" and e["participants"] == 3 for e in replacement)
    # Scaled down (SIGTERM: a checkpoint, `stop`), then up: the new ddp-2 healed. (A StatefulSet restarts a
    # container that ended 0 too: a finished group may have one more attempt at the end.)
    tries = attempts(events["ddp-2"])
    left = next(i for i, attempt in enumerate(tries) if attempt[-1]["event"] == "stop")
    assert "heal" in [e["event"] for e in tries[left + 1]], tries[left + 1]

    finals = {g: json.loads(read_files(e2e, f"data-{name}-{g}", [f"run/results/{g}.json"])[f"run/results/{g}.json"])
              for g in GROUPS}
    assert len({(r["steps"], r["eval_loss"]) for r in finals.values()}) == 1, finals  # one final model
    accuracy = status["progress"]["evalAccuracy"]
    figure(f"{name}: accuracy {accuracy:.4f} (fault-free {reference:.4f}), restarts {status['restarts']}")
    assert abs(accuracy - reference) <= ACCURACY_POINTS, (accuracy, reference)
