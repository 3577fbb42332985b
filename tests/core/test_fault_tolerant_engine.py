"""Fault-tolerant DDP (spec.ddp.faultTolerance) in the pure core: the spec, the plan, the cluster's children
and the engine, one round at a time. Each DDP node is a replica group of its own (its own torchrun group
and store), a Lighthouse pod with its Service forms the quorum, a lost group is replaced alone
(ReplicaGroupLost) while the others train on, `kubectl scale` adds or removes groups live, and the status
shows the quorum. The same rules on both drivers: tests/core/test_drivers_agree.py."""

import pytest

from kubetrain.shared.timestamps import iso
from kubetrain.api import from_object
from kubetrain.shared.launch import FT_GROUP_VAR, FT_GROUPS_VAR, FT_LIGHTHOUSE_VAR, FT_STORE_VAR, LIGHTHOUSE
from kubetrain.api.load import InvalidSpec
from kubetrain.api.spec import FT_PORT
from kubetrain.engine.children import LIGHTHOUSE_RESOURCES, ClusterEndpoints, children
from kubetrain.engine import engine
from kubetrain.engine.plan import plan_replicas, replica_names
from kubetrain.engine.engine import ProgressReading
from kubetrain.engine.reconcile import reconcile
from kubetrain.api.status import to_dict

from core.test_reconcile import T0, Pod, created_pods

GROUPS = ("ddp-0", "ddp-1", "ddp-2")
EXISTING = {("ConfigMap", "j-config"), ("Secret", "j-token"), ("StatefulSet", "j-ddp"), ("Service", "j-ddp"),
            ("Service", "j-lighthouse-0")}


def ft_job(ft=None, **ddp):
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": "j", "generation": 1},
                        "spec": {"mode": "DDP", "ddp": {"nodes": 3, "faultTolerance": ft or {}, **ddp}}})


def active(**memory):
    return {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0, "size": 3, **memory}}


def up(*names):
    """The job's replicas running, each its first incarnation (a pod uid)."""
    return {n: Pod(n, "Running", uid=f"{n}-1") for n in names}


# --- the spec -------------------------------------------------------------------------------


def test_an_empty_block_turns_it_on_with_the_defaults():
    spec = ft_job().spec
    ft = spec.ddp.fault_tolerance
    assert spec.fault_tolerant and (ft.min_replicas, ft.heartbeat_timeout_seconds) == (1, 1.0)
    assert not from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j"},
                            "spec": {"mode": "DDP"}}).spec.fault_tolerant


@pytest.mark.parametrize("ddp, path, words", [
    ({"faultTolerance": {"minReplicas": 4}}, "spec.ddp.faultTolerance.minReplicas", "at most ddp.nodes (3)"),
    ({"minNodes": 2, "maxNodes": 3, "faultTolerance": {"minReplicas": 3}}, "spec.ddp.faultTolerance.minReplicas",
     "at most ddp.minNodes (2)"),
    ({"commHook": "PowerSGD", "faultTolerance": {}}, "spec.ddp.commHook", "use None, got PowerSGD"),
    ({"faultTolerance": {"heartbeatTimeoutSeconds": 0.1}}, "spec.ddp.faultTolerance.heartbeatTimeoutSeconds",
     "at least 0.2"),
    ({"faultTolerance": {"heartbeatTimeoutSeconds": 61}}, "spec.ddp.faultTolerance.heartbeatTimeoutSeconds",
     "at most 60"),
    ({"faultTolerance": {"quorumTimeoutSeconds": 0}}, "spec.ddp.faultTolerance.quorumTimeoutSeconds", "at least 1"),
    ({"faultTolerance": {"timeoutSeconds": 3601}}, "spec.ddp.faultTolerance.timeoutSeconds", "at most 3600"),
    ({"faultTolerance": {"joinTimeoutSeconds": -1}}, "spec.ddp.faultTolerance.joinTimeoutSeconds", "at least 0"),
    ({"faultTolerance": {"minReplica": 1}}, "spec.ddp.faultTolerance.minReplica", "did you mean 'minReplicas'"),
])
def test_what_cannot_work_names_its_field(ddp, path, words):
    with pytest.raises(InvalidSpec) as err:
        from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j"},
                     "spec": {"mode": "DDP", "ddp": {"nodes": 3, **ddp}}})
    text = str(err.value)
    assert path in text and words in text, text


# --- the plan -------------------------------------------------------------------------------


def test_every_node_is_a_torchrun_group_of_its_own_and_a_lighthouse_serves_the_job():
    job = ft_job()
    assert replica_names(job)[-1] == ("lighthouse", 0)
    replicas = {r.name: r for r in plan_replicas(job, ClusterEndpoints(job))}
    node = replicas["ddp-1"]
    argv = list(node.command)
    assert argv[argv.index("--nnodes") + 1] == "1" and argv[argv.index("--max-restarts") + 1] == "0"
    assert argv[argv.index("--rdzv-conf") + 1] == "is_host=true"
    assert argv[argv.index("--rdzv-id") + 1] == "default-j-ddp-1"  # never the rendezvous of another group
    assert node.env[FT_LIGHTHOUSE_VAR] == f"http://j-lighthouse-0:{FT_PORT}"
    assert (node.env[FT_GROUP_VAR], node.env[FT_GROUPS_VAR]) == ("1", "3")
    assert node.env[FT_STORE_VAR] == "$(KUBETRAIN_POD_IP):29400"
    lighthouse = replicas[LIGHTHOUSE]
    assert lighthouse.command[-1] == "lighthouse" and lighthouse.ports["lighthouse"] == FT_PORT


def test_the_data_is_dealt_by_the_most_groups_an_elastic_job_can_have():
    job = ft_job(nodes=2, minNodes=1, maxNodes=4)
    node = next(r for r in plan_replicas(job, ClusterEndpoints(job)) if r.name == "ddp-0")
    assert node.env[FT_GROUPS_VAR] == "4"


def test_a_script_job_runs_the_users_command_in_its_groups_beside_kubetrains_own_lighthouse():
    job = from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j"},
                       "spec": {"mode": "DDP", "script": {"command": ["python", "train.py"]},
                                "ddp": {"nodes": 2, "faultTolerance": {}}}})
    roles = {r.name: r.command[-1] for r in plan_replicas(job, ClusterEndpoints(job))}
    assert roles == {"ddp-0": "script", "ddp-1": "script", LIGHTHOUSE: "lighthouse"}


# --- the cluster's children -----------------------------------------------------------------


def test_the_lighthouse_is_a_pod_and_a_service_beside_the_statefulset():
    objs = {(o["kind"], o["metadata"]["name"]): o for o in children(ft_job(), "uid", "tok")}
    service = objs[("Service", "j-lighthouse-0")]
    assert service["spec"]["selector"] == {"kubetrain.dev/job-name": "j", "kubetrain.dev/replica": LIGHTHOUSE}
    assert "clusterIP" not in service["spec"]  # a stable virtual address whichever pod backs it
    pod = objs[("Pod", "j-lighthouse-0")]
    container = pod["spec"]["containers"][0]
    assert container["command"][-1] == "lighthouse" and container["resources"] == LIGHTHOUSE_RESOURCES
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid"
    sts = objs[("StatefulSet", "j-ddp")]
    env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    names = [e["name"] for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]]
    # The pod's IP and ordinal come first: the variables below them are rendered from them.
    assert names.index("KUBETRAIN_POD_IP") < names.index(FT_STORE_VAR)
    assert env["KUBETRAIN_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env[FT_GROUP_VAR]["value"] == "$(KUBETRAIN_NODE_RANK)"
    assert "is_host=true" in sts["spec"]["template"]["spec"]["containers"][0]["command"]


def test_the_lighthouse_has_small_fixed_requests_and_limits_whatever_the_job_asks():
    """None of the trainers' resources (GPUs above all), from spec.resources or the template alike, and its own small
    requests and limits: without them a quota that requires limits refused its pod, and the job waited for ever."""
    trainers = {"limits": {"nvidia.com/gpu": 1, "cpu": "8", "memory": "64Gi"}}
    for spec in ({"resources": {"worker": trainers}},
                 {"podTemplate": {"spec": {"containers": [{"name": "trainer", "resources": trainers}]}}}, {}):
        job = from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j"},
                           "spec": {"mode": "DDP", "ddp": {"faultTolerance": {}}, **spec}})
        pod = next(o for o in children(job, "uid", "tok") if o["kind"] == "Pod")
        assert pod["spec"]["containers"][0]["resources"] == LIGHTHOUSE_RESOURCES
    assert set(LIGHTHOUSE_RESOURCES["requests"]) == set(LIGHTHOUSE_RESOURCES["limits"]) == {"cpu", "memory"}


def test_the_lighthouse_is_counted_in_its_kueue_pod_set():
    from kubetrain.engine import kueue
    from kubetrain.engine.children import Settings

    job = ft_job()
    job.metadata.labels = {kueue.QUEUE_LABEL: "team"}
    sets = {p["name"]: p for p in kueue.workload(job, "uid", Settings())["spec"]["podSets"]}
    assert sets["lighthouse"]["count"] == 1
    assert sets["lighthouse"]["template"]["spec"]["containers"][0]["resources"] == LIGHTHOUSE_RESOURCES


# --- the engine -----------------------------------------------------------------------------


def test_a_new_job_creates_its_lighthouse_with_the_statefulset():
    act = reconcile(ft_job(), "u", "tok", {}, {}, T0)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in act.create}
    assert {("Pod", "j-lighthouse-0"), ("Service", "j-lighthouse-0"), ("StatefulSet", "j-ddp")} <= kinds


def test_a_lost_group_is_replaced_alone_and_the_job_trains_on():
    """Its container killed: the kubelet restarts it in place (the StatefulSet's policy). One restart is
    counted, with a reason that says the others trained on; no other pod is touched, nothing is held."""
    pods = up(*GROUPS, LIGHTHOUSE)
    status = active(checkpointAtLastRestart=0)
    status["lastCheckpoint"] = {"step": 100}
    pods["ddp-1"] = Pod("ddp-1", "Running", uid="ddp-1-1", restart_count=1, last_exit_code=137)
    act = reconcile(ft_job(), "u", "tok", pods, status, T0 + 5, ProgressReading(step=120, checkpoint_step=100),
                    existing=EXISTING)
    assert to_dict(act.status)["restarts"] == 1 and act.events[0][:2] == ("Warning", "ReplicaGroupLost")
    assert "the other replica groups train on" in act.events[0][2]
    assert act.delete_pods == [] and act.scale_statefulset is None and created_pods(act) == []
    assert to_dict(act.status)["state"] != "Failed"


def test_a_group_that_keeps_failing_without_progress_backs_off_but_one_lost_while_the_job_progresses_does_not():
    pods = up(*GROUPS, LIGHTHOUSE)
    pods["ddp-2"] = Pod("ddp-2", "Failed", exit_code=137, uid="ddp-2-1")
    status = active()
    status["restarts"] = 3  # earlier groups lost, each time after a new checkpoint
    status["lastCheckpoint"] = {"step": 400}
    status["memory"]["checkpointAtLastRestart"] = 300
    act = reconcile(ft_job(), "u", "tok", pods, status, T0, existing=EXISTING)
    assert to_dict(act.status)["memory"]["pendingRestarts"]["ddp-2"] == pytest.approx(T0)  # at once
    pods["ddp-2"] = Pod("ddp-2", "Failed", exit_code=1, uid="ddp-2-2")
    act = reconcile(ft_job(), "u", "tok", pods, {**to_dict(act.status), "memory": {**to_dict(act.status)["memory"],
                                                                            "pendingRestarts": {}}},
                    T0 + 1, existing=EXISTING)
    assert to_dict(act.status)["memory"]["pendingRestarts"]["ddp-2"] == pytest.approx(T0 + 2)  # no new checkpoint: 1 s


def test_a_lost_lighthouse_is_replaced_and_the_groups_are_left_alone():
    pods = up(*GROUPS)
    pods[LIGHTHOUSE] = Pod(LIGHTHOUSE, "Failed", exit_code=137, uid="lh-1")
    act = reconcile(ft_job(), "u", "tok", pods, active(), T0 + 1, existing=EXISTING)
    assert act.events[0][1] == "LighthouseLost" and act.delete_pods == ["j-lighthouse-0"]
    del pods[LIGHTHOUSE]
    act = reconcile(ft_job(), "u", "tok", pods, act.status, T0 + 2, existing=EXISTING)
    assert created_pods(act) == ["j-lighthouse-0"]


def test_the_job_succeeds_when_its_groups_did_and_its_lighthouse_is_stopped_whatever_clean_pod_policy_says():
    job = from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j"},
                       "spec": {"mode": "DDP", "ddp": {"nodes": 3, "faultTolerance": {}},
                                "runPolicy": {"cleanPodPolicy": "None"}}})
    pods = {n: Pod(n, "Running", exit_code=0, uid=f"{n}-1") for n in GROUPS}  # exited 0, restarted in place
    pods[LIGHTHOUSE] = Pod(LIGHTHOUSE, "Running", uid="lh-1")
    act = reconcile(job, "u", "tok", pods, active(), T0 + 1, existing=EXISTING)
    assert to_dict(act.status)["state"] == "Succeeded" and act.delete_pods == ["j-lighthouse-0"]


def test_a_group_still_running_when_another_finished_is_stopped_and_the_job_succeeds():
    """The groups commit their steps together: one finished means the job's training is over; a replacement
    that was still starting then has nothing left to train."""
    # The chief's group (ddp-0) is not there (it was being replaced): another group's results speak.
    pods = {"ddp-1": Pod("ddp-1", "Succeeded", exit_code=0, uid="b", final={"steps": 300, "eval_accuracy": 0.97}),
            "ddp-2": Pod("ddp-2", "Running", uid="c"), LIGHTHOUSE: Pod(LIGHTHOUSE, "Running", uid="d")}
    act = reconcile(ft_job(), "u", "tok", pods, active(), T0, existing=EXISTING)
    assert to_dict(act.status)["state"] == "Succeeded"
    assert to_dict(act.status)["progress"]["step"] == 300 and to_dict(act.status)["progress"]["evalAccuracy"] == 0.97
    assert "ddp-2 was stopped with nothing left to train" in next(e[2] for e in act.events if e[1] == "Completed")
    assert act.scale_statefulset == 0 and act.delete_pods == ["j-lighthouse-0"]


def test_the_status_shows_the_quorum_read_from_a_group():
    act = reconcile(ft_job(), "u", "tok", up(*GROUPS, LIGHTHOUSE), active(), T0 + 1, ProgressReading(step=50, quorum=2),
                    existing=EXISTING)
    assert to_dict(act.status)["quorum"]["participants"] == 2 and to_dict(act.status)["quorum"]["groups"] == 3
    again = reconcile(ft_job(), "u", "tok", up(*GROUPS, LIGHTHOUSE), act.status, T0 + 2, ProgressReading(step=60, quorum=2),
                      existing=EXISTING)
    assert to_dict(again.status)["quorum"] == to_dict(act.status)["quorum"]  # unchanged: not written again


def test_scaling_down_and_up_adds_and_removes_groups_without_touching_the_others():
    pods = up(*GROUPS, LIGHTHOUSE)
    smaller = ft_job(nodes=3, minNodes=2, maxNodes=3)
    smaller.spec.replicas = 2
    smaller.spec.complete()
    act = reconcile(smaller, "u", "tok", pods, active(), T0 + 1, existing=EXISTING)
    assert act.events[0][1] == "Resized" and "ddp-2 leaves" in act.events[0][2]
    assert act.delete_pods == ["j-ddp-2"] and act.scale_statefulset is None
    sts = next(o for o in act.replace if o["kind"] == "StatefulSet")
    assert sts["spec"]["replicas"] == 2 and to_dict(act.status)["restarts"] == 0 and to_dict(act.status)["state"] == "Running"
    del pods["ddp-2"]
    bigger = ft_job(nodes=3, minNodes=2, maxNodes=3)
    act = reconcile(bigger, "u", "tok", pods, act.status, T0 + 2, existing=EXISTING)
    assert "ddp-2 joins" in act.events[0][2] and act.delete_pods == []
    assert next(o for o in act.replace if o["kind"] == "StatefulSet")["spec"]["replicas"] == 3
    assert to_dict(act.status)["restarts"] == 0 and to_dict(act.status)["memory"]["identities"] == {
        n: f"{n}-1" for n in ("ddp-0", "ddp-1", LIGHTHOUSE)}  # the same incarnations: none restarted
    # The StatefulSet makes ddp-2 again: a new member of the job, not a replacement of the one that left.
    pods["ddp-2"] = Pod("ddp-2", "Running", uid="ddp-2-2")
    act = reconcile(bigger, "u", "tok", pods, act.status, T0 + 3, existing=EXISTING)
    assert to_dict(act.status)["restarts"] == 0 and act.events == [] and to_dict(act.status)["state"] == "Running"


def test_under_kueue_a_resize_stops_every_group_until_the_new_size_is_admitted():
    """Kueue's pod counts are fixed once a Workload is admitted: a queued fault-tolerant job resizes as a
    plain DDP job does (docs/scheduling.md#gangs-and-queues), never live."""
    job = ft_job(nodes=3, minNodes=2, maxNodes=3)
    job.spec.replicas = 2
    job.spec.complete()
    done = engine.step(job, active(), up(*GROUPS, LIGHTHOUSE), T0 + 1,
                       admission=engine.QueueAdmission(False, "Resizing", "made again at the new size"))
    assert sorted(done.actions.stop) == sorted([*GROUPS, LIGHTHOUSE]) and done.actions.hold
    assert done.status.state == "Suspended" and not done.actions.resized
