"""One reconciliation: observation in, actions and status out (table-driven where it fits)."""

import pytest

from kubetrain.shared.timestamps import iso
from kubetrain.api import from_object
from kubetrain.engine.reconcile import PodObservation as Pod
from kubetrain.engine.engine import ProgressReading, Refusal, refuse
from kubetrain.engine.reconcile import reconcile
from kubetrain.api.status import read_status, to_dict

T0 = 1_800_000_000.0


def job(mode="ParameterServer", **spec):
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": "j", "generation": 3}, "spec": {"mode": mode, **spec}})


def running(*names):
    return {n: Pod(n, "Running") for n in names}


PS_PODS = ("ps-0", "worker-0", "worker-1")


def created_pods(act):
    return [o["metadata"]["name"] for o in act.create if o["kind"] == "Pod"]


def test_new_job_creates_every_child_and_reports_created():
    act = reconcile(job(), "u", "tok", {}, {}, T0)
    kinds = [o["kind"] for o in act.create]
    assert kinds.count("Pod") == 3 and "ConfigMap" in kinds and "Secret" in kinds
    assert to_dict(act.status)["state"] == "Created"
    assert to_dict(act.status)["startTime"] == iso(T0)
    assert to_dict(act.status)["observedGeneration"] == 3
    assert to_dict(act.status)["workers"] == 2


def test_existing_children_are_not_created_again():
    existing = {("ConfigMap", "j-config"), ("Secret", "j-token"), ("Service", "j-ps-0"), ("PersistentVolumeClaim", "j-ckpt-ps-0")}
    act = reconcile(job(), "u", "tok", running(*PS_PODS), {"state": "Running", "startTime": iso(T0)}, T0 + 1, existing=existing)
    assert act.create == []
    assert to_dict(act.status)["state"] == "Running"
    assert to_dict(act.status)["replicaStatuses"]["worker"] == {"active": 2, "succeeded": 0, "failed": 0}


def test_failed_worker_is_deleted_then_recreated_after_backoff():
    pods = running(*PS_PODS)
    pods["worker-1"] = Pod("worker-1", "Failed", exit_code=137)
    status = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    act = reconcile(job(), "u", "tok", pods, status, T0 + 5)
    assert act.delete_pods == ["j-worker-1"]
    assert to_dict(act.status)["restarts"] == 1
    assert to_dict(act.status)["state"] == "Restarting"
    assert act.events[0][:2] == ("Warning", "Killed")
    assert "worker-1" in to_dict(act.status)["memory"]["pendingRestarts"]
    # Next round: the pod is gone; the first restart is at once.
    del pods["worker-1"]
    act2 = reconcile(job(), "u", "tok", pods, act.status, T0 + 5.5, existing=set())
    assert "j-worker-1" in created_pods(act2)
    assert to_dict(act2.status)["memory"]["pendingRestarts"] == {}
    assert to_dict(act2.status)["restarts"] == 1
    # A second failure waits its backoff (1 s) before the pod comes back.
    pods["worker-1"] = Pod("worker-1", "Failed", exit_code=1)
    act3 = reconcile(job(), "u", "tok", pods, act2.status, T0 + 10)
    assert act3.delete_pods == ["j-worker-1"] and act3.requeue_after == pytest.approx(1.0)
    del pods["worker-1"]
    act4 = reconcile(job(), "u", "tok", pods, act3.status, T0 + 10.5, existing=set())
    assert "j-worker-1" not in created_pods(act4)
    act5 = reconcile(job(), "u", "tok", pods, act4.status, T0 + 11.1, existing=set())
    assert "j-worker-1" in created_pods(act5)


def test_deleted_pod_counts_as_a_restart():
    pods = running("ps-0", "worker-0")
    act = reconcile(job(), "u", "tok", pods, {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}, T0 + 1)
    assert to_dict(act.status)["restarts"] == 1
    assert act.events[0][1] == "Deleted"


@pytest.mark.parametrize("policy, code, state", [("Never", 137, "Failed"), ("ExitCode", 1, "Failed"), ("ExitCode", 75, "Restarting"), ("OnFailure", 3, "Failed")])
def test_restart_policies(policy, code, state):
    pods = running(*PS_PODS)
    pods["worker-0"] = Pod("worker-0", "Failed", exit_code=code)
    act = reconcile(job(restartPolicy={"policy": policy}), "u", "t", pods, {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}, T0 + 1)
    assert to_dict(act.status)["state"] == state
    if state == "Failed":
        assert to_dict(act.status)["completionTime"] == iso(T0 + 1)
        assert set(act.delete_pods) == {"j-ps-0", "j-worker-1"}  # cleanPodPolicy Running


def test_eviction_is_a_restart_with_its_reason():
    pods = running(*PS_PODS)
    pods["ps-0"] = Pod("ps-0", "Failed", reason="Evicted")
    act = reconcile(job(), "u", "t", pods, {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}, T0 + 1)
    assert act.events[0][1] == "Evicted"
    assert to_dict(act.status)["conditions"][-1]["reason"] == "Evicted"


def test_backoff_limit_fails_the_job():
    pods = running(*PS_PODS)
    pods["worker-0"] = Pod("worker-0", "Failed", exit_code=1)
    status = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}, "restarts": 6}
    act = reconcile(job(), "u", "t", pods, status, T0 + 1)
    assert to_dict(act.status)["state"] == "Failed"
    assert [c for c in to_dict(act.status)["conditions"] if c["type"] == "Failed"][0]["reason"] == "BackoffLimitExceeded"


def test_restarts_without_progress_fail_the_job():
    pods = running(*PS_PODS)
    pods["worker-0"] = Pod("worker-0", "Failed", exit_code=1)
    status = {"state": "Running", "startTime": iso(T0), "restarts": 3,
              "restartsWithoutProgress": 3, "lastCheckpoint": {"step": 50, "time": iso(T0)},
              "memory": {"activeSince": T0, "checkpointAtLastRestart": 50}}
    act = reconcile(job(), "u", "t", pods, status, T0 + 1)
    assert to_dict(act.status)["state"] == "Failed"
    assert act.events[-1][1] == "NoProgress"


def test_progress_is_recorded_and_a_stall_is_a_hang():
    j = job(runPolicy={"progressDeadlineSeconds": 60})
    status = {"state": "Running", "startTime": iso(T0)}
    act = reconcile(j, "u", "t", running(*PS_PODS), status, T0 + 10,
                    ProgressReading(step=40, total_steps=200, loss=0.5, checkpoint_step=25, checkpoint_time=T0 + 8))
    assert to_dict(act.status)["progress"]["step"] == 40
    assert to_dict(act.status)["lastCheckpoint"] == {"step": 25, "time": iso(T0 + 8)}
    act2 = reconcile(j, "u", "t", running(*PS_PODS), act.status, T0 + 50, ProgressReading(step=40))
    assert to_dict(act2.status)["restarts"] == 0
    act3 = reconcile(j, "u", "t", running(*PS_PODS), act2.status, T0 + 71, ProgressReading(step=40))
    assert to_dict(act3.status)["restarts"] == 1
    assert act3.events[0][1] == "Hung"
    assert act3.delete_pods == ["j-worker-0"]


def test_workers_done_then_shards_done_is_success_with_clean_pod_policy():
    pods = {"ps-0": Pod("ps-0", "Running"), "worker-0": Pod("worker-0", "Succeeded", exit_code=0),
            "worker-1": Pod("worker-1", "Succeeded", exit_code=0)}
    st = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    act = reconcile(job(), "u", "t", pods, st, T0 + 1)
    assert to_dict(act.status)["state"] == "Running" and act.delete_pods == []
    drained = reconcile(job(), "u", "t", pods, act.status, T0 + 200)
    # Drained too long: the shard is stopped gracefully and the job has succeeded.
    assert drained.delete_pods == ["j-ps-0"] and to_dict(drained.status)["state"] == "Succeeded"
    assert "were stopped" in drained.events[-1][2]
    pods["ps-0"] = Pod("ps-0", "Succeeded", exit_code=0)
    act = reconcile(job(runPolicy={"cleanPodPolicy": "All"}), "u", "t", pods, act.status, T0 + 21)
    assert to_dict(act.status)["state"] == "Succeeded"
    assert set(act.delete_pods) == {"j-ps-0", "j-worker-0", "j-worker-1"}


def test_suspend_stops_pods_and_resume_recreates_them():
    st = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    act = reconcile(job(runPolicy={"suspend": True}), "u", "t", running(*PS_PODS), st, T0 + 1)
    assert set(act.delete_pods) == {"j-ps-0", "j-worker-0", "j-worker-1"}
    assert to_dict(act.status)["state"] == "Suspended"
    act = reconcile(job(runPolicy={"suspend": True}), "u", "t", {}, act.status, T0 + 2)
    assert act.create == [] or all(o["kind"] != "Pod" for o in act.create)
    act = reconcile(job(), "u", "t", {}, act.status, T0 + 3)
    assert sorted(created_pods(act)) == ["j-ps-0", "j-worker-0", "j-worker-1"]
    assert to_dict(act.status)["restarts"] == 0
    assert act.events[0][1] == "Resumed"


def test_active_deadline_fails_with_deadline_exceeded():
    act = reconcile(job(runPolicy={"activeDeadlineSeconds": 30}), "u", "t", running(*PS_PODS),
                    {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}, T0 + 31)
    assert to_dict(act.status)["state"] == "Failed"
    assert act.events[-1][1] == "DeadlineExceeded"


def test_ttl_deletes_a_finished_job():
    st = {"state": "Succeeded", "completionTime": iso(T0)}
    act = reconcile(job(runPolicy={"ttlSecondsAfterFinished": 60}), "u", "t", {}, st, T0 + 10)
    assert not act.delete_job and act.requeue_after == pytest.approx(50)
    act = reconcile(job(runPolicy={"ttlSecondsAfterFinished": 60}), "u", "t", {}, st, T0 + 61)
    assert act.delete_job


@pytest.mark.parametrize("ttl", [0, 2, 60])
def test_the_round_that_finishes_a_job_asks_for_its_ttl_round(ttl):
    # No later event need come: the operator's own status write queues no round (handlers.own_status_echo).
    pods = {"single-0": Pod("single-0", "Succeeded", exit_code=0)}
    st = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    act = reconcile(job("Single", runPolicy={"ttlSecondsAfterFinished": ttl}), "u", "t", pods, st, T0 + 5)
    assert to_dict(act.status)["state"] == "Succeeded" and not act.delete_job
    assert act.requeue_after == pytest.approx(max(0.1, ttl))
    act = reconcile(job("Single"), "u", "t", pods, st, T0 + 5)
    assert to_dict(act.status)["state"] == "Succeeded" and act.requeue_after is None


@pytest.mark.parametrize("safety_net", [60.0, 500.0])
def test_a_running_job_asks_for_its_safety_net_round_and_a_clock_comes_first(safety_net):
    pods = {n: Pod(n, "Running") for n in PS_PODS}
    st = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    act = reconcile(job(), "u", "t", pods, st, T0 + 5, safety_net=safety_net)
    assert to_dict(act.status)["state"] == "Running" and act.requeue_after == pytest.approx(safety_net)
    # The job's active deadline runs out in 100 s: its clock asks sooner than a 500 s net.
    act = reconcile(job(runPolicy={"activeDeadlineSeconds": 105}), "u", "t", pods, st, T0 + 5, safety_net=safety_net)
    assert act.requeue_after == pytest.approx(min(safety_net, 100))


@pytest.mark.parametrize("ttl", [0, 30])
def test_a_spec_refused_at_parse_time_is_deleted_at_its_ttl(ttl):
    """engine.refuse (a spec that does not parse) keeps the TTL a driver could still read from it, as a
    finished job's: the round that fails the job asks for the TTL's round, which deletes it."""
    st = read_status({"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}})
    why = Refusal("InvalidSpec", "spec.training.epochs: expected an integer")
    first = refuse(st, why, T0 + 5, 1, ttl=ttl)
    assert first.status.state == "Failed" and [e[1] for e in first.actions.events] == ["InvalidSpec"]
    assert first.actions.delete_job == (ttl == 0)
    assert first.actions.requeue_after == (None if ttl == 0 else pytest.approx(ttl))
    if ttl:
        early = refuse(first.status, why, T0 + 5 + ttl - 1, 1, ttl=ttl)
        assert not early.actions.delete_job and early.actions.requeue_after == pytest.approx(1)
        late = refuse(first.status, why, T0 + 5 + ttl, 1, ttl=ttl)
        assert late.actions.delete_job and late.actions.events == []  # ended once, one Event
    without = refuse(st, why, T0 + 5, 1)
    assert not without.actions.delete_job and without.actions.requeue_after is None


def test_image_pull_failure_is_reported():
    pods = {n: Pod(n, "Pending", waiting_reason="ImagePullBackOff", waiting_message="not found") for n in PS_PODS}
    act = reconcile(job(), "u", "t", pods, {"state": "Created", "startTime": iso(T0)}, T0 + 1)
    cond = to_dict(act.status)["conditions"][0]
    assert cond["reason"] == "ImagePullFailed" and "ImagePullBackOff" in cond["message"]


def test_ddp_rank_restart_in_place_is_counted_and_success_scales_down():
    j = job("DDP")
    pods = {"ddp-0": Pod("ddp-0", "Running"), "ddp-1": Pod("ddp-1", "Running", restart_count=1, last_exit_code=1)}
    act = reconcile(j, "u", "t", pods, {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}, T0 + 1)
    assert to_dict(act.status)["restarts"] == 1
    act = reconcile(j, "u", "t", pods, act.status, T0 + 2)
    assert to_dict(act.status)["restarts"] == 1  # the same restart is not counted twice
    done = {n: Pod(n, "Running", restart_count=2, last_exit_code=0) for n in ("ddp-0", "ddp-1")}
    act = reconcile(j, "u", "t", done, act.status, T0 + 3)
    assert to_dict(act.status)["state"] == "Succeeded"
    assert act.scale_statefulset == 0


def host_then_peer_end(j, names):
    """ddp-0 (the rendezvous host) SIGKILLed at step 40, its container restarted in place, then ddp-1's
    container ended too, the job at step 40 all along: (the pods, the last round's actions)."""
    st = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    pods = {n: Pod(n, "Running", uid=f"{n}-a") for n in names}
    act = reconcile(j, "u", "t", pods, st, T0 + 1, ProgressReading(step=40))
    for t, (name, code) in enumerate((("ddp-0", 137), ("ddp-1", 1)), start=2):
        pods[name] = Pod(name, "Running", uid=f"{name}-a", restart_count=1, last_exit_code=code)
        act = reconcile(j, "u", "t", pods, act.status, T0 + t, ProgressReading(step=40))
    return pods, act


def test_a_plain_ddp_group_that_ends_every_node_for_one_rank_is_one_restart():
    """The soak's case: ddp-0 (the rendezvous host) SIGKILLed, its container restarts in place, and ddp-1's
    torchrun ends too (the host's store went with it): one fault, one restart. A rank that ends again before
    the job steps, and any end after it stepped, is a restart of its own."""
    j = job("DDP")
    pods, act = host_then_peer_end(j, ("ddp-0", "ddp-1"))
    assert to_dict(act.status)["restarts"] == 1, act.events
    [(kind, reason, message)] = [e for e in act.events if e[1] == "RestartedWithItsGroup"]
    assert kind == "Normal" and "ddp-1 restarted with its torchrun group" in message and "ddp-0" in message
    # ddp-0 ends again before the job stepped: its own restart, counted
    pods["ddp-0"] = Pod("ddp-0", "Running", uid="ddp-0-a", restart_count=2, last_exit_code=1)
    act = reconcile(j, "u", "t", pods, act.status, T0 + 4, ProgressReading(step=40))
    assert to_dict(act.status)["restarts"] == 2
    # the job steps past its old step: the group restart is over, and ddp-1's next end is a new restart
    act = reconcile(j, "u", "t", pods, act.status, T0 + 20, ProgressReading(step=41))
    assert to_dict(act.status)["memory"].get("groupRestart", []) == []
    pods["ddp-1"] = Pod("ddp-1", "Running", uid="ddp-1-a", restart_count=2, last_exit_code=1)
    act = reconcile(j, "u", "t", pods, act.status, T0 + 21, ProgressReading(step=41))
    assert to_dict(act.status)["restarts"] == 3


def test_a_fault_tolerant_groups_ends_are_each_counted():
    """Each replica group is a torchrun of its own: one group's end never ends another's."""
    _, act = host_then_peer_end(job("DDP", ddp={"nodes": 2, "faultTolerance": {}}), ("ddp-0", "ddp-1", "lighthouse"))
    assert to_dict(act.status)["restarts"] == 2
    assert not any(e[1] == "RestartedWithItsGroup" for e in act.events)


@pytest.mark.parametrize("ft,expected", [({"faultTolerance": {}}, 1650), ({}, 1550)])
def test_a_fault_tolerant_jobs_newest_checkpoint_is_the_newest_any_group_reported(ft, expected):
    """Its progress is read from whichever group answers, and a group that healed later holds older
    checkpoints: the status keeps the newest. A plain job's chief is the one that writes them: what it
    reports is the newest (a restart that fell back to an older one says so)."""
    j = job("DDP", ddp={"nodes": 2, **ft})
    st = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    names = ("ddp-0", "ddp-1", "lighthouse") if ft else ("ddp-0", "ddp-1")
    pods = {n: Pod(n, "Running", uid=f"{n}-a") for n in names}
    act = reconcile(j, "u", "t", pods, st, T0 + 1, ProgressReading(step=1660, checkpoint_step=1650))
    act = reconcile(j, "u", "t", pods, act.status, T0 + 2, ProgressReading(step=1670, checkpoint_step=1550))
    assert to_dict(act.status)["lastCheckpoint"]["step"] == expected


def test_a_deleted_host_pods_peer_ending_with_it_is_the_same_restart():
    j = job("DDP")
    st = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    pods = {n: Pod(n, "Running", uid=f"{n}-a") for n in ("ddp-0", "ddp-1")}
    act = reconcile(j, "u", "t", pods, st, T0 + 1)
    pods["ddp-0"] = Pod("ddp-0", "Pending", uid="ddp-0-b")
    pods["ddp-1"] = Pod("ddp-1", "Running", uid="ddp-1-a", restart_count=1, last_exit_code=1)
    act = reconcile(j, "u", "t", pods, act.status, T0 + 2)
    assert to_dict(act.status)["restarts"] == 1, act.events
    assert [e[1] for e in act.events if e[0] == "Warning"] == ["Deleted"]
    assert any(e[1] == "RestartedWithItsGroup" for e in act.events)


def test_ddp_pod_replaced_by_its_statefulset_is_one_restart_with_reason_deleted():
    j = job("DDP")
    st = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    pods = {n: Pod(n, "Running", uid=f"{n}-a") for n in ("ddp-0", "ddp-1")}
    act = reconcile(j, "u", "t", pods, st, T0 + 1)
    assert to_dict(act.status)["restarts"] == 0

    # ddp-1 deleted and recreated under the same name between two rounds.
    pods["ddp-1"] = Pod("ddp-1", "Pending", uid="ddp-1-b")
    act = reconcile(j, "u", "t", pods, act.status, T0 + 2)
    assert to_dict(act.status)["restarts"] == 1
    assert [e[1] for e in act.events if e[0] == "Warning"] == ["Deleted"]
    assert "ddp-1 was deleted" in to_dict(act.status)["conditions"][0]["message"] or any(
        "ddp-1 was deleted" in e[2] for e in act.events)
    assert act.delete_pods == [] and act.scale_statefulset is None  # the StatefulSet already replaced it

    act = reconcile(j, "u", "t", pods, act.status, T0 + 3)
    assert to_dict(act.status)["restarts"] == 1  # seen once, counted once


def test_ddp_hung_rank_deleted_by_the_operator_is_not_counted_again_when_replaced():
    j = job("DDP", runPolicy={"progressDeadlineSeconds": 60})
    pods = {n: Pod(n, "Running", uid=f"{n}-a") for n in ("ddp-0", "ddp-1")}
    st = reconcile(j, "u", "t", pods, {"state": "Running", "startTime": iso(T0)}, T0,
                   progress=ProgressReading(step=5)).status
    act = reconcile(j, "u", "t", pods, st, T0 + 61)
    assert to_dict(act.status)["restarts"] == 1 and act.delete_pods == ["j-ddp-0"]

    pods["ddp-0"] = Pod("ddp-0", "Running", uid="ddp-0-b")
    act = reconcile(j, "u", "t", pods, act.status, T0 + 62)
    assert to_dict(act.status)["restarts"] == 1


def test_ddp_pods_back_after_suspend_are_not_restarts():
    j = job("DDP")
    pods = {n: Pod(n, "Running", uid=f"{n}-a") for n in ("ddp-0", "ddp-1")}
    st = reconcile(j, "u", "t", pods, {"state": "Running", "startTime": iso(T0)}, T0).status
    suspended = job("DDP", runPolicy={"suspend": True})
    st = reconcile(suspended, "u", "t", {}, st, T0 + 1).status
    back = {n: Pod(n, "Running", uid=f"{n}-b") for n in ("ddp-0", "ddp-1")}
    act = reconcile(j, "u", "t", back, st, T0 + 2)
    assert to_dict(act.status)["restarts"] == 0 and to_dict(act.status)["state"] == "Running"


@pytest.mark.parametrize("mode, final_pods, step, checkpoint", [
    ("Single", {"single-0": {"steps": 230, "final_train_loss": 0.05, "eval_accuracy": 0.97,
                             "checkpoint_step": 230, "checkpoint_time": T0}}, 230, 230),
    ("ParameterServer", {"worker-0": {"steps": 115, "global_step": 230, "eval_accuracy": 0.96},
                         "worker-1": {"steps": 115, "global_step": 230},
                         "ps-0": {"steps": 230, "checkpoint_step": 230, "checkpoint_time": T0}}, 230, 230),
    ("DDP", {"ddp-0": {"steps": 115, "eval_accuracy": 0.95, "checkpoint_step": 115, "checkpoint_time": T0},
             "ddp-1": None}, 115, 115),
])
def test_success_takes_the_final_step_accuracy_and_checkpoint_from_the_termination_messages(
        mode, final_pods, step, checkpoint):
    j = job(mode)
    names = list(final_pods)
    if mode == "ParameterServer":
        names = list(PS_PODS)
    pods = {n: Pod(n, "Succeeded", exit_code=0, uid=n, final=final_pods.get(n)) for n in names}
    # The last read of the chief's metrics, a few seconds before the end: behind, no accuracy yet.
    old = {"state": "Running", "startTime": iso(T0), "progress": {"step": step - 7, "totalSteps": step, "loss": 0.3},
           "lastCheckpoint": {"step": checkpoint - 30, "time": iso(T0 - 9)}}

    act = reconcile(j, "u", "t", pods, old, T0 + 1)

    assert to_dict(act.status)["state"] == "Succeeded"
    progress = to_dict(act.status)["progress"]
    assert progress["step"] == progress["totalSteps"] == step
    assert progress["evalAccuracy"] == final_pods[{"Single": "single-0", "ParameterServer": "worker-0",
                                                   "DDP": "ddp-0"}[mode]]["eval_accuracy"]
    assert to_dict(act.status)["lastCheckpoint"] == {"step": checkpoint, "time": iso(T0)}
    counts = to_dict(act.status)["replicaStatuses"]
    assert all(c["active"] == 0 and c["succeeded"] > 0 for c in counts.values()), counts


def test_ddp_ranks_that_exited_zero_count_as_succeeded_not_active():
    j = job("DDP")
    # restartPolicy Always: a rank that exited 0 shows phase Running, its container terminated (0).
    pods = {n: Pod(n, "Running", exit_code=0, uid=n) for n in ("ddp-0", "ddp-1")}
    act = reconcile(j, "u", "t", pods, {"state": "Running", "startTime": iso(T0)}, T0 + 1)
    assert to_dict(act.status)["state"] == "Succeeded"
    assert to_dict(act.status)["replicaStatuses"] == {"ddp": {"active": 0, "succeeded": 2, "failed": 0}}


def test_success_without_termination_messages_keeps_the_last_progress_read():
    pods = {n: Pod(n, "Succeeded", exit_code=0) for n in ("single-0",)}
    old = {"state": "Running", "startTime": iso(T0), "progress": {"step": 200, "totalSteps": 230}}
    act = reconcile(job("Single"), "u", "t", pods, old, T0 + 1)
    assert to_dict(act.status)["state"] == "Succeeded" and to_dict(act.status)["progress"] == {"step": 200, "totalSteps": 230, "etaSeconds": 0}


def test_a_scripts_reported_values_become_status_progress_metrics():
    j = job("Single", script={"command": ["python", "train.py"]})
    status = {"state": "Running", "startTime": iso(T0)}
    act = reconcile(j, "u", "t", running("single-0"), status, T0 + 10,
                    ProgressReading(step=7, total_steps=10, loss=0.5, metrics={"acc": 0.9, "lr": 0.01}))
    assert to_dict(act.status)["progress"]["metrics"] == {"acc": 0.9, "lr": 0.01}
    assert to_dict(act.status)["progress"]["loss"] == 0.5
    act2 = reconcile(j, "u", "t", running("single-0"), act.status, T0 + 11, ProgressReading(step=8))
    assert "metrics" not in to_dict(act2.status)["progress"]


def test_a_script_job_runs_the_script_role_in_every_replica():
    from kubetrain.engine.children import children

    single = children(job("Single", script={"command": ["python", "train.py"], "workingDir": "/workspace"}), "u", "t")
    [pod] = [o for o in single if o["kind"] == "Pod"]
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "kubetrain.trainer", "script"]
    assert container["workingDir"] == "/workspace"
    ddp = children(job("DDP", script={"command": ["python", "train.py"]}), "u", "t")
    [sts] = [o for o in ddp if o["kind"] == "StatefulSet"]
    command = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-3:] == ["-m", "kubetrain.trainer", "script"]
    assert "workingDir" not in sts["spec"]["template"]["spec"]["containers"][0]  # the image's own


def test_a_scripts_last_reported_values_reach_the_status_from_its_termination_message():
    j = job("Single", script={"command": ["python", "train.py"]})
    final = {"steps": 300, "final_train_loss": 0.1, "metrics": {"weight_norm": 5.9, "bad": "x"}}
    pods = {"single-0": Pod("single-0", "Succeeded", exit_code=0, uid="a", final=final)}
    old = {"state": "Running", "startTime": iso(T0),
           "progress": {"step": 290, "totalSteps": 300, "metrics": {"lr": 0.01}}}
    act = reconcile(j, "u", "t", pods, old, T0 + 1)
    assert to_dict(act.status)["state"] == "Succeeded"
    assert to_dict(act.status)["progress"]["step"] == 300
    assert to_dict(act.status)["progress"]["metrics"] == {"lr": 0.01, "weight_norm": 5.9}


def test_a_pod_listens_on_every_interface_and_a_local_replica_on_loopback_only(tmp_path):
    from kubetrain.engine.children import children
    from kubetrain.engine.plan import plan_replicas
    from kubetrain.drivers.local.runner import local_endpoints
    from kubetrain.drivers.local.rundir import RunDir

    j = job()
    pods = [o for o in children(j, "u", "t") if o["kind"] == "Pod"]
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["KUBETRAIN_LISTEN_ADDRESS"] == "0.0.0.0", pod["metadata"]["name"]
    local = plan_replicas(j, local_endpoints(j, RunDir(tmp_path / "run")))
    assert {r.env["KUBETRAIN_LISTEN_ADDRESS"] for r in local} == {"127.0.0.1"}


STANDBY = {"parameterServer": {"workers": 2, "standbyWorkers": 1}}


def test_a_job_with_a_standby_worker_creates_its_pod_running_the_standby_role_with_a_workers_resources():
    j = job(**STANDBY, resources={"worker": {"requests": {"cpu": "3"}}, "ps": {"requests": {"cpu": "1"}}})
    act = reconcile(j, "u", "tok", {}, {}, T0)
    pods = {o["metadata"]["name"]: o for o in act.create if o["kind"] == "Pod"}
    assert set(pods) == {"j-ps-0", "j-worker-0", "j-worker-1", "j-standby-0"}
    standby, worker = (pods[n]["spec"]["containers"][0] for n in ("j-standby-0", "j-worker-1"))
    assert standby["command"][-1] == "standby" and worker["command"][-1] == "worker"
    assert standby["resources"] == worker["resources"] and standby["resources"]["requests"]["cpu"] == "3"
    env = {e["name"]: e.get("value") for e in standby["env"]}
    assert env["KUBETRAIN_REPLICA"] == "standby-0" and env["KUBETRAIN_PS_ADDRS"]
    assert to_dict(act.status)["workers"] == 2  # the job's size: standbys are not workers


def test_with_standbys_the_shards_success_ends_the_job_and_stops_a_replacement_still_standing_by():
    """standby-0 took worker-1's place and finished it; worker-1's replacement pod waits as a standby. ps-0
    exits 0 only once every place finished: the job has succeeded, and the waiting pod is stopped."""
    pods = {"ps-0": Pod("ps-0", "Succeeded", exit_code=0), "worker-0": Pod("worker-0", "Succeeded", exit_code=0),
            "worker-1": Pod("worker-1", "Running"), "standby-0": Pod("standby-0", "Succeeded", exit_code=0)}
    st = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    act = reconcile(job(**STANDBY), "u", "t", pods, st, T0 + 1)
    assert to_dict(act.status)["state"] == "Succeeded"
    assert act.delete_pods == ["j-worker-1"]
    # Without standbys a running worker still holds its own place: the job is not done.
    del pods["standby-0"]
    act = reconcile(job(), "u", "t", pods, st, T0 + 1)
    assert to_dict(act.status)["state"] == "Running" and act.delete_pods == []


def test_a_failed_standby_pod_is_replaced_as_any_replica():
    pods = running("ps-0", "worker-0", "worker-1", "standby-0")
    pods["standby-0"] = Pod("standby-0", "Failed", exit_code=137)
    status = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    act = reconcile(job(**STANDBY), "u", "tok", pods, status, T0 + 5)
    assert act.delete_pods == ["j-standby-0"] and to_dict(act.status)["restarts"] == 1
    del pods["standby-0"]
    again = reconcile(job(**STANDBY), "u", "tok", pods, act.status, T0 + 5.5, existing=set())
    assert "j-standby-0" in created_pods(again)


def test_a_fine_tune_s_final_evaluation_reaches_the_status_loss_and_perplexity():
    j = job("Single")
    final = {"steps": 30, "final_train_loss": 3.1, "eval_accuracy": None, "eval_loss": 3.9, "eval_perplexity": 49.4}
    pods = {"single-0": Pod("single-0", "Succeeded", exit_code=0, uid="a", final=final)}
    old = {"state": "Running", "startTime": iso(T0), "progress": {"step": 20, "totalSteps": 30, "evalLoss": 4.1}}
    progress = to_dict(reconcile(j, "u", "t", pods, old, T0 + 1).status)["progress"]
    assert (progress["evalLoss"], progress["evalPerplexity"]) == (3.9, 49.4)


def test_checkpoints_set_aside_at_a_restore_are_one_warning_per_process_naming_which_and_why():
    j = job()
    pods = {n: Pod(n, "Running") for n in ("ps-0", "worker-0", "worker-1")}
    status = {"state": "Running", "startTime": iso(0)}
    reading = ProgressReading(step=21, checkpoint_step=20, set_aside=1,
                              set_aside_detail="ckpt-00000030.pt: sha256 mismatch")
    act = reconcile(j, "u", "t", pods, status, 10.0, reading)
    warnings = [e for e in act.events if e[1] == "CheckpointSetAside"]
    assert len(warnings) == 1 and warnings[0][0] == "Warning"
    assert "1 damaged checkpoint(s) set aside" in warnings[0][2] and "ckpt-00000030.pt: sha256 mismatch" in warnings[0][2]
    again = reconcile(j, "u", "t", pods, to_dict(act.status), 20.0, ProgressReading(step=22, set_aside=1))
    assert not [e for e in again.events if e[1] == "CheckpointSetAside"], "once per process"
    # A cluster reads only the count: the chief's log names them.
    later = to_dict(again.status)
    later["restarts"] = 1
    restarted = reconcile(j, "u", "t", pods, later, 30.0, ProgressReading(step=23, set_aside=1))
    [(_, _, message)] = [e for e in restarted.events if e[1] == "CheckpointSetAside"]
    assert "the chief replica's log names each" in message
