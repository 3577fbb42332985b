"""Fault-tolerant DDP in real pods (examples/ddp-fault-tolerant.yaml: 3 replica groups, a Lighthouse pod
and Service): a group's container SIGKILLed through the node's containerd mid-training. The survivors'
own step times show them committing again within the heartbeat timeout + 1 s, the kubelet restarts the
container and it heals from a live group (a `heal` event, no `resume`: no checkpoint read) and takes part
again; then `kubectl scale` 3 -> 2 -> 3 groups, which never restarts a survivor. The job Succeeds with
the restart counted (ReplicaGroupLost), every group ends with the same final model (the same eval loss
to the last bit), and the accuracy within half a point of the fault-free run of the same manifest (the data
follows the quorum: what a missing group would have trained, the others train).

A spare group (`spareGroups: 1` beside 2 nodes): it trains nothing while both groups are there; a group's
container SIGKILLed, the spare trains from the survivors' next commit on (within the heartbeat timeout + 1 s,
from the groups' own step times), the killed container restarts, heals, trains again, and the spare stands
by again.

An HSDP job (`examples/ddp-hsdp.yaml`: 2 groups of 2 ranks, FSDP2 within each group): a group's container
SIGKILLed, the other's pod never restarts, the restarted ranks heal each from the rank of the same place, and
the groups end with the same weights."""

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
ACCURACY_POINTS = 0.005


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


def first_loss(events: list[dict], killed_at: float, group: str) -> dict:
    """The group's first commit after the kill under a quorum smaller than at its commit before: its `quorum`
    event holds that commit's time (`last_commit_time`) and this one's (`time`)."""
    found = next((e for e in events if e["event"] == "quorum" and e["time"] > killed_at
                  and e["participants"] < (e.get("previous") or 0)), None)
    assert found is not None, (f"{group}: no commit under a smaller quorum after the kill at {killed_at:.2f}",
                               [e for e in events if e["event"] in ("quorum", "start", "heal", "stop")])
    return found


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


def kill_until_healed(e2e, victim: str, participants: int) -> float:
    """SIGKILL the pod's container (its PID 1, the group's torchrun agent, and its ranks with it); returns when
    its restarted container healed and takes part again in a quorum of `participants` groups. Returns the time
    just before the kill: `ctr` may return seconds after the signal on a loaded machine, and a survivor's
    recommit about a heartbeat after the kill must not fall before the time returned."""
    killed_at = time.time()
    sigkill(e2e, victim)
    watch_metrics(e2e, victim, lambda m: m.get("kubetrain_ft_heals_total", 0) >= 1
                           and m.get("kubetrain_ft_quorum_participants") == participants, "to heal and take part again",
                           timeout=300)
    return killed_at


def test_a_fault_tolerant_job_survives_a_killed_group_and_scales_live_in_real_pods(e2e):
    reference = fault_free_accuracy(e2e)
    doc = example(MANIFEST, EPOCHS)
    name = doc["metadata"]["name"]
    apply(e2e, doc)
    first_checkpoint(e2e, f"{name}-ddp-0", timeout=600)
    before = pods(e2e, name)
    assert f"{name}-lighthouse-0" in before and e2e.get("service", f"{name}-lighthouse-0")

    victim = f"{name}-ddp-1"
    killed_at = kill_until_healed(e2e, victim, 3)
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
        stall = first_loss(events[survivor], killed_at, survivor)
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
    left = next((i for i, attempt in enumerate(tries) if attempt[-1]["event"] == "stop"), None)
    assert left is not None and left + 1 < len(tries), [[e["event"] for e in t if e["event"] != "train"] for t in tries]
    assert "heal" in [e["event"] for e in tries[left + 1]], tries[left + 1]

    finals = {g: json.loads(read_files(e2e, f"data-{name}-{g}", [f"run/results/{g}.json"])[f"run/results/{g}.json"])
              for g in GROUPS}
    assert len({(r["steps"], r["eval_loss"]) for r in finals.values()}) == 1, finals  # one final model
    accuracy = status["progress"]["evalAccuracy"]
    figure(f"{name}: accuracy {accuracy:.4f} (fault-free {reference:.4f}), restarts {status['restarts']}")
    assert abs(accuracy - reference) <= ACCURACY_POINTS, (accuracy, reference)


def test_a_spare_group_trains_at_once_when_a_group_dies_in_real_pods(e2e):
    doc = example(MANIFEST, EPOCHS)
    doc["metadata"]["name"] = name = "ddp-ft-spare"
    ddp = doc["spec"]["ddp"]
    ddp.update(nodes=2)
    ddp.pop("minNodes"), ddp.pop("maxNodes")
    # Every group in the first quorum, however late its pod starts: else a spare may train until the last joins.
    ddp["faultTolerance"].update(spareGroups=1, joinTimeoutSeconds=120)
    apply(e2e, doc)
    first_checkpoint(e2e, f"{name}-ddp-0", timeout=600)
    assert set(pods(e2e, name)) == {f"{name}-{r}" for r in (*GROUPS, "lighthouse-0")}  # the spare is a pod
    killed_at = kill_until_healed(e2e, f"{name}-ddp-1", 3)
    status = succeeded(e2e, name, timeout=1200)
    assert status["restarts"] == 1 and status["quorum"]["groups"] == 3, status

    events = {g: events_of(e2e, f"data-{name}-{g}", g) for g in GROUPS}
    for group in ("ddp-0", "ddp-2"):  # the survivor and the spare: 2 groups train again at their next commit
        back = first_loss(events[group], killed_at, group)
        gap = back["time"] - back["last_commit_time"]
        figure(f"{name}: {group} from its last commit before the kill to its first at full width: {gap:.2f} s")
        assert gap <= HEARTBEAT_SECONDS + 1.0, back
    spare = [e for e in events["ddp-2"] if e["event"] == "train"]
    assert all(e["lane"] == -1 for e in spare if e["time"] < killed_at), "the spare trained before the kill"
    replacement = attempts(events["ddp-1"])[1]
    kinds = [e["event"] for e in replacement]
    assert "heal" in kinds and "resume" not in kinds, kinds
    returned = next((e["time"] for e in replacement if e["event"] == "train" and e["lane"] >= 0), None)
    assert returned is not None, ("the replacement never trained a lane", kinds)
    assert any(e["lane"] >= 0 for e in spare if killed_at < e["time"] < returned), "the spare never trained"
    assert all(e["lane"] == -1 for e in spare if e["time"] > returned + 1), "the spare did not stand by again"
    finals = {g: json.loads(read_files(e2e, f"data-{name}-{g}", [f"run/results/{g}.json"])[f"run/results/{g}.json"])
              for g in GROUPS}
    assert len({(r["steps"], r["eval_loss"]) for r in finals.values()}) == 1, finals  # one final model
    figure(f"{name}: accuracy {status['progress']['evalAccuracy']:.4f} after the kill, spare included")


def test_an_hsdp_job_survives_a_killed_group_in_real_pods(e2e):
    """examples/ddp-hsdp.yaml without its spare: 2 replica groups of 2 ranks, the model sharded with FSDP2 within
    each group. Group 1's container SIGKILLed: group 0's pod is never restarted, the restarted container's ranks
    heal each from the rank of the same place in group 0 (no checkpoint read), and the groups end with the same
    weights (the sum of their squares over each group's shards, to the last bit)."""
    doc = example("ddp-hsdp.yaml", EPOCHS)
    doc["metadata"]["name"] = name = "ddp-hsdp"
    doc["spec"]["ddp"]["faultTolerance"]["spareGroups"] = 0
    apply(e2e, doc)
    first_checkpoint(e2e, f"{name}-ddp-0", timeout=600)
    before = pods(e2e, name)
    killed_at = kill_until_healed(e2e, f"{name}-ddp-1", 2)
    # Read before the end: a StatefulSet restarts a container that ended 0 too (a finished group may have one
    # more attempt at the end, with nothing left to train).
    after = pods(e2e, name)
    assert after[f"{name}-ddp-0"]["metadata"]["uid"] == before[f"{name}-ddp-0"]["metadata"]["uid"]
    assert after[f"{name}-ddp-0"]["status"]["containerStatuses"][0]["restartCount"] == 0
    status = succeeded(e2e, name, timeout=1200)
    assert status["restarts"] == 1, status
    ranks = {"ddp-0": "ddp-0", "ddp-1": "ddp-0", "ddp-2": "ddp-1", "ddp-3": "ddp-1"}  # rank: its group's pod
    events = {r: events_of(e2e, f"data-{name}-{pod}", r) for r, pod in ranks.items()}
    back = first_loss(events["ddp-0"], killed_at, "ddp-0")
    figure(f"{name}: group 0 from its last commit before the kill to its first without group 1: "
           f"{back['time'] - back['last_commit_time']:.2f} s")
    assert back["time"] - back["last_commit_time"] <= HEARTBEAT_SECONDS + 1.0, back
    for rank, source in (("ddp-2", "ddp-0"), ("ddp-3", "ddp-1")):
        replacement = attempts(events[rank])[1]
        kinds = [e["event"] for e in replacement]
        assert "heal" in kinds and "resume" not in kinds, (rank, kinds)
        assert next(e for e in replacement if e["event"] == "heal")["source"] == source
    digests = {}
    for pod in ("ddp-0", "ddp-1"):
        mine = [r for r, p in ranks.items() if p == pod]
        files = read_files(e2e, f"data-{name}-{pod}", [f"run/results/{r}.json" for r in mine])
        digests.update({r: json.loads(files[f"run/results/{r}.json"])["weights_digest"] for r in mine})
    figure(f"{name}: weights digests {digests}, accuracy {status['progress']['evalAccuracy']:.4f}")
    assert len(set(digests.values())) == 1, digests
