"""Elastic jobs in the pure core: spec.replicas (what `kubectl scale` writes) against the size the
replicas run at, one round at a time. A ParameterServer job resizes live: the job file rendered again,
its shards annotated (the kubelet remounts the file), new workers started, the workers above the size
left to leave by themselves and deleted once they ended, never counted. A DDP job stops every replica
after a checkpoint, then renders what carries the size again (the job file, the StatefulSet) and
starts the new set."""

import pytest

from kubetrain.shared.timestamps import iso
from kubetrain.engine.engine import MAX_REQUEUE_SECONDS
import yaml

from kubetrain.api import from_object
from kubetrain.shared.exitcodes import EXIT_RELEASED
from kubetrain.api.load import InvalidSpec
from kubetrain.engine.engine import RELEASE_GRACE_SECONDS
from kubetrain.engine.reconcile import reconcile
from kubetrain.api.status import to_dict

from core.test_reconcile import PS_PODS, T0, Pod, created_pods, job, running

ACTIVE_AT_2 = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0, "size": 2}}
EXISTING = {("ConfigMap", "j-config"), ("Secret", "j-token"), ("Service", "j-ps-0"),
            ("PersistentVolumeClaim", "j-ps-0-data"), ("StatefulSet", "j-ddp"), ("Service", "j-ddp"),
            ("NetworkPolicy", "j-isolation")}


def condition(status, ctype):
    return next(c for c in to_dict(status)["conditions"] if c["type"] == ctype)


def job_file(obj):
    return yaml.safe_load(obj["data"]["job.yaml"])


# --- the spec -------------------------------------------------------------------------------


def test_replicas_is_the_workers_and_the_nodes_every_reader_sees():
    ps = job(replicas=3)
    assert ps.spec.parameter_server.workers == 3 and ps.spec.size == 3 and ps.spec.pod_count == 4
    ddp = job("DDP", replicas=1, ddp={"nodes": 2, "minNodes": 1, "maxNodes": 3})
    assert ddp.spec.ddp.nodes == 1 and ddp.spec.size == 1 and ddp.spec.world_size == 1
    assert job().spec.size == 2 and job("Single").spec.size == 1


@pytest.mark.parametrize("spec, path, words", [
    ({"mode": "Single", "replicas": 2}, "spec.replicas", "a Single job has one replica, got 2"),
    ({"mode": "DDP", "replicas": 3}, "spec.replicas", "between ddp.minNodes (2) and ddp.maxNodes (2) nodes, got 3"),
    ({"mode": "DDP", "replicas": 4, "ddp": {"minNodes": 1, "maxNodes": 3}}, "spec.replicas", "got 4"),
    ({"mode": "DDP", "ddp": {"nodes": 4, "maxNodes": 3}}, "spec.ddp.nodes", "between ddp.minNodes (4) and ddp.maxNodes (3)"),
    ({"mode": "DDP", "ddp": {"nodes": 2, "minNodes": 3, "maxNodes": 2}}, "spec.ddp.minNodes", "at most ddp.maxNodes (2)"),
    ({"mode": "ParameterServer", "replicas": 0}, "spec.replicas", "must be at least 1, got 0"),
    ({"mode": "ParameterServer", "replicas": 1025}, "spec.replicas", "must be at most 1024, got 1025"),
])
def test_a_size_out_of_range_names_the_field(spec, path, words):
    with pytest.raises(InvalidSpec) as err:
        from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j"},
                     "spec": spec})
    text = str(err.value)
    assert path in text and words in text, text


# --- a ParameterServer job: 2 -> 3 -> 1 workers, live -------------------------------------

ACTIVE_AT_3 = {**ACTIVE_AT_2, "memory": {**ACTIVE_AT_2["memory"], "size": 3}}
AT_3 = ("ps-0", "worker-0", "worker-1", "worker-2")
SIZE_3 = {"kubetrain.dev/size": "3"}


def test_a_scale_up_is_live_the_job_file_rendered_again_the_shards_annotated_and_the_new_worker_started():
    j = job(replicas=3)
    act = reconcile(j, "u", "t", running(*PS_PODS), ACTIVE_AT_2, T0 + 10, existing=EXISTING)
    assert act.delete_pods == [] and act.scale_statefulset is None  # nothing stops
    assert created_pods(act) == ["j-worker-2"]
    assert [o["kind"] for o in act.replace] == ["ConfigMap"]
    assert job_file(act.replace[0])["spec"]["parameterServer"]["workers"] == 3
    assert act.annotate_pods == {"j-ps-0": SIZE_3}  # the kubelet remounts the job file ps-0 reads
    assert act.events == [("Normal", "Resized", "Resized from 2 to 3 workers, live: worker-2 joins; ps-0 deals the "
                                                "rest of the epoch again among the 3; nothing restarts.")]
    assert to_dict(act.status)["state"] == "Running" and not any(c["type"] == "Restarting" for c in to_dict(act.status)["conditions"])
    assert to_dict(act.status)["replicas"] == 3 and to_dict(act.status)["restarts"] == 0 and to_dict(act.status)["workers"] == 3
    assert to_dict(act.status)["memory"]["size"] == 3 and to_dict(act.status)["memory"]["resizeTime"] == T0 + 10
    # The next round sees worker-2 Pending (the operator's expectation of the pod it created): no restart,
    # nothing rendered again, nobody annotated again.
    pods = {**running(*PS_PODS), "worker-2": Pod("worker-2", "Pending")}
    steady = reconcile(j, "u", "t", pods, act.status, T0 + 11, existing=EXISTING)
    assert steady.replace == [] and steady.annotate_pods == {} and steady.delete_pods == [] and created_pods(steady) == []
    assert steady.events == [] and to_dict(steady.status)["restarts"] == 0 and to_dict(steady.status)["state"] == "Running"
    assert to_dict(steady.status)["replicaStatuses"]["worker"] == {"active": 3, "succeeded": 0, "failed": 0}


def test_a_scale_down_is_live_the_workers_above_the_size_are_left_to_leave_by_themselves():
    j = job(replicas=1)
    act = reconcile(j, "u", "t", running(*AT_3), ACTIVE_AT_3, T0 + 10, existing=EXISTING)
    assert act.delete_pods == [] and created_pods(act) == []  # ps-0 releases them after their step
    assert job_file(act.replace[0])["spec"]["parameterServer"]["workers"] == 1
    assert act.annotate_pods == {"j-ps-0": {"kubetrain.dev/size": "1"}}
    assert act.events == [("Normal", "Resized", "Resized from 3 to 1 workers, live: worker-1 and worker-2 leave "
                                                "after their step; ps-0 deals the rest of the epoch again among the "
                                                "1; nothing restarts.")]
    # Counted at the job's size only: the departing ones are no part of it.
    assert to_dict(act.status)["replicas"] == 1 and to_dict(act.status)["state"] == "Running"
    assert to_dict(act.status)["replicaStatuses"]["worker"] == {"active": 1, "succeeded": 0, "failed": 0}
    # The leaving workers' exits bring rounds of their own (pod events); the safety net is the period.
    assert act.requeue_after is not None and act.requeue_after <= MAX_REQUEUE_SECONDS


@pytest.mark.parametrize("phase, code", [("Failed", EXIT_RELEASED), ("Succeeded", 0), ("Failed", 1), ("Failed", 137),
                                         ("Pending", None)], ids=["released", "exited-0", "exited-1", "killed", "never-ran"])
def test_a_departing_worker_that_ended_or_never_ran_is_deleted_and_never_counted(phase, code):
    at_1 = reconcile(job(replicas=1), "u", "t", running(*AT_3), ACTIVE_AT_3, T0 + 10, existing=EXISTING).status
    pods = {**running("ps-0", "worker-0", "worker-2"), "worker-1": Pod("worker-1", phase, exit_code=code)}
    # restartPolicy Never: a failure of the job's own replica would end it at once.
    j = job(replicas=1, restartPolicy={"policy": "Never"})
    act = reconcile(j, "u", "t", pods, at_1, T0 + 12, existing=EXISTING)
    assert act.delete_pods == ["j-worker-1"]  # worker-2 still runs: left alone
    assert to_dict(act.status)["state"] == "Running" and to_dict(act.status)["restarts"] == 0 and act.events == []
    assert to_dict(act.status)["replicaStatuses"]["worker"] == {"active": 1, "succeeded": 0, "failed": 0}
    assert created_pods(act) == [] and act.restarted == []


def test_a_worker_released_and_wanted_again_rejoins_without_a_restart():
    """3 -> 1 -> 3 within a step: ps-0 released worker-1 at the first resize (it exited EXIT_RELEASED after
    the second was asked), and waits for it at the second. Its pod is deleted and made again, as a restart
    is, but nothing is counted; worker-2, still running (never released), is left alone."""
    at_1 = reconcile(job(replicas=1), "u", "t", running(*AT_3), ACTIVE_AT_3, T0 + 10, existing=EXISTING).status
    at_3 = reconcile(job(replicas=3), "u", "t", running(*AT_3), at_1, T0 + 11, existing=EXISTING)
    assert at_3.delete_pods == [] and created_pods(at_3) == [] and to_dict(at_3.status)["replicas"] == 3
    released = {**running("ps-0", "worker-0", "worker-2"), "worker-1": Pod("worker-1", "Failed", exit_code=EXIT_RELEASED)}
    act = reconcile(job(replicas=3), "u", "t", released, at_3.status, T0 + 12, existing=EXISTING)
    assert act.delete_pods == ["j-worker-1"] and created_pods(act) == []  # started once its pod is gone
    assert act.events == [("Normal", "Rejoining", "worker-1 was released by ps-0 at a resize and the job has 3 "
                                                  "workers again: it starts again and joins; no restart is counted.")]
    assert to_dict(act.status)["restarts"] == 0 and act.restarted == [] and to_dict(act.status)["state"] == "Running"
    assert to_dict(act.status)["replicaStatuses"]["worker"] == {"active": 2, "succeeded": 0, "failed": 0}
    # Being deleted: waited for, once, with no second event.
    going = {**released, "worker-1": Pod("worker-1", "Failed", exit_code=EXIT_RELEASED, terminating=True)}
    wait = reconcile(job(replicas=3), "u", "t", going, act.status, T0 + 13, existing=EXISTING)
    assert wait.delete_pods == [] and created_pods(wait) == [] and wait.events == []
    gone = reconcile(job(replicas=3), "u", "t", running("ps-0", "worker-0", "worker-2"), wait.status, T0 + 14,
                     existing=EXISTING)
    assert created_pods(gone) == ["j-worker-1"] and gone.events == [] and to_dict(gone.status)["restarts"] == 0
    assert to_dict(gone.status)["memory"].get("pendingRestarts", {}) == {}
    steady = reconcile(job(replicas=3), "u", "t", running(*AT_3), gone.status, T0 + 15, existing=EXISTING)
    assert steady.events == [] and created_pods(steady) == [] and to_dict(steady.status)["restarts"] == 0


def test_a_departing_worker_still_running_after_the_grace_is_deleted_with_a_warning():
    at_1 = reconcile(job(replicas=1), "u", "t", running(*AT_3), ACTIVE_AT_3, T0 + 10, existing=EXISTING).status
    before = reconcile(job(replicas=1), "u", "t", running(*AT_3), at_1, T0 + 10 + RELEASE_GRACE_SECONDS - 1,
                       existing=EXISTING)
    assert before.delete_pods == [] and before.requeue_after == pytest.approx(1.0)
    after = reconcile(job(replicas=1), "u", "t", running(*AT_3), at_1, T0 + 10 + RELEASE_GRACE_SECONDS,
                      existing=EXISTING)
    assert sorted(after.delete_pods) == ["j-worker-1", "j-worker-2"]
    assert [e[:2] for e in after.events] == [("Warning", "ReleaseTimeout")] * 2
    assert "worker-1 is above the job's size (1 workers) and still ran 120 s after the resize" in after.events[0][2]
    assert to_dict(after.status)["restarts"] == 0 and to_dict(after.status)["state"] == "Running"
    # Being deleted (its grace period): left to go.
    going = {**running("ps-0", "worker-0"), "worker-1": Pod("worker-1", "Running", terminating=True)}
    assert reconcile(job(replicas=1), "u", "t", going, after.status, T0 + 200, existing=EXISTING).delete_pods == []


def test_the_job_succeeds_on_its_own_replicas_while_a_departing_worker_still_runs():
    at_1 = reconcile(job(replicas=1), "u", "t", running(*AT_3), ACTIVE_AT_3, T0 + 10, existing=EXISTING).status
    pods = {"ps-0": Pod("ps-0", "Succeeded", exit_code=0), "worker-0": Pod("worker-0", "Succeeded", exit_code=0),
            "worker-1": Pod("worker-1", "Running")}
    act = reconcile(job(replicas=1), "u", "t", pods, at_1, T0 + 20, existing=EXISTING)
    assert to_dict(act.status)["state"] == "Succeeded"
    assert act.delete_pods == ["j-worker-1"]  # cleanPodPolicy Running: what still runs is stopped
    assert to_dict(act.status)["replicaStatuses"]["worker"] == {"active": 0, "succeeded": 1, "failed": 0}


def test_a_departing_worker_finished_is_not_the_job_finishing():
    """The chief is worker-0, and only the workers of the job's size count in the parameter servers' drain."""
    at_1 = reconcile(job(replicas=1), "u", "t", running(*AT_3), ACTIVE_AT_3, T0 + 10, existing=EXISTING).status
    pods = {**running("ps-0", "worker-0"), "worker-1": Pod("worker-1", "Succeeded", exit_code=0),
            "worker-2": Pod("worker-2", "Succeeded", exit_code=0)}
    act = reconcile(job(replicas=1), "u", "t", pods, at_1, T0 + 20, existing=EXISTING)
    assert to_dict(act.status)["state"] == "Running" and to_dict(act.status)["memory"].get("workersDoneTime") is None


def test_a_restart_due_for_a_worker_above_the_new_size_is_dropped():
    pending = {**ACTIVE_AT_3, "state": "Restarting",
               "memory": {**ACTIVE_AT_3["memory"], "pendingRestarts": {"worker-2": T0 + 30, "worker-0": T0 + 30}}}
    act = reconcile(job(replicas=2), "u", "t", running("ps-0", "worker-1"), pending, T0 + 10, existing=EXISTING)
    assert to_dict(act.status)["memory"]["pendingRestarts"] == {"worker-0": T0 + 30}
    assert created_pods(act) == [] and to_dict(act.status)["restarts"] == 0


def test_a_scale_down_before_a_new_worker_ran_deletes_its_pod():
    """2 -> 3 -> 2 within a moment: worker-2's pod, still Pending, is deleted; nothing else moves."""
    up = reconcile(job(replicas=3), "u", "t", running(*PS_PODS), ACTIVE_AT_2, T0 + 10, existing=EXISTING)
    pods = {**running(*PS_PODS), "worker-2": Pod("worker-2", "Pending")}
    down = reconcile(job(replicas=2), "u", "t", pods, up.status, T0 + 11, existing=EXISTING)
    assert down.delete_pods == ["j-worker-2"] and created_pods(down) == []
    assert job_file(down.replace[0])["spec"]["parameterServer"]["workers"] == 2
    assert to_dict(down.status)["restarts"] == 0 and to_dict(down.status)["replicas"] == 2


def test_a_scale_down_starts_only_the_smaller_set():
    j = job(replicas=1)
    act = reconcile(j, "u", "t", {}, ACTIVE_AT_2, T0 + 10, existing=EXISTING)
    assert sorted(created_pods(act)) == ["j-ps-0", "j-worker-0"]
    assert job_file(act.replace[0])["spec"]["parameterServer"]["workers"] == 1
    assert to_dict(act.status)["replicas"] == 1 and act.annotate_pods == {}


def test_a_resize_asked_while_suspended_takes_effect_when_the_job_resumes():
    j = job(replicas=3, runPolicy={"suspend": True})
    held = reconcile(j, "u", "t", {}, {**ACTIVE_AT_2, "state": "Suspended"}, T0 + 10, existing=EXISTING)
    assert held.replace == [] and created_pods(held) == []
    resumed = reconcile(job(replicas=3), "u", "t", {}, held.status, T0 + 20, existing=EXISTING)
    assert len(created_pods(resumed)) == 4 and [o["kind"] for o in resumed.replace] == ["ConfigMap"]
    # Not "live": every replica starts from the checkpoint (it said "worker-2 joins ...; nothing restarts").
    assert [e for e in resumed.events if e[1] == "Resized"] == [(
        "Normal", "Resized", "Resized from 2 to 3 workers while stopped: the job resumes at the new size from its "
        "newest checkpoint.")]
    assert to_dict(resumed.status)["restarts"] == 0


def test_suspending_stops_the_departing_workers_too():
    at_1 = reconcile(job(replicas=1), "u", "t", running(*AT_3), ACTIVE_AT_3, T0 + 10, existing=EXISTING).status
    act = reconcile(job(replicas=1, runPolicy={"suspend": True}), "u", "t", running(*AT_3), at_1, T0 + 11,
                    existing=EXISTING)
    assert sorted(act.delete_pods) == ["j-ps-0", "j-worker-0", "j-worker-1", "j-worker-2"]


def test_a_job_from_before_sizes_were_remembered_runs_at_its_spec_size():
    old = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    act = reconcile(job(), "u", "t", running(*PS_PODS), old, T0 + 10, existing=EXISTING)
    assert act.delete_pods == [] and to_dict(act.status)["memory"]["size"] == 2 and to_dict(act.status)["replicas"] == 2


# --- a DDP job: 2 -> 1 -> 2 nodes ---------------------------------------------------------


def ddp(replicas):
    return job("DDP", replicas=replicas, ddp={"nodes": 2, "minNodes": 1, "maxNodes": 2})


def test_a_ddp_resize_scales_the_group_to_zero_then_renders_its_statefulset_at_the_new_size():
    act = reconcile(ddp(1), "u", "t", running("ddp-0", "ddp-1"), ACTIVE_AT_2, T0 + 10, existing=EXISTING)
    assert act.scale_statefulset == 0 and act.replace == []
    assert condition(act.status, "Restarting")["reason"] == "Resizing"
    assert act.events[0][2].startswith("Resizing from 2 to 1 nodes")
    done = reconcile(ddp(1), "u", "t", {}, act.status, T0 + 12, existing=EXISTING)
    kinds = {o["kind"]: o for o in done.replace}
    assert sorted(kinds) == ["ConfigMap", "StatefulSet"]
    sts = kinds["StatefulSet"]
    assert sts["spec"]["replicas"] == 1
    command = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--nnodes") + 1] == "1"
    assert job_file(kinds["ConfigMap"])["spec"]["ddp"]["nodes"] == 1
    assert to_dict(done.status)["replicas"] == 1
    assert to_dict(done.status)["selector"] == "kubetrain.dev/job-name=j,kubetrain.dev/role=ddp"
    # And back to 2.
    at_1 = reconcile(ddp(1), "u", "t", running("ddp-0"), done.status, T0 + 13, existing=EXISTING)
    grow = reconcile(ddp(2), "u", "t", running("ddp-0"), at_1.status, T0 + 20, existing=EXISTING)
    assert grow.scale_statefulset == 0
    grown = reconcile(ddp(2), "u", "t", {}, grow.status, T0 + 22, existing=EXISTING)
    sts = next(o for o in grown.replace if o["kind"] == "StatefulSet")
    assert sts["spec"]["replicas"] == 2 and to_dict(grown.status)["replicas"] == 2


def test_a_ddp_rank_that_failed_before_the_resize_is_stopped_too_and_no_restart_is_counted():
    """Else its pod stays, and the round that finds no replica left, the one that starts the new set,
    never comes; a restart that was due is not wanted any more."""
    pods = {**running("ddp-0"), "ddp-1": Pod("ddp-1", "Failed", exit_code=137)}
    status = {**ACTIVE_AT_2, "memory": {**ACTIVE_AT_2["memory"], "pendingRestarts": {"ddp-1": T0 + 30}}}
    act = reconcile(ddp(1), "u", "t", pods, status, T0 + 10, existing=EXISTING)
    assert act.scale_statefulset == 0 and to_dict(act.status)["restarts"] == 0
    assert to_dict(act.status)["memory"].get("pendingRestarts", {}) == {}
    assert condition(act.status, "Restarting")["reason"] == "Resizing"


def test_a_resize_finished_by_an_operator_that_never_saw_the_children_renders_them_again():
    """A restarted operator (or a new leader) knows of no child (`existing` empty) until a round made
    them: a create would meet the old ones and leave them at the old size."""
    stopping = reconcile(ddp(1), "u", "t", running("ddp-0", "ddp-1"), ACTIVE_AT_2, T0 + 10, existing=set())
    done = reconcile(ddp(1), "u", "t", {}, stopping.status, T0 + 12, existing=set())
    assert sorted(o["kind"] for o in done.replace) == ["ConfigMap", "StatefulSet"]
    assert not [o for o in done.create if o["kind"] in ("ConfigMap", "StatefulSet")]


# --- the gang: the PodGroup follows a resize ------------------------------------------------


def test_the_podgroup_is_rendered_again_at_the_new_size_in_both_modes():
    from core.test_gang import BOTH

    gang = {"runPolicy": {"schedulingPolicy": {}}}
    existing = EXISTING | {("PodGroup", "j")}
    act = reconcile(job(replicas=3, **gang), "u", "t", running(*PS_PODS), ACTIVE_AT_2, T0 + 10, settings=BOTH,
                    existing=existing)
    group = next(o for o in act.replace if o["kind"] == "PodGroup")
    assert group["spec"]["minMember"] == 4  # ps-0 and three workers
    assert "PodGroup" not in [o["kind"] for o in act.create]
    elastic = {"nodes": 2, "minNodes": 1, "maxNodes": 2}
    stopping = reconcile(job("DDP", replicas=1, ddp=elastic, **gang), "u", "t", running("ddp-0", "ddp-1"), ACTIVE_AT_2, T0 + 10, settings=BOTH, existing=existing)
    assert stopping.replace == []  # rendered when the group starts again, not while it stops
    done = reconcile(job("DDP", replicas=1, ddp=elastic, **gang), "u", "t", {},
                     stopping.status, T0 + 12, settings=BOTH, existing=existing)
    assert next(o for o in done.replace if o["kind"] == "PodGroup")["spec"]["minMember"] == 1
    # A minAvailable the user set stays.
    fixed = {"runPolicy": {"schedulingPolicy": {"minAvailable": 2}}}
    act = reconcile(job(replicas=3, **fixed), "u", "t", running(*PS_PODS), ACTIVE_AT_2, T0 + 10, settings=BOTH,
                    existing=existing)
    assert next(o for o in act.replace if o["kind"] == "PodGroup")["spec"]["minMember"] == 2


def test_76_from_a_replica_other_than_a_worker_is_a_failure():
    """Only a parameter-server worker is released at a resize: a user's script exiting 76 has failed."""
    single = job("Single", script={"command": ["python", "train.py"]}, restartPolicy={"policy": "Never"})
    status = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    act = reconcile(single, "u", "t", {"single-0": Pod("single-0", "Failed", exit_code=EXIT_RELEASED)}, status, T0 + 5)
    assert to_dict(act.status)["state"] == "Failed" and "exited with code 76" in condition(act.status, "Failed")["message"]
