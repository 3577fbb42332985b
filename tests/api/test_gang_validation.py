"""spec.runPolicy.schedulingPolicy: every bad value named by its field path, exit 2, no traceback."""

from __future__ import annotations

import pytest
from test_validate import Case
from test_validate import test_invalid_manifest_is_rejected_with_its_field_path as refused_naming_its_path

from kubetrain.api import from_object

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
         "must be a Kubernetes quantity such as 2, 500m, 4Gi or 1e3, from 0 to 9223372036854775807m"),
    Case("minResources a boolean", doc({"minResources": {"memory": True}}), f"{SP}.minResources.memory",
         "must be a Kubernetes quantity"),
    Case("minResources an object", doc({"minResources": {"cpu": {"n": 1}}}), f"{SP}.minResources.cpu",
         "must be a Kubernetes quantity"),
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
    from kubetrain.api import crd
    from kubetrain.api.spec import Spec

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

    done = subprocess.run([sys.executable, "-m", "kubetrain.cli", "operator", "--gang-scheduler", flag],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_gang_scheduler_flags_keep_their_order_and_default_scheduler_names():
    from kubetrain.cli.commands import UsageError, parse_gang_schedulers

    assert parse_gang_schedulers(["scheduler-plugins", "volcano=vc"]) == (
        ("scheduler-plugins", "scheduler-plugins-scheduler"), ("volcano", "vc"))
    assert parse_gang_schedulers([]) == ()
    with pytest.raises(UsageError, match="volcano given twice"):
        parse_gang_schedulers(["volcano", "volcano=other"])


# --- resource quantities: read once, at validation, within Kubernetes' bounds -------------------

QUANTITY = "must be a Kubernetes quantity such as 2, 500m, 4Gi or 1e3"
VOLCANO = {"gangScheduler": "volcano"}
W, PT = "spec.resources.worker", "spec.podTemplate.spec"


def sidecar(**resources) -> dict:
    return {"podTemplate": {"spec": {"containers": [{"name": "trainer"}, {"name": "side", "image": "busybox",
                                                                          "resources": resources}]}}}


QUANTITY_CASES = [
    # `int()` of this exponent once held the operator's interpreter 28.5 s in every round, then raised.
    Case("a million-digit request", doc(VOLCANO, resources={"worker": {"requests": {"cpu": "1e999999"}}}),
         f"{W}.requests.cpu", QUANTITY),
    Case("an exponent past Decimal's", doc(VOLCANO, resources={"worker": {"requests": {"cpu": "1e999999999"}}}),
         f"{W}.requests.cpu", QUANTITY),
    Case("limits not an object", doc(VOLCANO, resources={"worker": {"limits": "lots"}}), f"{W}.limits",
         "must be an object, got string"),
    Case("a limit that is no quantity", doc(VOLCANO, resources={"ps": {"limits": {"memory": "lots"}}}),
         "spec.resources.ps.limits.memory", QUANTITY),
    Case("a float", doc(VOLCANO, resources={"worker": {"requests": {"cpu": 0.5}}}), f"{W}.requests.cpu", QUANTITY),
    Case("a negative request", doc(VOLCANO, resources={"worker": {"requests": {"cpu": "-1"}}}),
         f"{W}.requests.cpu", QUANTITY),
    Case("past 64-bit milli-units", doc(VOLCANO, resources={"worker": {"requests": {"memory": "9Ei"}}}),
         f"{W}.requests.memory", QUANTITY),
    Case("one milli-unit past the bound", doc(VOLCANO, resources={"worker": {"requests": {"cpu": "9223372036854775808m"}}}),
         f"{W}.requests.cpu", QUANTITY),
    Case("an integer past the bound", doc(VOLCANO, resources={"worker": {"requests": {"cpu": 9223372036854776}}}),
         f"{W}.requests.cpu", QUANTITY),
    Case("a three-digit exponent", doc(VOLCANO, resources={"worker": {"requests": {"cpu": "1e-100"}}}),
         f"{W}.requests.cpu", QUANTITY),
    Case("minResources past the bound", doc({"minResources": {"cpu": "1e999999"}}), f"{SP}.minResources.cpu", QUANTITY),
    Case("a sidecar's request", doc(VOLCANO, **sidecar(requests={"cpu": "1e999999"})),
         f"{PT}.containers[1].resources.requests.cpu", QUANTITY),
    Case("an init container's limits", doc(VOLCANO, podTemplate={"spec": {"initContainers": [
        {"name": "fetch", "image": "busybox", "resources": {"limits": "lots"}}]}}),
         f"{PT}.initContainers[0].resources.limits", "must be an object, got string"),
]


@pytest.mark.parametrize("case", QUANTITY_CASES, ids=[c.name for c in QUANTITY_CASES])
def test_a_quantity_past_kubernetes_bounds_is_refused_with_its_field_path(case, tmp_path, capsys):
    refused_naming_its_path(case, tmp_path, capsys)


def test_quantities_within_kubernetes_bounds_are_accepted():
    requests = {"a": "9223372036854775807m", "b": 9223372036854775, "c": "8Pi", "d": "1e3", "e": "500m", "f": ".5",
                "g": "1.5Gi", "h": "0", "i": "+2", "j": "1.", "k": "2P", "l": "1e-9", "m": 3}
    job = from_object(doc(VOLCANO, resources={"worker": {"requests": requests, "limits": {"cpu": "4"}}},
                          **sidecar(limits={"memory": "1Gi"})))
    assert job.spec.resources.worker["requests"] == requests


def test_a_huge_quantity_is_refused_at_once():
    import time

    start = time.process_time()
    for value in ("1e999999", "1" * 5000, "9" * 63 + "Ei"):
        with pytest.raises(Exception, match="Kubernetes quantity"):
            from_object(doc(VOLCANO, resources={"worker": {"requests": {"cpu": value}}}))
    assert time.process_time() - start < 1.0


# --- another team's scheduling: the PodGroup's priority and queue, the pods' group keys -----------

PRIORITY_MESSAGE = ("a PriorityClass (priorityClassName: its pods may preempt others) is not allowed (the cluster's "
                    "kubetrain installation allows this with podSecurity.allow: [priorityClass])")
QUEUE_WORDS = "not a Volcano queue this kubetrain installation lets jobs name"


def validate(tmp_path, capsys, manifest: dict, *flags: str) -> tuple[int, str]:
    import yaml

    from kubetrain.cli import main

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    code = main(["validate", "--no-code-check", str(path), *flags])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.err


def test_the_podgroups_priority_class_needs_the_priority_class_allowance(tmp_path, capsys):
    """The PodGroup's priorityClassName orders (and lets Volcano preempt) whole gangs: the allowance the
    pods' own priorityClassName needs, which schedulingPolicy.priorityClass once went around."""
    job = doc({"gangScheduler": "volcano", "priorityClass": "system-cluster-critical"}, mode="Single")
    code, err = validate(tmp_path, capsys, job)
    assert code == 2 and f"{SP}.priorityClass: {PRIORITY_MESSAGE}" in err, err
    assert validate(tmp_path, capsys, job, "--allow", "priorityClass")[0] == 0


def test_a_volcano_queue_must_be_one_the_installation_lists(tmp_path, capsys):
    """Any team's Volcano queue (its share of the cluster) could be named; now only those the installation
    lists (the chart's gangScheduling.volcano.queues, the operator's --volcano-queues), none by default."""
    job = doc({"gangScheduler": "volcano", "queue": "team-b"}, mode="Single")
    for flags in ((), ("--volcano-queues", "team-a,research")):
        code, err = validate(tmp_path, capsys, job, *flags)
        assert code == 2 and f"{SP}.queue: {QUEUE_WORDS}" in err, err
    assert validate(tmp_path, capsys, job, "--volcano-queues", "team-a,team-b")[0] == 0
    assert validate(tmp_path, capsys, doc({"gangScheduler": "volcano"}, mode="Single"))[0] == 0  # Volcano's default


@pytest.mark.parametrize("where, key", [("labels", "scheduling.x-k8s.io/pod-group"),
                                        ("annotations", "scheduling.k8s.io/group-name"),
                                        ("annotations", "scheduling.volcano.sh/group-name"),
                                        ("annotations", "scheduling.volcano.sh/queue-name"),
                                        ("labels", "pod-group.scheduling.sigs.k8s.io")])
def test_a_template_may_not_file_its_pods_under_another_podgroup_or_queue(where, key, tmp_path, capsys):
    """A job's pods labelled or annotated with another job's PodGroup joined that gang (counted in its
    minMember, scheduled with it); a queue annotation put a job without a PodGroup into any queue."""
    from kubetrain.api.podtemplate import reserved_key_message

    job = doc({}, mode="Single", podTemplate={"metadata": {where: {key: "victim"}}})
    code, err = validate(tmp_path, capsys, job)
    assert code == 2 and f"spec.podTemplate.metadata.{where}: {reserved_key_message(key)}" in err, err
