"""Gang scheduling, rendered: a job's PodGroup for Volcano or scheduler-plugins, and its pods joined to it."""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal

import pytest

from kubetrain.api import from_object
from kubetrain.engine import gang
from kubetrain.engine.children import Settings, children
from kubetrain.engine.reconcile import reconcile

BOTH = Settings(gang_schedulers=(("volcano", "volcano"), ("scheduler-plugins", "scheduler-plugins-scheduler")))
PLUGINS_FIRST = Settings(gang_schedulers=(("scheduler-plugins", "default-scheduler"), ("volcano", "volcano")))


def job(mode, policy, **spec):
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": "j", "namespace": "ns"},
                        "spec": {"mode": mode, "runPolicy": {"schedulingPolicy": policy}, **spec}})


def podgroup(objs):
    [group] = [o for o in objs if o["kind"] == "PodGroup"]
    return group


def members(objs):
    """The pods, or the StatefulSet's pod template, that the scheduler sees."""
    return [o["spec"]["template"] if o["kind"] == "StatefulSet" else o for o in objs
            if o["kind"] in ("Pod", "StatefulSet")]


@dataclass
class Case:
    name: str
    mode: str
    policy: dict
    spec: dict = field(default_factory=dict)
    settings: Settings = BOTH
    api_version: str = "scheduling.volcano.sh/v1beta1"
    group_spec: dict = field(default_factory=dict)
    scheduler_name: str = "volcano"


PS_RESOURCES = {"ps": {"requests": {"cpu": "500m", "memory": "1Gi"}},
                "worker": {"limits": {"cpu": "1", "memory": "512Mi"}}}  # limits only: requests default to them

CASES = [
    Case("single, Volcano by default, all pods", "Single", {},
         group_spec={"minMember": 1}),
    Case("parameter server, Volcano with queue and priority, requests summed (limits where no request)",
         "ParameterServer", {"queue": "research", "priorityClass": "high"},
         spec={"parameterServer": {"replicas": 1, "workers": 2}, "resources": PS_RESOURCES},
         group_spec={"minMember": 3, "minResources": {"cpu": "2500m", "memory": "2Gi"},
                     "queue": "research", "priorityClassName": "high"}),
    Case("parameter server, minAvailable counts the shards first", "ParameterServer", {"minAvailable": 2},
         spec={"parameterServer": {"replicas": 1, "workers": 2}, "resources": PS_RESOURCES},
         group_spec={"minMember": 2, "minResources": {"cpu": "1500m", "memory": "1536Mi"}}),
    Case("DDP, scheduler-plugins named by the job, timeout, the StatefulSet's template joined", "DDP",
         {"gangScheduler": "scheduler-plugins", "scheduleTimeoutSeconds": 120},
         spec={"ddp": {"nodes": 3}, "resources": {"worker": {"requests": {"cpu": "2", "nvidia.com/gpu": "1"}}}},
         api_version="scheduling.x-k8s.io/v1alpha1",
         group_spec={"minMember": 3, "minResources": {"cpu": "6", "nvidia.com/gpu": "3"}, "scheduleTimeoutSeconds": 120},
         scheduler_name="scheduler-plugins-scheduler"),
    Case("the operator's first scheduler is the default, with its schedulerName", "Single", {},
         settings=PLUGINS_FIRST, api_version="scheduling.x-k8s.io/v1alpha1", group_spec={"minMember": 1},
         scheduler_name="default-scheduler"),
    Case("minResources given is taken as written", "DDP", {"minResources": {"cpu": 4, "memory": "8Gi"}},
         spec={"ddp": {"nodes": 2}, "resources": {"worker": {"requests": {"cpu": "1"}}}},
         group_spec={"minMember": 2, "minResources": {"cpu": "4", "memory": "8Gi"}}),
    Case("a sidecar's requests count, the larger init container's too", "Single", {},
         spec={"resources": {"worker": {"requests": {"cpu": "1"}}},
               "podTemplate": {"spec": {"containers": [{"name": "side", "image": "x",
                                                         "resources": {"requests": {"cpu": "250m"}}}],
                                        "initContainers": [{"name": "fetch", "image": "x",
                                                            "resources": {"requests": {"cpu": "100m",
                                                                                       "memory": "2Gi"}}}]}}},
         group_spec={"minMember": 1, "minResources": {"cpu": "1250m", "memory": "2Gi"}}),
    Case("a podTemplate's schedulerName wins; the group annotation stays", "Single", {},
         spec={"podTemplate": {"spec": {"schedulerName": "volcano-b"}}},
         group_spec={"minMember": 1}, scheduler_name="volcano-b"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_podgroup_and_its_members(case):
    objs = children(job(case.mode, case.policy, **case.spec), "uid-1", "tok", case.settings)
    group = podgroup(objs)
    assert group["apiVersion"] == case.api_version
    assert group["metadata"]["name"] == "j" and group["metadata"]["namespace"] == "ns"
    ref = group["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("TrainingJob", "j", "uid-1", True)
    assert group["spec"] == case.group_spec
    for member in members(objs):
        meta = member["metadata"]
        if case.api_version.startswith("scheduling.volcano.sh"):
            assert meta["annotations"]["scheduling.k8s.io/group-name"] == "j"
            assert "scheduling.x-k8s.io/pod-group" not in meta["labels"]
        else:
            assert meta["labels"]["scheduling.x-k8s.io/pod-group"] == "j"
            assert "scheduling.k8s.io/group-name" not in meta.get("annotations", {})
        assert member["spec"]["schedulerName"] == case.scheduler_name


@pytest.mark.parametrize("mode, spec", [("Single", {}), ("ParameterServer", {}), ("DDP", {})])
def test_the_podgroup_comes_before_every_pod(mode, spec):
    kinds = [o["kind"] for o in children(job(mode, {}, **spec), "u", "t", BOTH)]
    first_member = min(i for i, k in enumerate(kinds) if k in ("Pod", "StatefulSet"))
    assert kinds.index("PodGroup") < first_member


def test_without_a_scheduling_policy_there_is_no_podgroup_and_no_scheduler_name():
    plain = from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                         "metadata": {"name": "j", "namespace": "ns"}, "spec": {"mode": "ParameterServer"}})
    objs = children(plain, "u", "t", BOTH)
    assert not [o for o in objs if o["kind"] == "PodGroup"]
    assert all("schedulerName" not in m["spec"] for m in members(objs))


def test_a_round_creates_the_podgroup_once():
    j = job("Single", {})
    first = reconcile(j, "u", "t", {}, {}, 1000.0, settings=BOTH, existing=set())
    assert ("PodGroup", "j") in [(o["kind"], o["metadata"]["name"]) for o in first.create]
    again = reconcile(j, "u", "t", {}, {}, 1001.0, settings=BOTH, existing={("PodGroup", "j")})
    assert "PodGroup" not in [o["kind"] for o in again.create]


@dataclass
class Refusal:
    name: str
    policy: dict
    settings: Settings
    says: tuple[str, ...]


REFUSALS = [
    Refusal("no gang scheduler enabled", {}, Settings(), ("spec.runPolicy.schedulingPolicy", "serves gang schedulers: none")),
    Refusal("the one named is not enabled", {"gangScheduler": "volcano"},
            Settings(gang_schedulers=(("scheduler-plugins", "x"),)),
            ("gangScheduler volcano", "serves gang schedulers: scheduler-plugins", "gangScheduling.volcano.enabled")),
    Refusal("a Volcano field on the default scheduler-plugins", {"queue": "q"}, PLUGINS_FIRST,
            ("spec.runPolicy.schedulingPolicy.queue", "applies to gangScheduler volcano only")),
    Refusal("a scheduler-plugins field on the default Volcano", {"scheduleTimeoutSeconds": 5}, BOTH,
            ("spec.runPolicy.schedulingPolicy.scheduleTimeoutSeconds", "scheduler-plugins only")),
]


@pytest.mark.parametrize("case", REFUSALS, ids=lambda c: c.name)
def test_a_gang_the_operator_cannot_make_is_refused_naming_the_field(case):
    problem = gang.gang_problem(job("Single", case.policy), case.settings.gang_schedulers)
    assert problem is not None
    for text in case.says:
        assert text in problem


def test_rendering_without_a_scheduler_raises_rather_than_making_ungrouped_pods():
    with pytest.raises(ValueError, match="serves gang schedulers: none"):
        children(job("Single", {}), "u", "t", Settings())


def test_a_gang_the_operator_can_make_is_no_problem():
    assert gang.gang_problem(job("Single", {"queue": "q"}), BOTH.gang_schedulers) is None
    plain = from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                         "metadata": {"name": "j"}, "spec": {"mode": "Single"}})
    assert gang.gang_problem(plain, ()) is None


@pytest.mark.parametrize("value, text", [
    (Decimal("2.5"), "2500m"), (Decimal(6 * 2**30), "6Gi"), (Decimal(1536 * 2**20), "1536Mi"), (Decimal(3), "3"),
    (Decimal("0.0001"), "1m"),  # rounded up: a gang never asks for less than its pods need
    (Decimal(1000), "1000"),
])
def test_sums_are_written_exactly_or_rounded_up(value, text):
    assert gang.format_quantity(value) == text


@pytest.mark.parametrize("resources", [
    {"requests": {"cpu": "1e999999"}},  # once 28.5 s of int() holding the GIL, then ValueError, every round
    {"requests": {"cpu": "1e999999999"}},  # once decimal.Overflow
    {"limits": "lots"},  # once TypeError
    {"limits": {"memory": "lots"}, "requests": None},
    {"requests": {"cpu": 0.5, "memory": True, "x": {"n": 1}, "y": None}},
])
def test_what_validation_refuses_never_raises_or_stalls_the_gang_sums(resources):
    """Validation refuses these (tests/api/test_gang_validation.py); a spec that skipped it (an object
    the API server stored under an older CRD) still costs a round nothing and raises nothing."""
    import time

    start = time.process_time()
    pod = {"containers": [{"name": "trainer", "resources": resources},
                          {"name": "side", "resources": {"requests": {"cpu": "500m"}}}]}
    assert gang.min_resources([pod], 1) == {"cpu": "500m"}
    assert time.process_time() - start < 1.0


def test_a_template_podgroup_key_that_skipped_validation_never_reaches_a_pod():
    """Validation refuses a template's PodGroup and queue keys (api/podtemplate.GANG_KEYS); the renderer drops
    one that got past it, so a job's pods never join another job's gang, and a gang job's name its own."""
    import dataclasses

    victim = {"scheduling.k8s.io/group-name": "victim", "scheduling.x-k8s.io/pod-group": "victim",
              "scheduling.volcano.sh/queue-name": "team-b"}
    for policy, settings in ((None, Settings()), ({}, BOTH), ({"gangScheduler": "scheduler-plugins"}, BOTH)):
        j = job("Single", policy)
        j = dataclasses.replace(j, spec=dataclasses.replace(j.spec, pod_template={
            "metadata": {"labels": dict(victim), "annotations": dict(victim)}}))
        [pod] = members(children(j, "u", "t", settings))
        keys = {**pod["metadata"].get("labels", {}), **pod["metadata"].get("annotations", {})}
        assert "victim" not in keys.values() and "team-b" not in keys.values(), keys
