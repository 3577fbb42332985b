"""A child's name taken by an object the job does not own is reported, never adopted."""

from __future__ import annotations

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
