"""Why a job waits (no node fits its pods) and replicas on nodes that stopped answering, one round at a time."""

import pytest

from kubetrain.shared.timestamps import iso
from kubetrain.engine.engine import MAX_REQUEUE_SECONDS

from kubetrain.drivers.cluster.observe import pod_observation
from kubetrain.engine.children import NODE_LOST_TAINTS, NODE_LOST_TOLERATION_SECONDS, children
from kubetrain.engine.reconcile import FORCE_DELETE_AFTER_SECONDS, reconcile
from kubetrain.engine.reconcile import PodObservation as Pod
from kubetrain.api.status import to_dict

from core.test_reconcile import PS_PODS, T0, created_pods, job, running

NO_NODE = "0/4 nodes are available: 4 node(s) didn't match Pod's node affinity/selector."
ACTIVE = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}


def unschedulable(*names, message=NO_NODE):
    return {n: Pod(n, "Pending", unschedulable=message) for n in names}


def condition(status, ctype):
    return next(c for c in to_dict(status)["conditions"] if c["type"] == ctype)


def test_an_unschedulable_pod_is_the_reason_on_the_condition_with_the_schedulers_message():
    act = reconcile(job(), "u", "t", unschedulable(*PS_PODS), {"state": "Created", "startTime": iso(T0)}, T0 + 1)
    cond = condition(act.status, "Created")
    assert cond["reason"] == "Unschedulable"
    assert cond["message"] == f"ps-0, worker-0, worker-1 cannot be scheduled: {NO_NODE}"
    assert act.events == [("Warning", "Unschedulable", cond["message"])]
    assert to_dict(act.status)["memory"]["unschedulableSince"] == T0 + 1


def test_the_waiting_event_is_recorded_once_while_the_reason_lasts():
    first = reconcile(job(), "u", "t", unschedulable(*PS_PODS), {"state": "Created", "startTime": iso(T0)}, T0 + 1)
    second = reconcile(job(), "u", "t", unschedulable(*PS_PODS), first.status, T0 + 11)
    assert condition(second.status, "Created")["reason"] == "Unschedulable"
    assert second.events == []
    # Once scheduled, the plain reason is back and the clock is cleared.
    third = reconcile(job(), "u", "t", running(*PS_PODS), second.status, T0 + 12)
    assert condition(third.status, "Running")["reason"] == "Running"
    assert to_dict(third.status)["memory"].get("unschedulableSince") is None


@pytest.mark.parametrize("waited, failed", [(59, False), (60, True)])
def test_scheduling_timeout_fails_the_job_with_unschedulable_at_its_edge(waited, failed):
    j = job(runPolicy={"schedulingTimeoutSeconds": 60})
    first = reconcile(j, "u", "t", unschedulable(*PS_PODS), {"state": "Created", "startTime": iso(T0)}, T0)
    # Looked at again when the timeout runs out (or at MAX_REQUEUE_SECONDS, the safety net, if sooner).
    assert first.requeue_after == pytest.approx(min(MAX_REQUEUE_SECONDS, 60))
    act = reconcile(j, "u", "t", unschedulable(*PS_PODS), first.status, T0 + waited)
    assert (to_dict(act.status)["state"] == "Failed") is failed
    if failed:
        cond = condition(act.status, "Failed")
        assert cond["reason"] == "Unschedulable"
        assert "schedulingTimeoutSeconds (60 s)" in cond["message"] and NO_NODE in cond["message"]
        assert sorted(act.delete_pods) == ["j-ps-0", "j-worker-0", "j-worker-1"]  # cleanPodPolicy Running
    else:
        assert act.requeue_after == pytest.approx(1)


def test_the_scheduling_clock_starts_again_once_every_pod_was_placed():
    j = job(runPolicy={"schedulingTimeoutSeconds": 60})
    act = reconcile(j, "u", "t", unschedulable("worker-1") | running("ps-0", "worker-0"), ACTIVE, T0)
    act = reconcile(j, "u", "t", running(*PS_PODS), act.status, T0 + 50)
    act = reconcile(j, "u", "t", unschedulable("worker-1") | running("ps-0", "worker-0"), act.status, T0 + 100)
    assert to_dict(act.status)["state"] == "Running"  # a running job whose replacement waits stays Running
    assert condition(act.status, "Running")["reason"] == "Unschedulable"
    assert to_dict(act.status)["memory"]["unschedulableSince"] == T0 + 100


def test_without_a_scheduling_timeout_a_job_waits_as_long_as_it_takes():
    act = reconcile(job(), "u", "t", unschedulable(*PS_PODS), {"state": "Created", "startTime": iso(T0),
                    "memory": {"unschedulableSince": T0}}, T0 + 86400)
    assert to_dict(act.status)["state"] == "Created"


def test_a_pod_the_scheduler_reports_is_observed_with_its_message():
    raw = {"metadata": {"name": "j-worker-0", "labels": {"kubetrain.dev/replica": "worker-0"}},
           "status": {"phase": "Pending", "conditions": [
               {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": NO_NODE}]}}
    assert pod_observation(raw).unschedulable == NO_NODE
    raw["status"]["conditions"][0]["status"] = "True"
    assert pod_observation(raw).unschedulable == ""


# -- lost nodes ----------------------------------------------------------------------------------


def lost(name, due=T0 + 60, node="kwok-node-1"):
    return Pod(name, "Running", terminating=True, node_lost=True, deletion_due=due, node=node)


def test_a_pod_evicted_by_the_taint_manager_is_observed_as_node_lost():
    raw = {"metadata": {"name": "j-ddp-1", "labels": {"apps.kubernetes.io/pod-index": "1"},
                        "deletionTimestamp": "2027-01-15T08:00:00Z"},
           "status": {"phase": "Running", "conditions": [
               {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager",
                "message": "Taint manager: deleting due to NoExecute taint"}]}}
    seen = pod_observation(raw)
    assert seen.replica == "ddp-1" and seen.node_lost and seen.terminating
    assert seen.deletion_due is not None and iso(seen.deletion_due) == "2027-01-15T08:00:00Z"
    raw["status"]["conditions"][0]["reason"] = "PreemptionByScheduler"
    assert not pod_observation(raw).node_lost


def test_a_worker_on_a_lost_node_is_a_nodelost_restart_counted_once():
    pods = running(*PS_PODS)
    pods["worker-1"] = lost("worker-1")
    act = reconcile(job(), "u", "t", pods, ACTIVE, T0 + 5)
    assert to_dict(act.status)["restarts"] == 1
    assert act.events[0][:2] == ("Warning", "NodeLost")
    assert "worker-1's node stopped answering" in act.events[0][2]
    assert [r.reason for r in act.restarted] == ["NodeLost"]
    # It lingers, Terminating: no second restart, and no replacement under its name yet.
    again = reconcile(job(), "u", "t", pods, act.status, T0 + 10, existing=set())
    assert to_dict(again.status)["restarts"] == 1 and again.restarted == []
    assert "j-worker-1" not in created_pods(again)
    # Gone (forcibly deleted): replaced.
    del pods["worker-1"]
    gone = reconcile(job(), "u", "t", pods, again.status, T0 + 71, existing=set())
    assert "j-worker-1" in created_pods(gone)
    assert to_dict(gone.status)["restarts"] == 1


@pytest.mark.parametrize("after, forced", [(FORCE_DELETE_AFTER_SECONDS - 1, False), (FORCE_DELETE_AFTER_SECONDS, True)])
def test_a_pod_stuck_terminating_on_a_lost_node_is_force_deleted_past_its_grace_period(after, forced):
    pods = running(*PS_PODS)
    pods["worker-1"] = lost("worker-1", due=T0 + 60)
    counted = reconcile(job(), "u", "t", pods, ACTIVE, T0 + 5)
    act = reconcile(job(), "u", "t", pods, counted.status, T0 + 60 + after)
    assert act.force_delete_pods == (["j-worker-1"] if forced else [])
    if forced:
        assert ("Warning", "NodeLost") in [e[:2] for e in act.events if "forcibly" in e[2]]
    else:
        assert act.requeue_after == pytest.approx(1)


def test_a_terminating_pod_on_a_node_that_answers_is_never_force_deleted():
    pods = running(*PS_PODS)
    pods["worker-1"] = Pod("worker-1", "Running", terminating=True, deletion_due=T0)
    act = reconcile(job(), "u", "t", pods, ACTIVE, T0 + 3600)
    assert act.force_delete_pods == []


def test_a_ddp_rank_on_a_lost_node_is_one_nodelost_restart_and_its_new_incarnation_none():
    j = job("DDP")
    status = dict(ACTIVE, memory={"activeSince": T0, "identities": {"ddp-0": "a", "ddp-1": "b"}})
    pods = {"ddp-0": Pod("ddp-0", "Running", uid="a"),
            "ddp-1": Pod("ddp-1", "Running", uid="b", terminating=True, node_lost=True, deletion_due=T0 + 1)}
    act = reconcile(j, "u", "t", pods, status, T0 + 5)
    assert to_dict(act.status)["restarts"] == 1 and [r.reason for r in act.restarted] == ["NodeLost"]
    act = reconcile(j, "u", "t", pods, act.status, T0 + 1 + FORCE_DELETE_AFTER_SECONDS)
    assert act.force_delete_pods == ["j-ddp-1"] and to_dict(act.status)["restarts"] == 1
    # The StatefulSet makes ddp-1 again (a new uid) on another node: the restart already counted.
    pods["ddp-1"] = Pod("ddp-1", "Running", uid="c", node="kwok-node-2")
    act = reconcile(j, "u", "t", pods, act.status, T0 + 20)
    act = reconcile(j, "u", "t", pods, act.status, T0 + 21)
    assert to_dict(act.status)["restarts"] == 1
    assert to_dict(act.status)["memory"]["identities"]["ddp-1"] == "c"
    assert to_dict(act.status)["state"] == "Running"


@pytest.mark.parametrize("mode", ["ParameterServer", "DDP"])
def test_every_pod_tolerates_a_lost_node_only_briefly(mode):
    for obj in children(job(mode), "u", "t"):
        spec = obj["spec"]["template"]["spec"] if obj["kind"] == "StatefulSet" else obj.get("spec")
        if obj["kind"] not in ("Pod", "StatefulSet"):
            continue
        got = {t["key"]: t for t in spec["tolerations"]}
        for key in NODE_LOST_TAINTS:
            assert got[key] == {"key": key, "operator": "Exists", "effect": "NoExecute",
                                "tolerationSeconds": NODE_LOST_TOLERATION_SECONDS}


def test_a_templates_own_toleration_of_a_lost_node_wins():
    mine = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 5}
    j = job("Single", podTemplate={"spec": {"tolerations": [mine, {"key": "gpu", "operator": "Exists"}]}})
    pod = next(o for o in children(j, "u", "t") if o["kind"] == "Pod")
    keys = [t["key"] for t in pod["spec"]["tolerations"]]
    assert keys == ["node.kubernetes.io/unreachable", "gpu", "node.kubernetes.io/not-ready"]
    assert pod["spec"]["tolerations"][0]["tolerationSeconds"] == 5
    everything = job("Single", podTemplate={"spec": {"tolerations": [{"operator": "Exists"}]}})
    pod = next(o for o in children(everything, "u", "t") if o["kind"] == "Pod")
    assert pod["spec"]["tolerations"] == [{"operator": "Exists"}]


def test_a_replica_marked_lost_before_its_deletion_is_counted_once():
    """The taint manager writes DisruptionTarget, then deletes: one round may see the mark alone."""
    pods = running(*PS_PODS)
    pods["worker-1"] = Pod("worker-1", "Running", node_lost=True)
    act = reconcile(job(), "u", "t", pods, ACTIVE, T0 + 5)
    assert to_dict(act.status)["restarts"] == 1 and act.delete_pods == ["j-worker-1"]
    pods["worker-1"] = lost("worker-1")
    act = reconcile(job(), "u", "t", pods, act.status, T0 + 6)
    assert to_dict(act.status)["restarts"] == 1 and act.restarted == []


def test_every_replica_of_a_lost_node_is_restarted_without_using_up_max_restarts_without_progress():
    pods = {n: lost(n) for n in PS_PODS}
    act = reconcile(job(restartPolicy={"maxRestartsWithoutProgress": 1}), "u", "t", pods, ACTIVE, T0 + 5)
    assert to_dict(act.status)["state"] == "Restarting"
    assert to_dict(act.status)["restarts"] == 3 and to_dict(act.status).get("restartsWithoutProgress", 0) == 0
