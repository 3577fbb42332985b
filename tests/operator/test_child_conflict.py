"""A child's name taken by an object the job does not own is reported, never adopted."""

from __future__ import annotations

import json

import pytest

from test_lifecycle import manifest, pods_of

pytestmark = pytest.mark.cluster


def test_a_configmap_of_the_same_name_owned_by_nobody_is_not_adopted(operator):
    doc = manifest(mode="Single")
    name = doc["metadata"]["name"]
    operator.kube.apply({"apiVersion": "v1", "kind": "ConfigMap",
                         "metadata": {"name": f"{name}-config", "namespace": operator.namespace},
                         "data": {"job.yaml": "someone else's"}})
    operator.apply(doc)
    status = operator.wait("a ChildConflict condition", lambda: (s := operator.job_status(name)) and any(
        c["reason"] == "ChildConflict" for c in s.get("conditions", [])) and s)
    message = next(c["message"] for c in status["conditions"] if c["reason"] == "ChildConflict")
    assert f"ConfigMap {operator.namespace}/{name}-config exists" in message and "will not adopt" in message
    assert any(e["reason"] == "ChildConflict" for e in operator.events(name))
    found = operator.get("configmap", f"{name}-config")
    assert found["data"] == {"job.yaml": "someone else's"} and not found["metadata"].get("ownerReferences")
    assert pods_of(operator, name) == {}  # nothing runs on another's configuration
    # Once the name is free, the job goes on by itself.
    operator.kubectl("delete", "configmap", f"{name}-config")
    operator.wait("the job's own pod", lambda: pods_of(operator, name), timeout=120)
    owned = operator.wait("its own ConfigMap", lambda: operator.get("configmap", f"{name}-config"))
    assert owned["metadata"]["ownerReferences"][0]["name"] == name


def conflict(operator, name: str) -> str:
    status = operator.wait("a ChildConflict condition", lambda: (s := operator.job_status(name)) and any(
        c["reason"] == "ChildConflict" for c in s.get("conditions", [])) and s)
    return next(c["message"] for c in status["conditions"] if c["reason"] == "ChildConflict")


def test_an_unowned_claim_labelled_as_the_jobs_is_not_adopted(operator):
    """A tenant who may create claims makes the victim's checkpoint claim, unowned and labelled with its
    name, before the victim starts: the operator took it for one kept from an earlier job of that name and
    mounted it, so the victim's checkpoints went where the tenant could read them (or it resumed from the
    tenant's). A claim is the job's only when the job owns it; one kept from an earlier job of the name
    is given to the new job by its owner, on purpose."""
    doc = manifest(mode="Single")
    name = doc["metadata"]["name"]
    claim = f"{name}-ckpt-single-0"
    operator.kube.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                         "metadata": {"name": claim, "namespace": operator.namespace,
                                      "labels": {"kubetrain.dev/job-name": name}},
                         "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    operator.apply(doc)
    message = conflict(operator, name)
    assert f"PersistentVolumeClaim {operator.namespace}/{claim} exists" in message and "will not adopt" in message
    assert pods_of(operator, name) == {}  # nothing writes its checkpoints to another's claim
    found = operator.get("persistentvolumeclaim", claim)
    assert not found["metadata"].get("ownerReferences")
    # Its owner gives it to the job on purpose (docs/operating.md: a kept claim): the job goes on by itself.
    uid = operator.get("trainingjob", name)["metadata"]["uid"]
    operator.kubectl("patch", "pvc", claim, "--type=merge", "-p", json.dumps({"metadata": {"ownerReferences": [
        {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "name": name, "uid": uid}]}}))
    operator.wait("the job's own pod", lambda: pods_of(operator, name), timeout=120)


def test_a_token_secret_made_before_the_job_first_started_is_not_used(operator):
    """The token Secret's name carries the job's uid, which anyone who may read the job reads. A tenant who
    may create Secrets makes it while the job waits (suspended, queued) with a token, a CA and a replica
    key of their own: the operator, which cannot read Secrets, took it for the job's own, and the job's
    parameter servers would have trusted the tenant's token and certificates. A Secret of that name the
    job did not make before it first started is not the job's."""
    doc = manifest(mode="Single", runPolicy={"suspend": True})
    name = doc["metadata"]["name"]
    operator.apply(doc)
    operator.wait("the job suspended", lambda: operator.job_status(name).get("state") == "Suspended")
    uid = operator.get("trainingjob", name)["metadata"]["uid"]
    secret = f"{name}-token-{uid[:8]}"
    operator.kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": operator.namespace},
                         "stringData": {"token": "the tenant's"}})
    operator.kubectl("patch", "trainingjob", name, "--type=merge", "-p", json.dumps({"spec": {"runPolicy": {"suspend": False}}}))
    message = conflict(operator, name)
    assert f"Secret {operator.namespace}/{secret} exists" in message and "will not" in message
    assert pods_of(operator, name) == {}  # no pod takes its token from another's Secret
    # Once the name is free, the job goes on by itself, with a Secret of its own.
    operator.kubectl("delete", "secret", secret)
    operator.wait("the job's own pod", lambda: pods_of(operator, name), timeout=120)
    owned = operator.wait("its own Secret", lambda: operator.get("secret", secret))
    assert owned["metadata"]["ownerReferences"][0]["uid"] == uid
