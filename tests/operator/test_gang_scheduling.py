"""Gang scheduling on the real API server: PodGroups against Volcano's and scheduler-plugins' own CRDs.

The CRDs are the projects' (tests/assets/crds/, README there); the schedulers are not run (neither
is served to these machines), so what is checked is what the operator makes: the PodGroup the API
server accepted under the real schema, its owner, and pods that name it and their scheduler. That
Volcano or the coscheduling plugin then places the gang together is the schedulers' own business.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
import yaml

from helpers.kube import wait_established
from support import ROOT
from test_lifecycle import manifest, pods_of

pytestmark = pytest.mark.cluster

CRDS = ROOT / "tests" / "assets" / "crds"
VOLCANO_CRD = "podgroups.scheduling.volcano.sh"
PLUGINS_CRD = "podgroups.scheduling.x-k8s.io"
CRD_FILES = {VOLCANO_CRD: CRDS / "scheduling.volcano.sh_podgroups.yaml",
             PLUGINS_CRD: CRDS / "scheduling.x-k8s.io_podgroups.yaml"}


def install(cluster, crd: str) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(CRD_FILES[crd]))
    wait_established(cluster, crd)


@pytest.fixture
def namespace(cluster):
    ns = f"gang-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    yield ns
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def gang_operator(cluster, spawn_operator, namespace: str, *args: str):
    """An operator serving both schedulers, Volcano the default, scheduler-plugins' pods under `sp-scheduler`."""
    proc = spawn_operator(namespace, "--gang-scheduler", "volcano", "--gang-scheduler", "scheduler-plugins=sp-scheduler",
                          *args)
    op = proc.handle(cluster, namespace)
    op.wait("the operator to start", lambda: proc.proc.poll() is not None or "startup" in proc.log.read_text().lower())
    assert proc.proc.poll() is None, proc.log.read_text()
    return op


def problem(op, name: str, reason: str) -> dict:
    """The job's condition of that reason, once it is there."""
    return op.wait(f"a {reason} condition on {name}", lambda: next(
        (c for c in op.job_status(name).get("conditions", []) if c["reason"] == reason), None))


def test_an_operator_without_gang_scheduling_fails_the_job_naming_the_field(operator):
    doc = manifest(mode="Single")
    doc["spec"]["runPolicy"] = {"schedulingPolicy": {"gangScheduler": "volcano"}}
    name = doc["metadata"]["name"]
    operator.apply(doc)
    cond = problem(operator, name, "GangSchedulingDisabled")
    assert "spec.runPolicy.schedulingPolicy" in cond["message"] and "gangScheduling.volcano.enabled" in cond["message"]
    assert operator.job_status(name)["state"] == "Failed"
    assert any(e["reason"] == "GangSchedulingDisabled" for e in operator.events(name))
    assert pods_of(operator, name) == {}  # no pod scheduled one by one in place of the gang


def test_without_the_podgroup_crd_the_job_waits_with_a_condition_and_goes_on_once_it_is_installed(
        cluster, spawn_operator, namespace):
    cluster.kubectl("delete", "crd", PLUGINS_CRD, "--ignore-not-found", "--wait=true")
    op = gang_operator(cluster, spawn_operator, namespace)
    doc = manifest(mode="Single")
    doc["spec"]["runPolicy"] = {"schedulingPolicy": {"gangScheduler": "scheduler-plugins"}}
    name = doc["metadata"]["name"]
    op.apply(doc)
    cond = problem(op, name, "PodGroupCRDMissing")
    assert PLUGINS_CRD in cond["message"] and "spec.runPolicy.schedulingPolicy" in cond["message"]
    assert any(e["reason"] == "PodGroupCRDMissing" for e in op.events(name))
    assert pods_of(op, name) == {}  # nothing past the missing PodGroup is made
    assert "Traceback" not in op.log.read_text()  # reported, not a crash
    install(cluster, PLUGINS_CRD)
    # Retried with backoff (at most ERROR_BACKOFF_CAP_SECONDS apart): the job goes on by itself.
    op.wait("the PodGroup", lambda: op.get(PLUGINS_CRD, name), timeout=90)
    op.wait("the job's pod", lambda: pods_of(op, name), timeout=60)


def test_each_scheduler_gets_its_podgroup_and_pods_that_name_it_and_the_podgroup_goes_with_the_job(
        cluster, spawn_operator, namespace):
    install(cluster, VOLCANO_CRD)
    install(cluster, PLUGINS_CRD)
    # The PodGroup's priority and queue only where the installation allows them (the next test).
    op = gang_operator(cluster, spawn_operator, namespace, "--pod-security-allow", "priorityClass",
                       "--volcano-queues", "research,team-a")
    ps = manifest(mode="ParameterServer", resources={"ps": {"requests": {"cpu": "500m", "memory": "1Gi"}},
                                                     "worker": {"requests": {"cpu": "1", "memory": "512Mi"}}})
    ps["spec"]["runPolicy"] = {"schedulingPolicy": {"queue": "research", "priorityClass": "high-priority"}}  # Volcano: the default
    ddp = manifest(mode="DDP", resources={"worker": {"requests": {"cpu": "2"}}})
    ddp["spec"]["ddp"]["nodes"] = 3
    ddp["spec"]["runPolicy"] = {"schedulingPolicy": {"gangScheduler": "scheduler-plugins", "minAvailable": 2,
                                                     "scheduleTimeoutSeconds": 90}}
    op.apply(ps)
    op.apply(ddp)
    ps_name, ddp_name = ps["metadata"]["name"], ddp["metadata"]["name"]
    uids = {n: op.get("trainingjob", n)["metadata"]["uid"] for n in (ps_name, ddp_name)}

    volcano = op.wait("Volcano's PodGroup", lambda: op.get(VOLCANO_CRD, ps_name))
    assert volcano["spec"] == {"minMember": 3, "minResources": {"cpu": "2500m", "memory": "2Gi"},
                               "queue": "research", "priorityClassName": "high-priority"}
    plugins = op.wait("scheduler-plugins' PodGroup", lambda: op.get(PLUGINS_CRD, ddp_name))
    assert plugins["spec"] == {"minMember": 2, "minResources": {"cpu": "4"}, "scheduleTimeoutSeconds": 90}
    for group, job in ((volcano, ps_name), (plugins, ddp_name)):
        [ref] = group["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("TrainingJob", job, uids[job], True)

    pods = op.wait("the parameter-server job's 3 pods", lambda: (p := pods_of(op, ps_name)) and len(p) == 3 and p)
    for pod in pods.values():
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == ps_name
        assert pod["spec"]["schedulerName"] == "volcano"
    # The StatefulSet controller makes the DDP pods from the template the operator joined to the group.
    pods = op.wait("the DDP job's 3 pods", lambda: (p := pods_of(op, ddp_name)) and len(p) == 3 and p)
    for pod in pods.values():
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == ddp_name
        assert pod["spec"]["schedulerName"] == "sp-scheduler"
    assert not [p for p in pods.values() if p["spec"].get("nodeName")]  # no other scheduler placed them

    # Owned by the job: the garbage collector deletes the PodGroup with it. It notices a CRD
    # installed moments ago only at its next discovery resync (every 30 s): about 18 s here.
    op.kubectl("delete", "trainingjob", ps_name, "--wait=false")
    op.wait("Volcano's PodGroup to go with its job", lambda: op.get(VOLCANO_CRD, ps_name) is None, timeout=60)


def test_a_podgroup_of_the_job_s_name_owned_by_another_is_not_adopted(cluster, spawn_operator, namespace):
    install(cluster, VOLCANO_CRD)
    op = gang_operator(cluster, spawn_operator, namespace)
    doc = manifest(mode="Single")
    doc["spec"]["runPolicy"] = {"schedulingPolicy": {}}
    name = doc["metadata"]["name"]
    op.kube.apply({"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup",
                   "metadata": {"name": name, "namespace": namespace}, "spec": {"minMember": 5}})
    op.apply(doc)
    cond = problem(op, name, "ChildConflict")
    assert f"PodGroup {namespace}/{name} exists" in cond["message"] and "will not adopt" in cond["message"]
    assert op.get(VOLCANO_CRD, name)["spec"]["minMember"] == 5  # untouched
    assert pods_of(op, name) == {}  # no pod joins a group the job does not own


@pytest.fixture
def crd_without_quantity_rules(cluster, crd):
    """The TrainingJob CRD without its quantity rules, as a cluster keeps a CRD of an older kubetrain (Helm
    never upgrades a chart's crds/); the session's CRD again afterwards."""
    from kubetrain.api import quantity

    def strip(node):
        if isinstance(node, dict):
            if node.get("x-kubernetes-int-or-string"):
                node.pop("maxLength", None)
            rules = [r for r in node.get("x-kubernetes-validations", []) if r.get("message") != quantity.MESSAGE]
            if "x-kubernetes-validations" in node:
                node["x-kubernetes-validations"] = rules
                if not rules:
                    del node["x-kubernetes-validations"]
            for value in node.values():
                strip(value)
        elif isinstance(node, list):
            for value in node:
                strip(value)

    older = yaml.safe_load(crd.read_text())
    strip(older)
    cluster.kube().run("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(older))
    wait_established(cluster, "trainingjobs.kubetrain.dev")
    try:
        yield
    finally:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
        wait_established(cluster, "trainingjobs.kubetrain.dev")


def test_a_quantity_past_kubernetes_bounds_fails_the_job_at_once_and_raises_in_no_round(
        cluster, spawn_operator, namespace, crd_without_quantity_rules):
    """requests.cpu "1e999999" once made every round of the job compute int() of a million-digit number
    (28.5 s holding the operator's interpreter, then ValueError and a traceback, retried for ever);
    "1e999999999" raised decimal.Overflow. The CRD refuses both now (tests/cluster/test_api.py); under
    an older CRD the operator fails the job once, naming the field, and makes nothing for it."""
    install(cluster, VOLCANO_CRD)
    op = gang_operator(cluster, spawn_operator, namespace)
    docs = []
    for cpu in ("1e999999", "1e999999999", "1"):
        doc = manifest(mode="Single", resources={"worker": {"requests": {"cpu": cpu}}})
        doc["spec"]["runPolicy"] = {"schedulingPolicy": {"gangScheduler": "volcano"}}
        docs.append(doc)
    docs[2]["spec"]["podTemplate"] = {"spec": {"containers": [{"name": "side", "image": "busybox",
                                                               "resources": {"limits": {"memory": "9Ei"}}}]}}
    start = time.monotonic()
    for doc in docs:
        op.apply(doc)
    for doc, path in ((docs[0], "spec.resources.worker.requests.cpu"), (docs[1], "spec.resources.worker.requests.cpu"),
                      (docs[2], "spec.podTemplate.spec.containers[0].resources.limits.memory")):
        name = doc["metadata"]["name"]
        failed = problem(op, name, "InvalidSpec")
        assert f"{path}: must be a Kubernetes quantity" in failed["message"], failed["message"]
        assert op.job_status(name)["state"] == "Failed"
        assert op.get(VOLCANO_CRD, name) is None and pods_of(op, name) == {}
    assert time.monotonic() - start < 30
    log = op.log.read_text()
    assert "Traceback" not in log and "Overflow" not in log and "Exceeds the limit" not in log, log[-3000:]


def test_another_teams_queue_or_a_podgroup_priority_fails_the_job_and_no_podgroup_is_made(
        cluster, spawn_operator, namespace):
    """schedulingPolicy.queue and .priorityClass reached the PodGroup unchecked: any team's Volcano queue,
    and a priority past the allowance the pods' own priorityClassName needs. The operator refuses what its
    installation does not list or allow (--volcano-queues, --pod-security-allow), as the chart's admission
    policy does (tests/cluster/test_api.py), with the same messages."""
    from kubetrain.api.crd import PRIORITY_CLASS_CHECK, QUEUE_MESSAGE

    install(cluster, VOLCANO_CRD)
    op = gang_operator(cluster, spawn_operator, namespace, "--volcano-queues", "research")
    refused = {}
    for field, value, message in (("queue", "team-b", QUEUE_MESSAGE),
                                  ("priorityClass", "system-cluster-critical", PRIORITY_CLASS_CHECK.message)):
        doc = manifest(mode="Single")
        doc["spec"]["runPolicy"] = {"schedulingPolicy": {"gangScheduler": "volcano", field: value}}
        op.apply(doc)
        refused[doc["metadata"]["name"]] = f"spec.runPolicy.schedulingPolicy.{field}: {message}"
    listed = manifest(mode="Single")
    listed["spec"]["runPolicy"] = {"schedulingPolicy": {"queue": "research"}}
    op.apply(listed)
    for name, says in refused.items():
        cond = problem(op, name, "PodSecurity")
        assert says in cond["message"], cond["message"]
        assert op.job_status(name)["state"] == "Failed"
        assert op.get(VOLCANO_CRD, name) is None and pods_of(op, name) == {}
    group = op.wait("the listed queue's PodGroup", lambda: op.get(VOLCANO_CRD, listed["metadata"]["name"]))
    assert group["spec"]["queue"] == "research"
    assert "Traceback" not in op.log.read_text()
