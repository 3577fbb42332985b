"""Elastic jobs in the pure core: spec.replicas (what `kubectl scale` writes) against the size the
replicas run at, one round at a time. A resize stops every replica after a checkpoint, then renders
what carries the size again (the job file, the DDP StatefulSet) and starts the new set."""

import pytest
import yaml

from kubetrain_operator.api import from_object
from kubetrain_operator.api.load import InvalidSpec
from kubetrain_operator.core.reconcile import iso, reconcile

from core.test_reconcile import PS_PODS, T0, Pod, created_pods, job, running

ACTIVE_AT_2 = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0, "size": 2}}
EXISTING = {("ConfigMap", "j-config"), ("Secret", "j-token"), ("Service", "j-ps-0"),
            ("PersistentVolumeClaim", "j-ps-0-data"), ("StatefulSet", "j-ddp"), ("Service", "j-ddp"),
            ("NetworkPolicy", "j-isolation")}


def condition(status, ctype):
    return next(c for c in status["conditions"] if c["type"] == ctype)


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


# --- a ParameterServer job: 2 -> 3 -> 1 workers -------------------------------------------


def test_a_scale_up_stops_every_replica_then_starts_the_new_set_with_the_job_file_at_the_new_size():
    j = job(replicas=3)
    act = reconcile(j, "u", "t", running(*PS_PODS), ACTIVE_AT_2, T0 + 10, existing=EXISTING)
    # Every replica stops (the shards checkpoint, the workers' cursors are with ps-0); none starts.
    assert sorted(act.delete_pods) == ["j-ps-0", "j-worker-0", "j-worker-1"]
    assert created_pods(act) == [] and act.replace == []
    assert act.status["state"] == "Restarting"
    assert condition(act.status, "Restarting")["reason"] == "Resizing"
    assert act.events == [("Normal", "Resizing", "Resizing from 2 to 3 workers: the replicas stop after a "
                                                 "checkpoint and start again at the new size.")]
    assert act.status["replicas"] == 2 and act.status["restarts"] == 0
    # While they stop: no second Event, nothing started.
    stopping = {n: p for n, p in running(*PS_PODS).items() if n != "ps-0"}
    again = reconcile(j, "u", "t", stopping, act.status, T0 + 11, existing=EXISTING)
    assert again.events == [] and created_pods(again) == []
    # None left: the job file is rendered again at 3 workers, then the four replicas start.
    done = reconcile(j, "u", "t", {}, again.status, T0 + 12, existing=EXISTING)
    assert [o["kind"] for o in done.replace] == ["ConfigMap"]
    assert job_file(done.replace[0])["spec"]["parameterServer"]["workers"] == 3
    assert sorted(created_pods(done)) == ["j-ps-0", "j-worker-0", "j-worker-1", "j-worker-2"]
    assert done.events == [("Normal", "Resized", "Resized from 2 to 3 workers; the job resumes from its newest checkpoint.")]
    assert done.status["replicas"] == 3 and done.status["restarts"] == 0
    assert done.status["selector"] == "kubetrain.dev/job-name=j,kubetrain.dev/role=worker"
    # The next round runs at 3: nothing rendered again.
    steady = reconcile(j, "u", "t", running("ps-0", "worker-0", "worker-1", "worker-2"), done.status, T0 + 13,
                       existing=EXISTING)
    assert steady.replace == [] and steady.delete_pods == [] and steady.status["state"] == "Running"


def test_a_scale_down_starts_only_the_smaller_set():
    j = job(replicas=1)
    act = reconcile(j, "u", "t", {}, ACTIVE_AT_2, T0 + 10, existing=EXISTING)
    assert sorted(created_pods(act)) == ["j-ps-0", "j-worker-0"]
    assert job_file(act.replace[0])["spec"]["parameterServer"]["workers"] == 1
    assert act.status["replicas"] == 1


def test_a_resize_asked_while_suspended_takes_effect_when_the_job_resumes():
    j = job(replicas=3, runPolicy={"suspend": True})
    held = reconcile(j, "u", "t", {}, {**ACTIVE_AT_2, "state": "Suspended"}, T0 + 10, existing=EXISTING)
    assert held.replace == [] and created_pods(held) == []
    resumed = reconcile(job(replicas=3), "u", "t", {}, held.status, T0 + 20, existing=EXISTING)
    assert len(created_pods(resumed)) == 4 and [o["kind"] for o in resumed.replace] == ["ConfigMap"]


def test_a_job_from_before_sizes_were_remembered_runs_at_its_spec_size():
    old = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    act = reconcile(job(), "u", "t", running(*PS_PODS), old, T0 + 10, existing=EXISTING)
    assert act.delete_pods == [] and act.status["memory"]["size"] == 2 and act.status["replicas"] == 2


def test_a_replica_that_failed_or_finished_before_the_resize_is_stopped_too():
    """Else its pod stays, and the round that finds no replica left, the one that starts the new set,
    never comes."""
    pods = {**running("ps-0", "worker-1"), "worker-0": Pod("worker-0", "Succeeded", exit_code=0)}
    act = reconcile(job(replicas=3), "u", "t", pods, ACTIVE_AT_2, T0 + 10, existing=EXISTING)
    assert sorted(act.delete_pods) == ["j-ps-0", "j-worker-0", "j-worker-1"]
    pods = {**running("ps-0", "worker-0"), "worker-1": Pod("worker-1", "Failed", exit_code=137)}
    act = reconcile(job(replicas=3), "u", "t", pods, ACTIVE_AT_2, T0 + 10, existing=EXISTING)
    assert sorted(act.delete_pods) == ["j-ps-0", "j-worker-0", "j-worker-1"] and act.status["restarts"] == 0


def test_a_failure_while_resizing_is_no_restart():
    pods = running("worker-0", "worker-1")
    act = reconcile(job(replicas=3), "u", "t", pods, {**ACTIVE_AT_2, "memory": {**ACTIVE_AT_2["memory"],
                    "pendingRestarts": {"ps-0": T0 + 30}}}, T0 + 10, existing=EXISTING)
    assert act.status["restarts"] == 0 and act.status["memory"].get("pendingRestarts", {}) == {}
    assert sorted(act.delete_pods) == ["j-worker-0", "j-worker-1"]


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
    assert done.status["replicas"] == 1
    assert done.status["selector"] == "kubetrain.dev/job-name=j,kubetrain.dev/role=ddp"
    # And back to 2.
    at_1 = reconcile(ddp(1), "u", "t", running("ddp-0"), done.status, T0 + 13, existing=EXISTING)
    grow = reconcile(ddp(2), "u", "t", running("ddp-0"), at_1.status, T0 + 20, existing=EXISTING)
    assert grow.scale_statefulset == 0
    grown = reconcile(ddp(2), "u", "t", {}, grow.status, T0 + 22, existing=EXISTING)
    sts = next(o for o in grown.replace if o["kind"] == "StatefulSet")
    assert sts["spec"]["replicas"] == 2 and grown.status["replicas"] == 2


def test_a_resize_finished_by_an_operator_that_never_saw_the_children_renders_them_again():
    """A restarted operator (or a new leader) knows of no child (`existing` empty) until a round made
    them: a create would meet the old ones and leave them at the old size."""
    stopping = reconcile(ddp(1), "u", "t", running("ddp-0", "ddp-1"), ACTIVE_AT_2, T0 + 10, existing=set())
    done = reconcile(ddp(1), "u", "t", {}, stopping.status, T0 + 12, existing=set())
    assert sorted(o["kind"] for o in done.replace) == ["ConfigMap", "StatefulSet"]
    assert not [o for o in done.create if o["kind"] in ("ConfigMap", "StatefulSet")]
