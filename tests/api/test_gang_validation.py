"""spec.runPolicy.schedulingPolicy: every bad value named by its field path, exit 2, no traceback."""

from __future__ import annotations

import pytest
from test_validate import Case
from test_validate import test_invalid_manifest_is_rejected_with_its_field_path as refused_naming_its_path

from kubetrain_operator.api import from_object

SP = "spec.runPolicy.schedulingPolicy"


def doc(policy: dict, mode: str = "ParameterServer", **spec) -> dict:
    return {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "t"},
            "spec": {"mode": mode, "runPolicy": {"schedulingPolicy": policy}, **spec}}


CASES = [
    Case("unknown scheduler", doc({"gangScheduler": "kube-batch"}), f"{SP}.gangScheduler",
         "must be one of volcano, scheduler-plugins, got 'kube-batch'"),
    Case("minAvailable zero", doc({"minAvailable": 0}), f"{SP}.minAvailable", "must be at least 1, got 0"),
    Case("minAvailable past the parameter-server job's pods", doc({"minAvailable": 4},
         parameterServer={"replicas": 1, "workers": 2}), f"{SP}.minAvailable", "at most the job's 3 pod(s), got 4"),
    Case("minAvailable past the default parameter-server topology", doc({"minAvailable": 4}),
         f"{SP}.minAvailable", "at most the job's 3 pod(s), got 4"),
    Case("minAvailable past the DDP nodes", doc({"minAvailable": 3}, mode="DDP", ddp={"nodes": 2, "procsPerNode": 4}),
         f"{SP}.minAvailable", "at most the job's 2 pod(s), got 3"),
    Case("minAvailable past a single job's pod", doc({"minAvailable": 2}, mode="Single"),
         f"{SP}.minAvailable", "at most the job's 1 pod(s), got 2"),
    Case("queue not a DNS name", doc({"queue": "Team_A"}), f"{SP}.queue", "'Team_A' is not valid (expected a DNS-1123 name)"),
    Case("priorityClass not a DNS name", doc({"priorityClass": "High"}), f"{SP}.priorityClass", "expected a DNS-1123 name"),
    Case("minResources not a quantity", doc({"minResources": {"cpu": "lots"}}), f"{SP}.minResources.cpu",
         "expected a quantity such as 2, 500m or 4Gi, got 'lots'"),
    Case("minResources a boolean", doc({"minResources": {"memory": True}}), f"{SP}.minResources.memory",
         "expected a quantity"),
    Case("minResources an object", doc({"minResources": {"cpu": {"n": 1}}}), f"{SP}.minResources.cpu", "expected a quantity"),
    Case("scheduleTimeoutSeconds zero", doc({"scheduleTimeoutSeconds": 0}), f"{SP}.scheduleTimeoutSeconds",
         "must be at least 1, got 0"),
    Case("queue with scheduler-plugins", doc({"gangScheduler": "scheduler-plugins", "queue": "q"}), f"{SP}.queue",
         "applies to gangScheduler volcano only"),
    Case("priorityClass with scheduler-plugins", doc({"gangScheduler": "scheduler-plugins", "priorityClass": "p"}),
         f"{SP}.priorityClass", "applies to gangScheduler volcano only"),
    Case("scheduleTimeoutSeconds with Volcano", doc({"gangScheduler": "volcano", "scheduleTimeoutSeconds": 30}),
         f"{SP}.scheduleTimeoutSeconds", "applies to gangScheduler scheduler-plugins only"),
    Case("unknown field", doc({"minMember": 2}), f"{SP}.minMember", "unknown field"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_bad_scheduling_policy_is_refused_with_its_field_path(case, tmp_path, capsys):
    refused_naming_its_path(case, tmp_path, capsys)  # `kubetrain validate`: exit 2, the path, no traceback


def test_a_full_policy_is_read_as_written():
    policy = from_object(doc({"gangScheduler": "volcano", "minAvailable": 3, "queue": "research",
                              "minResources": {"cpu": 4, "memory": "8Gi", "nvidia.com/gpu": "2"},
                              "priorityClass": "high-priority"})).spec.run_policy.scheduling_policy
    assert (policy.gang_scheduler, policy.min_available, policy.queue, policy.priority_class) == (
        "volcano", 3, "research", "high-priority")
    assert policy.min_resources == {"cpu": 4, "memory": "8Gi", "nvidia.com/gpu": "2"}


def test_no_policy_means_no_gang():
    plain = {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "t"},
             "spec": {"mode": "Single"}}
    assert from_object(plain).spec.run_policy.scheduling_policy is None


def test_the_crd_does_not_default_the_policy_into_every_job():
    """An object field's schema gets `default: {}`; this one must not, or the API server would give
    every job an (empty) schedulingPolicy, and with it a PodGroup."""
    from kubetrain_operator.api import crd
    from kubetrain_operator.api.spec import Spec

    run_policy = crd.object_schema(Spec)["properties"]["runPolicy"]
    assert run_policy["default"] == {}  # the block around it is still defaulted
    policy = run_policy["properties"]["schedulingPolicy"]
    assert "default" not in policy
    assert policy["x-kubernetes-validations"] == [{"rule": "self == oldSelf", "message": "schedulingPolicy is immutable"}]


@pytest.mark.parametrize("flag, says", [
    ("kube-batch", "--gang-scheduler: expected volcano or scheduler-plugins[=SCHEDULER_NAME], got 'kube-batch'"),
    ("volcano=Not_A_Name", "--gang-scheduler: the scheduler name must be a DNS-1123 name, got 'Not_A_Name'"),
])
def test_the_operator_refuses_a_gang_scheduler_it_does_not_know_at_start(flag, says):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kubetrain_cli", "operator", "--gang-scheduler", flag],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_gang_scheduler_flags_keep_their_order_and_default_scheduler_names():
    from kubetrain_cli.commands import UsageError, parse_gang_schedulers

    assert parse_gang_schedulers(["scheduler-plugins", "volcano=vc"]) == (
        ("scheduler-plugins", "scheduler-plugins-scheduler"), ("volcano", "vc"))
    assert parse_gang_schedulers([]) == ()
    with pytest.raises(UsageError, match="volcano given twice"):
        parse_gang_schedulers(["volcano", "volcano=other"])
