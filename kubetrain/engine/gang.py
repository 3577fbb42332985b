"""Gang scheduling: a job's PodGroup for Volcano or the scheduler-plugins coscheduling plugin.

Pure: the job (`spec.runPolicy.schedulingPolicy`), the operator's gang schedulers and the job's
rendered pods in; the PodGroup and what each pod must carry to belong to it out. The scheduler
admits a PodGroup's pods only when `minMember` of them fit at once (and, with `minResources`,
only when that much is free), so a job never holds half its replicas while waiting for the rest.

Neither scheduler runs on the test cluster: tests/operator/test_gang_scheduling.py checks the
objects against the projects' own CRDs (tests/assets/crds/), not the schedulers' behaviour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubetrain.api import TrainingJob, quantity
from kubetrain.api.crd import PRIORITY_CLASS_CHECK, QUEUE_MESSAGE
from kubetrain.api.spec import SchedulingPolicy

FIELD = "spec.runPolicy.schedulingPolicy"


@dataclass(frozen=True)
class GangScheduler:
    """One scheduler's PodGroup API and how a pod names its group."""

    name: str  # as spec.runPolicy.schedulingPolicy.gangScheduler and --gang-scheduler say it
    api_version: str
    plural: str
    default_scheduler_name: str
    """The pods' schedulerName unless the operator is told another (`--gang-scheduler KIND=NAME`)."""
    group_label: str | None = None
    group_annotation: str | None = None


VOLCANO = GangScheduler(
    name="volcano",
    api_version="scheduling.volcano.sh/v1beta1",
    plural="podgroups",
    default_scheduler_name="volcano",  # the name Volcano's own chart gives its scheduler
    group_annotation="scheduling.k8s.io/group-name",
)
SCHEDULER_PLUGINS = GangScheduler(
    name="scheduler-plugins",
    api_version="scheduling.x-k8s.io/v1alpha1",
    plural="podgroups",
    # The second scheduler scheduler-plugins' chart installs; a cluster that replaced its default
    # scheduler with one holding the plugin passes `--gang-scheduler scheduler-plugins=default-scheduler`.
    default_scheduler_name="scheduler-plugins-scheduler",
    group_label="scheduling.x-k8s.io/pod-group",
)
SCHEDULERS = {s.name: s for s in (VOLCANO, SCHEDULER_PLUGINS)}


def podgroup_name(job: TrainingJob) -> str:
    """The job's own name, as Kubeflow's training operator names its PodGroups: one per job."""
    return job.name


def chosen(policy: SchedulingPolicy, enabled: tuple[tuple[str, str], ...]) -> tuple[GangScheduler, str] | None:
    """The scheduler (and the pods' schedulerName) a job's policy gets from the operator's enabled
    ones ((kind, schedulerName) pairs, first = default); None when the operator does not serve it."""
    names = dict(enabled)
    kind = policy.gang_scheduler or (enabled[0][0] if enabled else None)
    if kind is None or kind not in names:
        return None
    return SCHEDULERS[kind], names[kind]


def gang_problem(job: TrainingJob, enabled: tuple[tuple[str, str], ...]) -> str | None:
    """Why this operator cannot give the job the PodGroup it asks for; None when it can (or none is asked)."""
    policy = job.spec.run_policy.scheduling_policy
    if policy is None:
        return None
    pick = chosen(policy, enabled)
    if pick is None:
        served = ", ".join(kind for kind, _ in enabled) or "none"
        wanted = f"gangScheduler {policy.gang_scheduler}" if policy.gang_scheduler else "a PodGroup"
        return (f"{FIELD}: the job asks for {wanted}, and this operator serves gang schedulers: {served}. "
                "Enable one in the chart (gangScheduling.volcano.enabled or gangScheduling.schedulerPlugins.enabled; "
                "the operator's --gang-scheduler), or remove the field")
    scheduler, _ = pick
    bad = policy.inapplicable(scheduler.name)
    if bad:
        return "; ".join(f"{FIELD}.{path}: {message}" for path, message in bad)
    return None


def policy_problems(job: TrainingJob, allowed: frozenset[str], queues: frozenset[str]) -> list[str]:
    """"<path>: <message>" for what the job's schedulingPolicy asks of other tenants, as the chart's admission
    policy judges it (api/crd.scheduling_validations): the PodGroup's priorityClass without the priorityClass
    allowance (Volcano orders, and preempts, whole gangs by it: the allowance the pods' own priorityClassName
    needs, which this field once went around), and a Volcano queue the installation does not list (`queues`:
    a queue is a team's share of the cluster; any could be named). Refused whichever scheduler is chosen."""
    policy = job.spec.run_policy.scheduling_policy
    if policy is None:
        return []
    problems = []
    if policy.priority_class and PRIORITY_CLASS_CHECK.allowance not in allowed:
        problems.append(f"{FIELD}.priorityClass: {PRIORITY_CLASS_CHECK.message}")
    if policy.queue and policy.queue not in queues:
        problems.append(f"{FIELD}.queue: {QUEUE_MESSAGE}")
    return problems


# --- resource quantities -----------------------------------------------------

_BINARY = ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki")


def format_quantity(amount: Decimal) -> str:
    """The shortest exact form of a whole amount (binary suffixes for exact multiples: memory reads
    as 6Gi, not 6442450944); a fraction in millicores, rounded up (a gang never asks for less)."""
    if amount == amount.to_integral_value():
        whole = int(amount)
        for suffix in _BINARY:
            unit = int(quantity.SUFFIXES[suffix])
            if whole and whole % unit == 0:
                return f"{whole // unit}{suffix}"
        return str(whole)
    return f"{math.ceil(amount * 1000)}m"


def pod_requests(pod_spec: dict[str, Any]) -> dict[str, Decimal]:
    """What the scheduler reserves for a pod: each resource's request (its limit when only that is
    set, as the API server defaults it) summed over the containers, or the largest init container's
    if that is more (init containers run one at a time, before the others).

    Every quantity here was read by validation (api/quantity.py; the spec's resources and the
    template's containers), so each is at most 9223372036854775807m and the sums stay small. One that
    is not (a spec that skipped validation) is left out, never raised: "1e999999" once cost 28.5 s of
    `int()` holding the interpreter, then a ValueError, in every round of its job."""

    def of(container: Any) -> dict[str, Decimal]:
        resources = container.get("resources") if isinstance(container, dict) else None
        if not isinstance(resources, dict):
            return {}
        wanted: dict[str, Any] = {}
        for kind in ("limits", "requests"):
            if isinstance(resources.get(kind), dict):
                wanted.update(resources[kind])
        out = {}
        for name, value in wanted.items():
            try:
                out[name] = quantity.parse(value)
            except quantity.QuantityError:
                continue
        return out

    total: dict[str, Decimal] = {}
    for container in pod_spec.get("containers") or []:
        for name, amount in of(container).items():
            total[name] = total.get(name, Decimal(0)) + amount
    for container in pod_spec.get("initContainers") or []:
        for name, amount in of(container).items():
            total[name] = max(total.get(name, Decimal(0)), amount)
    return total


def min_resources(pod_specs: list[dict[str, Any]], members: int) -> dict[str, str]:
    """The requests of the first `members` pods together (the plan's order: parameter servers
    before workers, so the shards every worker needs are counted first)."""
    total: dict[str, Decimal] = {}
    for spec in pod_specs[:members]:
        for name, amount in pod_requests(spec).items():
            total[name] = total.get(name, Decimal(0)) + amount
    return {name: format_quantity(amount) for name, amount in sorted(total.items()) if amount > 0}


# --- objects -----------------------------------------------------------------


def pod_group(job: TrainingJob, meta: dict[str, Any], scheduler: GangScheduler,
              pod_specs: list[dict[str, Any]]) -> dict[str, Any]:
    """The PodGroup; `meta` is the job's usual child metadata (name, labels, owner reference)."""
    policy = job.spec.run_policy.scheduling_policy
    assert policy is not None
    members = policy.min_available or job.spec.pod_count
    spec: dict[str, Any] = {"minMember": members}
    if policy.min_resources is not None:
        resources = {name: str(value) for name, value in policy.min_resources.items()}  # validated quantities
    else:
        resources = min_resources(pod_specs, members)
    if resources:
        spec["minResources"] = resources
    if scheduler is VOLCANO:
        if policy.queue:
            spec["queue"] = policy.queue
        if policy.priority_class:
            spec["priorityClassName"] = policy.priority_class
    elif policy.schedule_timeout_seconds is not None:
        spec["scheduleTimeoutSeconds"] = policy.schedule_timeout_seconds
    return {"apiVersion": scheduler.api_version, "kind": "PodGroup", "metadata": meta, "spec": spec}


def join_group(template: dict[str, Any], job: TrainingJob, scheduler: GangScheduler, scheduler_name: str) -> None:
    """Make a pod (or a StatefulSet's pod template) a member of the job's PodGroup, in place.

    The group's label or annotation is always set: a pod outside its group would be scheduled
    alone. schedulerName only when spec.podTemplate set none: a template naming one wins (a
    Volcano deployed under another name)."""
    meta = template.setdefault("metadata", {})
    if scheduler.group_label:
        meta.setdefault("labels", {})[scheduler.group_label] = podgroup_name(job)
    if scheduler.group_annotation:
        meta.setdefault("annotations", {})[scheduler.group_annotation] = podgroup_name(job)
    template["spec"].setdefault("schedulerName", scheduler_name)
