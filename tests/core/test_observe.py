"""The operator's reading of what it observes: pods (the API's JSON) and the chief's /metrics text."""

from __future__ import annotations

import json

import pytest

from kubetrain.drivers.cluster import observe
from kubetrain.api.status import to_dict
from kubetrain.drivers.cluster.observe import (owned_by, owner_of, parse_metrics, pod_observation, progress_from,
                                                   termination_results)


def pod(container_status: dict, labels: dict | None = None, phase: str = "Running") -> dict:
    return {
        "metadata": {"name": "j-ddp-1", "uid": "u-1",
                     "labels": labels or {"apps.kubernetes.io/pod-index": "1"}},
        "spec": {"nodeName": "kt-real-0"},
        "status": {"phase": phase, "podIP": "10.251.3.7",
                   "containerStatuses": [{"name": "trainer", **container_status}]},
    }


def test_a_statefulset_pod_is_its_rank_with_uid_and_restart_count():
    obs = pod_observation(pod({"restartCount": 2, "state": {"running": {}},
                               "lastState": {"terminated": {"exitCode": 1, "message": "Traceback ..."}}}))
    assert obs is not None
    assert (obs.replica, obs.uid, obs.restart_count, obs.last_exit_code, obs.final) == ("ddp-1", "u-1", 2, 1, None)


def test_the_final_results_come_from_a_zero_exit_termination_message():
    results = {"steps": 115, "eval_accuracy": 0.97, "checkpoint_step": 115}
    ended = pod({"state": {"terminated": {"exitCode": 0, "message": json.dumps(results)}}}, phase="Succeeded")
    assert pod_observation(ended).final == results
    # A StatefulSet restarts even a container that exited 0: the message is kept in lastState.
    restarted = pod({"state": {"waiting": {"reason": "CrashLoopBackOff"}},
                     "lastState": {"terminated": {"exitCode": 0, "message": json.dumps(results)}}})
    assert pod_observation(restarted).final == results


def test_a_failed_container_or_a_log_tail_is_no_final_result():
    failed = pod({"state": {"terminated": {"exitCode": 1, "message": json.dumps({"steps": 3})}}}, phase="Failed")
    assert pod_observation(failed).final is None
    assert termination_results("INFO single-0: step 5\nTraceback (most recent call last):") is None
    assert termination_results("[1, 2]") is None
    assert termination_results("") is None


def test_unmeasured_gauges_are_nan_and_are_left_out_of_the_progress():
    text = "\n".join([
        'kubetrain_training_step{job="j"} 40.0',
        'kubetrain_total_steps{job="j"} 230.0',
        'kubetrain_loss{job="j"} 0.25',
        'kubetrain_eval_accuracy{job="j"} NaN',
        'kubetrain_last_checkpoint_step{job="j"} 0.0',
    ])
    progress = progress_from(parse_metrics(text))
    assert progress is not None
    assert (progress.step, progress.total_steps, progress.loss) == (40, 230, 0.25)
    assert progress.eval_accuracy is None and progress.checkpoint_step is None


def test_checkpoints_the_chief_set_aside_are_read_from_its_counter():
    text = "\n".join(['kubetrain_training_step{job="j"} 40.0',
                      'kubetrain_checkpoints_set_aside_total{job="j",role="single",replica="single-0"} 2.0',
                      'kubetrain_checkpoints_set_aside_created{job="j",role="single",replica="single-0"} 1.8e9'])
    progress = progress_from(parse_metrics(text))
    assert progress is not None and progress.set_aside == 2 and progress.set_aside_detail is None
    assert progress_from(parse_metrics('kubetrain_training_step{job="j"} 40.0')).set_aside is None


def test_a_scripts_reported_values_come_by_name_and_stay_bounded():
    from kubetrain.api.spec import MAX_REPORTED_METRICS

    lines = ['kubetrain_training_step{job="j"} 12.0', 'kubetrain_loss{job="j"} +Inf']
    lines += [f'kubetrain_reported_metric{{job="j",name="m{i}",replica="single-0"}} {i}.5'
              for i in range(MAX_REPORTED_METRICS + 5)]
    lines.append('kubetrain_reported_metric{job="j",name="not a name"} 1.0')
    progress = progress_from(parse_metrics("\n".join(lines)))
    assert progress is not None and progress.step == 12
    assert progress.loss is None  # an infinity is no JSON number: not in the status
    assert progress.metrics is not None and len(progress.metrics) == MAX_REPORTED_METRICS
    assert progress.metrics["m0"] == 0.5 and progress.metrics["m3"] == 3.5
    assert "not a name" not in progress.metrics


def test_a_nan_or_infinite_reported_value_is_left_out():
    text = "\n".join(['kubetrain_training_step{job="j"} 3.0',
                      'kubetrain_reported_metric{job="j",name="acc"} 0.75',
                      'kubetrain_reported_metric{job="j",name="bad"} NaN',
                      'kubetrain_reported_metric{job="j",name="worse"} -Inf'])
    assert progress_from(parse_metrics(text)).metrics == {"acc": 0.75}


def test_a_dead_trainer_under_restart_policy_never_has_failed_before_the_kubelet_says_so():
    """The kubelet reports the container's exit first and the pod's phase Failed once the sandbox is
    torn down (a second later): the replica has failed at the first report."""
    dead = pod({"state": {"terminated": {"exitCode": 137, "reason": "Error"}}}, {"kubetrain.dev/replica": "worker-1"})
    dead["spec"]["restartPolicy"] = "Never"
    obs = pod_observation(dead)
    assert (obs.phase, obs.exit_code) == ("Failed", 137)
    finished = pod({"state": {"terminated": {"exitCode": 0}}}, {"kubetrain.dev/replica": "worker-1"})
    finished["spec"]["restartPolicy"] = "Never"
    assert pod_observation(finished).phase == "Running"  # success waits for the kubelet's phase
    # A StatefulSet's rank (restartPolicy Always) comes back in place: not failed.
    rank = pod({"state": {"terminated": {"exitCode": 137}}})
    rank["spec"]["restartPolicy"] = "Always"
    assert pod_observation(rank).phase == "Running"


# --- a tenant's termination message and a pod's owner (issue 31) ------------------------------------

def test_a_termination_message_keeps_only_what_a_status_can_hold():
    huge = int("9" * 400)
    message = json.dumps({"steps": huge, "global_step": 12, "final_train_loss": 0.5, "eval_accuracy": 1e308,
                          "checkpoint_step": -(2**63) - 1, "metrics": {"acc": 0.9, "big": huge, "deep": {"x": 1}},
                          "note": "ok", "list": [1, 2]})
    assert termination_results(message) == {"global_step": 12, "final_train_loss": 0.5, "eval_accuracy": 1e308,
                                            "metrics": {"acc": 0.9}, "note": "ok"}
    # Nested past the JSON decoder's recursion (4 KiB of message is room for 2,000 levels): no result, no raise.
    assert termination_results("[" * 2048 + "]" * 2048) is None
    assert termination_results('{"a": ' + "[" * 4000 + "]" * 4000 + "}") is None


def test_a_huge_number_in_the_final_results_costs_the_round_nothing():
    """A 400-digit step in the chief's termination message once raised OverflowError in every round of
    its job (math.isfinite of an int too large for a float): the job ends as if it had not been there."""
    from kubetrain.api import from_object
    from kubetrain.engine.reconcile import reconcile

    job = from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                       "metadata": {"name": "j", "namespace": "ns"}, "spec": {"mode": "Single"}})
    message = json.dumps({"global_step": int("1" + "0" * 400), "steps": 7, "final_train_loss": 0.25})
    ended = pod_observation({"metadata": {"name": "j-single-0", "uid": "p", "labels": {"kubetrain.dev/replica": "single-0"}},
                             "spec": {}, "status": {"phase": "Succeeded", "containerStatuses": [
                                 {"name": "trainer", "state": {"terminated": {"exitCode": 0, "message": message}}}]}})
    act = reconcile(job, "u", "t", {"single-0": ended}, {"state": "Running"}, 1000.0, None)
    assert to_dict(act.status)["state"] == "Succeeded"
    assert to_dict(act.status)["progress"]["step"] == 7 and to_dict(act.status)["progress"]["loss"] == 0.25


def test_a_pod_belongs_to_the_job_that_owns_it_not_to_the_one_its_labels_name():
    def owned(kind, name, uid, controller=True):
        return {"metadata": {"ownerReferences": [{"kind": kind, "name": name, "uid": uid, "controller": controller}]}}

    assert owned_by(owner_of(owned("TrainingJob", "victim", "u-victim")), "victim", "u-victim")
    assert not owned_by(owner_of(owned("TrainingJob", "victim", "u-old")), "victim", "u-victim")  # a job gone
    assert not owned_by(owner_of(owned("TrainingJob", "attacker", "u-attacker")), "victim", "u-victim")
    assert owned_by(owner_of(owned("StatefulSet", "victim-ddp", "s")), "victim", "u-victim", "s")
    assert not owned_by(owner_of(owned("StatefulSet", "attacker-ddp", "s")), "victim", "u-victim", "s")
    # The StatefulSet's name alone: any pod may name it, with any uid.
    assert not owned_by(owner_of(owned("StatefulSet", "victim-ddp", "forged")), "victim", "u-victim", "s")
    assert not owned_by(owner_of(owned("StatefulSet", "victim-ddp", "s")), "victim", "u-victim")  # not known yet
    assert not owned_by(owner_of(owned("StatefulSet", "victim-ddp", "")), "victim", "u-victim")
    assert not owned_by(owner_of(owned("TrainingJob", "victim", "u-victim", controller=False)), "victim", "u-victim")
    assert not owned_by(owner_of({"metadata": {}}), "victim", "u-victim")  # a bare pod, labelled by anyone


def test_the_operators_index_files_a_pod_under_its_owner():
    from kubetrain.drivers.cluster.index import Index, observed_pod

    index = Index()
    key = ("ns", "victim")
    labels = {"kubetrain.dev/job-name": "victim", "kubetrain.dev/replica": "single-0"}

    def raw(name, owner_uid, phase):
        return {"metadata": {"name": name, "namespace": "ns", "uid": name, "labels": labels,
                             "ownerReferences": [{"kind": "TrainingJob", "name": "x", "uid": owner_uid, "controller": True}]},
                "spec": {}, "status": {"phase": phase}}

    index.set_pod(key, "victim-single-0", observed_pod(raw("victim-single-0", "u-victim", "Running")))
    # Another job's pod labelled as the victim's replica, seen later (it used to win the replica).
    index.set_pod(key, "forged", observed_pod(raw("forged", "u-attacker", "Succeeded")))
    seen = index.replicas(key, "u-victim")
    assert list(seen) == ["single-0"] and seen["single-0"].phase == "Running" and seen["single-0"].uid == "victim-single-0"
    # The victim's own uid (anyone who may read the job reads it) on a pod of another name: not its replica.
    index.set_pod(key, "victim-forged", observed_pod(raw("victim-forged", "u-victim", "Succeeded")))
    seen = index.replicas(key, "u-victim")
    assert list(seen) == ["single-0"] and seen["single-0"].uid == "victim-single-0"


def test_the_operators_index_files_a_pod_under_the_statefulset_it_knows_by_uid():
    """A DDP job's ranks are the pods of its StatefulSet, by uid: a pod that names `<job>-ddp` as its
    owner with another uid (a tenant who may create pods) is not rank 0, and until the API server has
    said which uid the job's StatefulSet has, the index asks for it (statefulset_unknown) and counts none."""
    from kubetrain.drivers.cluster.index import Index, observed_pod

    index = Index()
    key = ("ns", "victim")

    def raw(name, owner_uid, phase, replica_label=None):
        labels = {"kubetrain.dev/job-name": "victim", "apps.kubernetes.io/pod-index": "0"}
        if replica_label:
            labels["kubetrain.dev/replica"] = replica_label
        return {"metadata": {"name": name, "namespace": "ns", "uid": name, "labels": labels,
                             "ownerReferences": [{"kind": "StatefulSet", "name": "victim-ddp", "uid": owner_uid,
                                                  "controller": True}]},
                "spec": {}, "status": {"phase": phase}}

    index.set_pod(key, "victim-ddp-0", observed_pod(raw("victim-ddp-0", "s-real", "Running")))
    assert index.statefulset_unknown(key, "u-victim") and index.replicas(key, "u-victim") == {}
    index.set_statefulset(key, "u-victim", "s-real")  # the API server's answer (kube.statefulset_uid)
    assert not index.statefulset_unknown(key, "u-victim")
    assert index.statefulset_unknown(key, "u-next")  # a job re-created under the name: asked again
    # Seen later, it used to win ddp-0: another StatefulSet's uid under the victim's StatefulSet's name...
    index.set_pod(key, "victim-forged", observed_pod(raw("victim-forged", "s-forged", "Succeeded", "ddp-0")))
    # ...or the real uid, on a pod that is not the StatefulSet's rank by its name.
    index.set_pod(key, "victim-ddp-7", observed_pod(raw("victim-ddp-7", "s-real", "Succeeded", "ddp-0")))
    assert not index.statefulset_unknown(key, "u-victim")  # a forged uid costs no call once the real one is known
    seen = index.replicas(key, "u-victim")
    assert list(seen) == ["ddp-0"] and seen["ddp-0"].uid == "victim-ddp-0" and seen["ddp-0"].phase == "Running"
    index.set_statefulset(key, "u-victim", None)  # made again by the operator: its uid asked anew
    assert index.statefulset_unknown(key, "u-victim") and index.replicas(key, "u-victim") == {}


@pytest.mark.parametrize("kind, pod, expected", [
    ("DELETED", {"status": {"phase": "Running"}}, True),
    ("MODIFIED", {"metadata": {"deletionTimestamp": "2026-12-02T00:00:00Z"}, "status": {"phase": "Running"}}, True),
    ("MODIFIED", {"status": {"phase": "Failed"}}, True),
    ("MODIFIED", {"status": {"phase": "Running", "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"exitCode": 137}}}]}}, True),
    ("MODIFIED", {"status": {"phase": "Running", "containerStatuses": [
        {"name": "sidecar", "state": {"terminated": {"exitCode": 1}}}]}}, False),
    ("MODIFIED", {"status": {"phase": "Succeeded", "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"exitCode": 0}}}]}}, False),
    ("ADDED", {"status": {"phase": "Pending"}}, False),
    ("MODIFIED", {"status": {"phase": "Running"}}, False),
], ids=["deleted", "being deleted", "failed", "trainer ended badly", "a sidecar's end", "succeeded", "new", "running"])
def test_a_pod_that_died_or_went_is_urgent_and_one_that_starts_or_succeeds_is_routine(kind, pod, expected):
    assert observe.urgent(kind, pod) is expected


def test_a_failed_model_check_fails_the_pod_with_the_initializers_error_line():
    """spec.model.pretrained: the model-init container exits 3 naming the URI before the trainer starts; in a
    StatefulSet's pod (restartPolicy Always) the kubelet would run it again, so the pod counts as failed with
    that code and that line, which the job's failure message carries."""
    from kubetrain.engine import policy

    line = "python -m kubetrain.trainer initializer: error: s3://m/base/: model-00002.safetensors: checksum mismatch"
    waiting = pod({"state": {"waiting": {"reason": "PodInitializing"}}}, phase="Pending")
    waiting["status"]["initContainerStatuses"] = [{"name": "model-init", "restartCount": 1,
                                                   "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                                   "lastState": {"terminated": {"exitCode": 3,
                                                                                "message": f"INFO x\n{line}\n"}}}]
    obs = pod_observation(waiting)
    assert (obs.phase, obs.exit_code) == ("Failed", 3)
    assert obs.message == "s3://m/base/: model-00002.safetensors: checksum mismatch"
    assert observe.urgent("MODIFIED", waiting)
    failure = policy.Failure(obs.replica, exit_code=obs.exit_code, message=obs.message)
    assert failure.describe() == f"ddp-1 exited with code 3: {obs.message}"
    fine = pod({"state": {"running": {}}})
    fine["status"]["initContainerStatuses"] = [{"name": "model-init", "state": {"terminated": {"exitCode": 0}}}]
    assert (pod_observation(fine).phase, pod_observation(fine).message) == ("Running", "")
    assert not observe.urgent("MODIFIED", fine)
