"""The two drivers of the job engine agree: the same scripted story, told to the local backend as
processes and to the operator as pods (the API's JSON), gets the same decisions round by round.

The local side is `LocalRunner.decide` over its process table (`Proc`: phase, exit code as
`Popen.returncode` gives it, attempt), the cluster side `observe.pod_observation` over pod JSON
and `reconcile` (pods to create and delete). What is compared per round: replicas started
(processes started / pods created), replicas stopped (processes stopped / pods deleted), the
Events' reasons, the state and the restart count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kubetrain.shared.timestamps import iso
from kubetrain.api import from_object
from kubetrain.api.status import JobStatus, to_dict
from kubetrain.engine import engine
from kubetrain.drivers.cluster.observe import pod_observation
from kubetrain.engine.plan import Replica
from kubetrain.engine.engine import ProgressReading
from kubetrain.engine.reconcile import reconcile
from kubetrain.drivers.local.runner import LocalRunner, Proc
from kubetrain.drivers.local.rundir import RunDir

T0 = 1_800_000_000.0


@dataclass
class Beat:
    """What exists at one moment: replica -> Running | Failed:<code> | Succeeded | Absent."""

    t: float
    replicas: dict[str, str]
    step: int | None = None
    suspend: bool = False
    expect: dict = field(default_factory=dict)  # what both drivers must decide, checked as well


def job(mode: str, suspend: bool = False, **spec):
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": "j", "generation": 1},
                        "spec": {"mode": mode, "runPolicy": {"progressDeadlineSeconds": 30, "suspend": suspend},
                                 "metrics": {"port": 0}, **spec}})


def pod_json(replica: str, what: str, attempt: int) -> dict:
    state, phase = {"running": {}}, "Running"
    if what.startswith("Failed:"):
        state, phase = {"terminated": {"exitCode": int(what.split(":")[1])}}, "Failed"
    elif what == "Succeeded":
        state, phase = {"terminated": {"exitCode": 0}}, "Succeeded"
    return {"metadata": {"name": f"j-{replica}", "uid": f"{replica}-{attempt}",
                         "labels": {"kubetrain.dev/replica": replica}},
            "spec": {}, "status": {"phase": phase, "containerStatuses": [{"name": "trainer", "state": state}]}}


def set_proc(proc: Proc, what: str) -> None:
    if what == "Absent":
        proc.phase, proc.exit_code = "Absent", None
    elif what == "Running":
        proc.phase, proc.exit_code = "Running", None
    elif what == "Succeeded":
        proc.phase, proc.exit_code = "Succeeded", 0
    else:
        code = int(what.split(":")[1])
        # Popen's returncode for a signal is minus its number: 137 is -9.
        proc.phase, proc.exit_code = "Failed", (128 - code if code > 128 else code)


class Cluster:
    def __init__(self) -> None:
        self.status = JobStatus()
        self.existing: set[tuple[str, str]] = set()
        self.attempts: dict[str, int] = {}

    def round(self, j, beat: Beat, names: list[str], refusal: engine.Refusal | None = None) -> dict:
        pods = {}
        for n in names:
            what = beat.replicas.get(n, "Absent")
            if what != "Absent":
                seen = pod_observation(pod_json(n, what, self.attempts.get(n, 0)))
                pods[seen.replica] = seen
        progress = ProgressReading(step=beat.step) if beat.step is not None else None
        act = reconcile(j, "uid", "tok", pods, self.status, T0 + beat.t, progress, existing=self.existing,
                        refusal=refusal)
        self.existing |= {(o["kind"], o["metadata"]["name"]) for o in act.create if o["kind"] != "Pod"}
        started = sorted(o["metadata"]["name"][2:] for o in act.create if o["kind"] == "Pod")
        for n in started:
            self.attempts[n] = self.attempts.get(n, 0) + 1
        self.status = act.status
        return {"start": started, "stop": sorted(p[2:] for p in act.delete_pods),
                "events": [e[1] for e in act.events], "state": act.status.state,
                "restarts": act.status.restarts}


class Local:
    def __init__(self, j, tmp_path) -> None:
        self.backend = LocalRunner(j, RunDir(tmp_path / "run"), echo_logs=False)
        self.attempts: dict[str, int] = {}

    def round(self, j, beat: Beat, names: list[str], refusal: engine.Refusal | None = None) -> dict:
        backend = self.backend
        backend.job = j
        for n in names:
            proc = backend.procs.setdefault(n, Proc(Replica(n.rsplit("-", 1)[0], int(n.rsplit("-", 1)[1]), ("true",), {}, {})))
            proc.attempts = self.attempts.get(n, 0)
            set_proc(proc, beat.replicas.get(n, "Absent"))
        if beat.step is not None:
            backend.progress.step = beat.step
        done = backend.decide(T0 + beat.t, refusal)
        backend.status = done.status
        for n in done.actions.start:
            self.attempts[n] = self.attempts.get(n, 0) + 1
        return {"start": sorted(done.actions.start), "stop": sorted(done.actions.stop),
                "events": [e[1] for e in done.actions.events], "state": done.status.state,
                "restarts": done.status.restarts}


R, A = "Running", "Absent"
PS = ["ps-0", "worker-0", "worker-1"]

PS_STORY = [
    Beat(0, {}, expect={"start": PS, "state": "Created"}),
    Beat(1, {"ps-0": R, "worker-0": R, "worker-1": R}, step=5, expect={"state": "Running"}),
    Beat(2, {"ps-0": R, "worker-0": R, "worker-1": "Failed:137"}, step=6,
         expect={"stop": ["worker-1"], "events": ["Killed"], "state": "Restarting", "restarts": 1}),
    Beat(2.5, {"ps-0": R, "worker-0": R}, step=7, expect={"start": ["worker-1"]}),
    Beat(3, {"ps-0": R, "worker-0": R, "worker-1": R}, step=10, expect={"state": "Running"}),
    Beat(4, {"ps-0": R, "worker-0": R, "worker-1": "Failed:1"}, step=11,
         expect={"stop": ["worker-1"], "events": ["Error"], "restarts": 2}),
    Beat(4.5, {"ps-0": R, "worker-0": R}, step=11, expect={"start": []}),  # its backoff: 1 s
    Beat(5.1, {"ps-0": R, "worker-0": R}, step=11, expect={"start": ["worker-1"]}),
    Beat(6, {"ps-0": R, "worker-0": R, "worker-1": R}, step=11),
    Beat(36.5, {"ps-0": R, "worker-0": R, "worker-1": R}, step=11,
         expect={"stop": ["worker-0"], "events": ["Hung"], "restarts": 3}),  # no step for 30 s: the chief
    Beat(37, {"ps-0": R, "worker-1": R}, step=11, expect={"start": []}),  # backoff 2 s
    Beat(38.6, {"ps-0": R, "worker-1": R}, step=11, expect={"start": ["worker-0"]}),
    Beat(40, {"ps-0": R, "worker-0": R, "worker-1": R}, step=20),
    Beat(41, {"ps-0": R, "worker-0": R, "worker-1": R}, step=21, suspend=True,
         expect={"stop": PS, "events": ["Suspended"], "state": "Suspended"}),
    Beat(50, {}, suspend=True, expect={"start": [], "state": "Suspended"}),
    Beat(60, {}, step=21, expect={"start": PS, "events": ["Resumed"]}),
    Beat(61, {"ps-0": R, "worker-0": "Succeeded", "worker-1": "Succeeded"}, step=30, expect={"state": "Running"}),
    Beat(122, {"ps-0": R, "worker-0": "Succeeded", "worker-1": "Succeeded"}, step=30,
         expect={"stop": ["ps-0"], "events": ["Completed"], "state": "Succeeded"}),  # drained 60 s
]

SINGLE_STORY = [
    Beat(0, {}, expect={"start": ["single-0"]}),
    Beat(1, {"single-0": "Failed:2"}, expect={"events": ["InvalidConfiguration"], "state": "Failed", "stop": []}),
]


@pytest.mark.parametrize("mode, story", [("ParameterServer", PS_STORY), ("Single", SINGLE_STORY)], ids=["ps", "single"])
def test_the_operator_and_the_local_backend_decide_alike(tmp_path, mode, story):
    cluster, local = Cluster(), None
    for beat in story:
        j = job(mode, suspend=beat.suspend)
        names = [n for n in (PS if mode == "ParameterServer" else ["single-0"])]
        local = local or Local(j, tmp_path)
        by_cluster = cluster.round(j, beat, names)
        by_local = local.round(j, beat, names)
        assert by_cluster == by_local, f"t={beat.t}: the drivers disagree"
        for key, want in beat.expect.items():
            assert by_cluster[key] == want, f"t={beat.t}: {key} {by_cluster[key]} != {want}"


def test_a_failed_pod_and_a_failed_process_are_the_same_failure():
    """The exit code as each driver sees it: 137 in a pod, -9 from Popen; both 'killed by SIGKILL'."""
    seen_pod = pod_observation(pod_json("worker-0", "Failed:137", 1))
    proc = Proc(Replica("worker", 0, ("true",), {}, {}))
    set_proc(proc, "Failed:137")
    seen_proc = proc.observation()
    assert (seen_pod.phase, seen_pod.exit_code) == (seen_proc.phase, seen_proc.exit_code) == ("Failed", 137)


# --- fault-tolerant DDP: a lost replica group is replaced alone ------------------------------------------
#
# In a cluster a group is a StatefulSet's pod: its killed container is restarted in place by the kubelet
# (seen as restartCount + 1, lastState 137) and the operator creates or deletes only the Lighthouse's pod;
# on this machine the group's process is seen failed and the backend starts it again. The story compares
# what both decide: the Events, the state, the restarts, and the Lighthouse's stops and starts.

FT = ["ddp-0", "ddp-1", "ddp-2", "lighthouse-0"]


def ft_pod_json(replica: str, what: str, restarts: int) -> dict:
    """A group's pod (the StatefulSet's: no replica label, its ordinal) or the Lighthouse's pod.
    `Restarted:N`: the container was killed with code N and runs again (restartPolicy Always)."""
    if replica.startswith("lighthouse-"):
        return pod_json(replica, what, restarts)
    status: dict = {"phase": "Running", "containerStatuses": [{"name": "trainer", "state": {"running": {}},
                                                               "restartCount": restarts}]}
    if what.startswith("Restarted:"):
        status["containerStatuses"][0]["lastState"] = {"terminated": {"exitCode": int(what.split(":")[1])}}
    elif what == "Succeeded":
        status["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 0}}
    return {"metadata": {"name": f"j-{replica}", "uid": f"{replica}-pod",
                         "labels": {"apps.kubernetes.io/pod-index": replica.split("-")[1]}},
            "spec": {"restartPolicy": "Always"}, "status": status}


FT_STORY = [
    Beat(0, {}, expect={"state": "Created"}),
    Beat(1, {n: R for n in FT}, step=100, expect={"state": "Running"}),
    Beat(2, {**{n: R for n in FT}, "ddp-1": "Restarted:137"}, step=120,
         expect={"events": ["ReplicaGroupLost"], "state": "Restarting", "restarts": 1}),
    Beat(3, {n: R for n in FT}, step=150, expect={"state": "Running", "restarts": 1}),
    Beat(4, {**{n: R for n in FT}, "lighthouse-0": "Failed:137"}, step=160,
         expect={"events": ["LighthouseLost"], "stop": ["lighthouse-0"], "restarts": 2}),
    # No checkpoint since the last restart: the second one waits its backoff (2 s).
    Beat(4.5, {n: R for n in FT if n != "lighthouse-0"}, step=160, expect={"start": []}),
    Beat(6.1, {n: R for n in FT if n != "lighthouse-0"}, step=170, expect={"start": ["lighthouse-0"]}),
    Beat(7, {n: R for n in FT}, step=200, expect={"state": "Running"}),
    Beat(8, {**{n: "Succeeded" for n in FT[:3]}, "lighthouse-0": R}, step=300,
         expect={"events": ["Completed"], "state": "Succeeded", "stop": ["lighthouse-0"]}),
]


def test_the_drivers_replace_a_lost_replica_group_alone_alike(tmp_path):
    j = job("DDP", ddp={"nodes": 3, "faultTolerance": {}})
    status = JobStatus()
    existing: set = set()
    restarts = {n: 0 for n in FT}
    local = Local(j, tmp_path)
    for beat in FT_STORY:
        # The cluster: groups restart in place; only the Lighthouse's pod is the operator's to make.
        pods = {}
        for n in FT:
            what = beat.replicas.get(n, "Absent")
            if what.startswith("Restarted:"):
                restarts[n] += 1
            if what != "Absent":
                seen = pod_observation(ft_pod_json(n, what, restarts[n]))
                pods[seen.replica] = seen
        act = reconcile(j, "uid", "tok", pods, status, T0 + beat.t,
                        ProgressReading(step=beat.step) if beat.step is not None else None, existing=existing)
        existing |= {(o["kind"], o["metadata"]["name"]) for o in act.create if o["kind"] != "Pod"}
        status = act.status
        by_cluster = {"events": [e[1] for e in act.events], "state": act.status.state,
                      "restarts": act.status.restarts,
                      "start": sorted(o["metadata"]["name"][2:] for o in act.create if o["kind"] == "Pod"),
                      "stop": sorted(p[2:] for p in act.delete_pods)}
        # This machine: a killed group's process is seen failed, and started again by the backend.
        seen_locally = {n: ("Failed:137" if w.startswith("Restarted:") else w) for n, w in beat.replicas.items()}
        mine = local.round(j, Beat(beat.t, seen_locally, step=beat.step), FT)
        by_local = {**{k: mine[k] for k in ("events", "state", "restarts")},
                    "start": [n for n in mine["start"] if not n.startswith("ddp-")],
                    "stop": [n for n in mine["stop"] if not n.startswith("ddp-")]}
        if beat.t == 0:  # a new job: the cluster starts its groups as one StatefulSet
            by_local["start"] = [n for n in by_local["start"] if n == "lighthouse-0"]
        assert by_cluster == by_local, f"t={beat.t}: the drivers disagree"
        for key, want in beat.expect.items():
            assert by_cluster[key] == want, f"t={beat.t}: {key} {by_cluster[key]} != {want}"
        if "ReplicaGroupLost" in by_cluster["events"]:
            # Locally the lost group alone stops and starts again; no other replica is touched.
            assert mine["stop"] == ["ddp-1"], mine


# --- refusals: the operator's refusals are inputs of the engine, decided alike by both drivers ----------
#
# The controller refuses a job whose pods its pod-security allowances forbid (PodSecurity) or whose gang
# no scheduler serves (GangSchedulingDisabled); the engine decides what that does to the status, in both
# drivers: Failed with the reason, completionTime, the active-time clock paused, the replicas stopped.

REFUSALS = [engine.Refusal("PodSecurity", "podTemplate: privileged containers are not allowed."),
            engine.Refusal("GangSchedulingDisabled", "spec.runPolicy.schedulingPolicy: no gang scheduler is served.")]


@pytest.mark.parametrize("refusal", REFUSALS, ids=[r.reason for r in REFUSALS])
@pytest.mark.parametrize("when", [0, 2], ids=["new", "running"])
def test_a_refused_job_fails_alike_in_both_drivers(tmp_path, refusal, when):
    j = job("ParameterServer")
    cluster, local = Cluster(), Local(j, tmp_path)
    story = [Beat(0, {}), Beat(1, {n: R for n in PS}, step=5)][:when]
    for beat in story:
        assert cluster.round(j, beat, PS) == local.round(j, beat, PS)
    refused = Beat(when, {n: R for n in PS} if when else {}, step=6 if when else None)
    by_cluster, by_local = cluster.round(j, refused, PS, refusal), local.round(j, refused, PS, refusal)
    assert by_cluster == by_local
    assert by_cluster["state"] == "Failed" and by_cluster["events"] == [refusal.reason]
    assert by_cluster["stop"] == (PS if when else []) and by_cluster["start"] == []
    # Where each driver runs the replicas is its own: the pods' label selector, and the trainer (an image in a
    # cluster, the installed kubetrain's processes locally: status.trainer).
    own = ("selector", "trainer")
    cluster_status = {k: v for k, v in to_dict(cluster.status).items() if k not in own}
    assert cluster_status == {k: v for k, v in to_dict(local.backend.status).items() if k not in own}
    failed = next(c for c in cluster_status["conditions"] if c["type"] == "Failed")
    assert (failed["status"], failed["reason"], failed["message"]) == ("True", refusal.reason, refusal.message)
    assert cluster_status["completionTime"] == iso(T0 + when)
    memory = cluster_status["memory"]
    assert "activeSince" not in memory and memory["activeSeconds"] == when  # the clock is paused
    # Failed for good: a later round changes nothing, refused or not.
    later = Beat(when + 5, {})
    assert cluster.round(j, later, PS)["state"] == local.round(j, later, PS, refusal)["state"] == "Failed"
    assert to_dict(cluster.status)["completionTime"] == to_dict(local.backend.status)["completionTime"] == iso(T0 + when)
