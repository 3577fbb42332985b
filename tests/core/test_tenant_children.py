"""Every pod a tenant's job brings into its namespace keeps the rules its trainer pods keep (helpers/childpods.py):
a fine-tuning job's (its model-init init container, the copy of its model on the pod's disk) and a fault-tolerant
job's (its Lighthouse), and the client's export pod of each, in a namespace whose ResourceQuota counts cpu and
memory limits. Tenants, fourth pass (issue 58)."""

from __future__ import annotations

import pytest

from kubetrain.api import from_object
from kubetrain.engine.children import children

from helpers.childpods import child_pods, judge

QUOTA = ("cpu", "memory")
"""What a namespace's ResourceQuota counts as limits (no LimitRange default): a pod without them is refused."""
# The trainer's limits come from the template, as a tenant under such a quota writes them.
TRAINER_LIMITS = {"spec": {"containers": [{"name": "trainer", "resources": {
    "limits": {"cpu": "2", "memory": "8Gi"}}}]}}
TEXT = {"uri": "s3://data/text/", "format": "text", "secretRef": "s3-creds"}


def manifest(**spec) -> dict:
    return {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j", "namespace": "ns"},
            "spec": {"podTemplate": TRAINER_LIMITS, **spec}}


FINE_TUNING = manifest(mode="DDP", dataset=TEXT, ddp={"nodes": 2, "strategy": "FSDP"},
                       model={"name": "causal-lm", "pretrained": "s3://models/base/", "secretRef": "s3-creds"},
                       checkpoint={"storage": {"uri": "s3://ckpt/jobs/j/", "secretRef": "s3-creds"}})
FAULT_TOLERANT = manifest(mode="DDP", ddp={"nodes": 3, "faultTolerance": {}})
FAULT_TOLERANT_OF_SPEC_RESOURCES = manifest(  # the trainers' limits from spec.resources, none in the template
    mode="DDP", ddp={"nodes": 3, "faultTolerance": {}}, podTemplate={},
    resources={"worker": TRAINER_LIMITS["spec"]["containers"][0]["resources"]})
FAULT_TOLERANT_FINE_TUNING = manifest(
    mode="DDP", dataset=TEXT, ddp={"nodes": 2, "faultTolerance": {}},
    model={"name": "causal-lm", "pretrained": "s3://models/base/", "secretRef": "s3-creds"})
SINGLE_FROM_A_CLAIM = manifest(mode="Single", dataset=TEXT,
                               model={"name": "causal-lm", "pretrained": "pvc://models/llama/v2"})


@pytest.mark.parametrize("doc", [FINE_TUNING, FAULT_TOLERANT, FAULT_TOLERANT_OF_SPEC_RESOURCES,
                                 FAULT_TOLERANT_FINE_TUNING, SINGLE_FROM_A_CLAIM],
                         ids=["fine-tuning", "fault-tolerant", "fault-tolerant, spec.resources",
                              "fault-tolerant fine-tuning", "a claim's model"])
def test_every_child_pod_keeps_the_rules_of_the_trainer_pods(doc):
    pods = child_pods(from_object(doc))
    assert {n: judge(pod, QUOTA) for n, pod in pods.items()} == {n: [] for n in pods}


def test_each_kind_of_child_is_judged():
    """The judge sees what the issue's cases are about: model-init and the model's volume in a fine-tuning pod,
    the Lighthouse pod of a fault-tolerant job, and the export pod."""
    tuned = child_pods(from_object(FINE_TUNING))
    assert sorted(tuned) == ["j-ddp", "j-export"]
    assert [c["name"] for c in tuned["j-ddp"]["spec"]["initContainers"]] == ["model-init"]
    assert any(v["name"] == "model" for v in tuned["j-ddp"]["spec"]["volumes"])
    assert sorted(child_pods(from_object(FAULT_TOLERANT))) == ["j-ddp", "j-export", "j-lighthouse-0"]


def rendered(job) -> dict[str, dict]:
    return {o["metadata"]["name"]: o["spec"]["template"] if o["kind"] == "StatefulSet" else o
            for o in children(job, "uid", "token") if o["kind"] in ("Pod", "StatefulSet")}


def test_the_judge_refuses_what_the_issue_found():
    """Each finding of the issue, rendered as it was (a template past validation, kubetrain's bounds taken off),
    is a refusal naming its field: the rules hold, so a pass above means something."""
    job = from_object(FINE_TUNING)
    job.spec.pod_template = {"spec": {"containers": [
        {"name": "model-init", "image": "busybox", "securityContext": {"allowPrivilegeEscalation": False}},
        *TRAINER_LIMITS["spec"]["containers"]]}}
    node = rendered(job)["j-ddp"]
    for volume in node["spec"]["volumes"]:
        volume.get("emptyDir", {}).pop("sizeLimit", None)  # the model's copy unbounded, as before
    node["spec"]["initContainers"][0].pop("resources", None)  # model-init without the trainer's limits, as before
    found = judge(node, QUOTA)
    assert "spec.containers[model-init].name: two containers of one name" in found
    assert "spec.volumes[model].emptyDir.sizeLimit: none, for a volume a download fills" in found
    assert "spec.containers[model-init].resources.limits.cpu: none, which the namespace's quota requires" in found
    env = next(c for c in node["spec"]["containers"] if c["name"] == "trainer")["env"]
    next(e for e in env if e["name"] == "KUBETRAIN_MODEL_DIR")["value"] = "/kubetrain/pretrained/llama/../../../proc"
    assert ("spec.containers[trainer].env[KUBETRAIN_MODEL_DIR]: '/kubetrain/pretrained/llama/../../../proc' is not "
            "an absolute path without '.', '..' or empty segments") in judge(node, QUOTA)

    lighthouse = rendered(from_object(FAULT_TOLERANT))["j-lighthouse-0"]
    assert judge(lighthouse, QUOTA) == []
    lighthouse["spec"]["containers"][0].pop("resources")  # the Lighthouse without resources, as before
    assert judge(lighthouse, QUOTA) == [
        f"spec.containers[trainer].resources.limits.{r}: none, which the namespace's quota requires" for r in QUOTA]
